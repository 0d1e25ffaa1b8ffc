#pragma once
/// The definitions of trainkit/fit_options.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/fit_options.hpp>

namespace trainkit {

TRAINKIT_INLINE void FitOptions::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument("trainkit::FitOptions: " + what); };
  if (begin_epoch_ < 0) fail("begin_epoch must be >= 0, got " + std::to_string(begin_epoch_));
  if (end_epoch_ <= begin_epoch_)
    fail("end_epoch (" + std::to_string(end_epoch_) + ") must be > begin_epoch (" + std::to_string(begin_epoch_) +
         ") to train (TRAIN.END_EPOCH)");
  if (log_frequent_ < 1) fail("log_frequent must be >= 1 (LOG_FREQUENT)");
  if (val_frequent_ < 1) fail("val_frequent must be >= 1 (VAL_FREQUENT)");
  if (checkpoint_frequent_ < 1) fail("checkpoint_frequent must be >= 1 (CHECKPOINT_FREQUENT)");
  if (checkpoint_keep_ < 1) fail("checkpoint_keep must be >= 1 (TRAIN.CHECKPOINT_KEEP)");
  if (nonfinite_patience_ < 1) fail("nonfinite_patience must be >= 1 (TRAIN.NONFINITE_PATIENCE)");
  if (workers_ < 0 || workers_ > 64) fail("workers must be in [0, 64] (NUM_WORKERS_PER_GPU), got " + std::to_string(workers_));
  if (output_path_.empty()) fail("output_path is empty (OUTPUT_PATH / --model-dir)");
  if (!(memory_budget_ >= 0)) fail("memory_budget must be >= 0 (TRAIN.MEMORY_BUDGET), got " + std::to_string(memory_budget_));
  if (piece_items_ < 0) fail("piece_items must be >= 0, got " + std::to_string(piece_items_));
}

}  // namespace trainkit
