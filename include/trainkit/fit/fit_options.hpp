#pragma once
/// The fit loop's run-time settings (FitOptions), with fluent setters as TrainerOptions.
/// tk::RunPlan (plan.hpp) fills them from a validated configuration.

#include <torch/arg.h>

#include <cstdint>
#include <iostream>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

/// How a checkpoint is written (TRAIN.CHECKPOINT_FORMAT; CheckpointManager, checkpoint.hpp).
enum class CheckpointFormat {
  automatic,  ///< a set when the update is sharded over several ranks, else one file
  single,     ///< one file: the main rank gathers the sharded state and writes it
  sharded,    ///< a set: every rank writes its own pieces (one rank: a set of one file)
};
/// TRAIN.CHECKPOINT_FORMAT's names: "auto", "single", "sharded".
inline CheckpointFormat checkpoint_format_of(const std::string& name) {
  if (name == "single") return CheckpointFormat::single;
  if (name == "sharded") return CheckpointFormat::sharded;
  if (name == "auto") return CheckpointFormat::automatic;
  throw std::invalid_argument("checkpoint format '" + name + "': use auto, single or sharded");
}

/// Run-time settings of the loop; RunPlan::from(config).fit has them from a configuration.
struct FitOptions {
  TORCH_ARG(std::string, output_path) = "./output";    ///< checkpoints and logs (OUTPUT_PATH)
  TORCH_ARG(std::string, prefix) = "model";            ///< checkpoint file prefix (MODEL_PREFIX)
  TORCH_ARG(std::int64_t, begin_epoch) = 0;            ///< TRAIN.BEGIN_EPOCH
  TORCH_ARG(std::int64_t, end_epoch) = 0;              ///< TRAIN.END_EPOCH (exclusive)
  TORCH_ARG(std::int64_t, log_frequent) = 50;          ///< log every N optimizer windows
  TORCH_ARG(std::int64_t, val_frequent) = 1;           ///< validate every N epochs
  /// ZeRO stage 3: the validation gathers each unit for its call and releases it after
  /// (AnyTrainer::evaluate_by_unit: a rank holds one unit at a time); false holds every unit
  /// gathered through it instead (hold_parameters: the whole model on every rank while it runs,
  /// no collective between its forwards). By unit, a rank whose forwards end sooner gathers with
  /// the others until every rank is done: at the validation's end, or at the task's own sum over
  /// the ranks through DataParallel::all_reduce (Replicas::all_reduce), which joins them first.
  /// Only that call joins: a collective of the task's own made any other way (Replicas::sum,
  /// its own process group, a checkpoint) while another rank still forwards would meet that
  /// rank's gathers: hold then.
  TORCH_ARG(bool, validate_by_unit) = true;
  TORCH_ARG(std::int64_t, checkpoint_frequent) = 1;    ///< checkpoint every N epochs
  TORCH_ARG(std::int64_t, checkpoint_keep) = 3;        ///< newest checkpoints kept, plus the best
  /// Checkpoint files written by a thread while training goes on (TRAIN.CHECKPOINT_BACKGROUND):
  /// the loop pauses only to copy the state to host memory (CheckpointManager::save_in_background). A failed write stops the run at the next
  /// micro-batch, naming the file; the run's last checkpoint is complete before fit returns.
  TORCH_ARG(bool, background_checkpoints) = true;
  /// One file per checkpoint, or a set with a file per rank and an index (TRAIN.CHECKPOINT_FORMAT;
  /// docs/guide/checkpoints.md): automatic writes a set when the update is sharded (ZERO_STAGE
  /// 1-2 with several ranks), so that no rank gathers the state.
  TORCH_ARG(CheckpointFormat, checkpoint_format) = CheckpointFormat::automatic;
  TORCH_ARG(bool, resume) = false;                     ///< TRAIN.RESUME
  TORCH_ARG(bool, auto_resume) = true;                 ///< TRAIN.AUTO_RESUME
  TORCH_ARG(std::int64_t, seed) = -1;                  ///< the run's seed (recorded, checked on resume)
  /// Samples per optimizer step over every process (RunPlan's total_batch; 0: not known).
  /// Recorded in checkpoints: a resume at another world size must keep it (TRAIN.TARGET_BATCH).
  TORCH_ARG(std::int64_t, total_batch) = 0;
  /// The seed was drawn (RNG_SEED -1): the loop says which at start, so the run can be repeated.
  TORCH_ARG(bool, seed_drawn) = false;
  TORCH_ARG(std::string, config_json) = {};            ///< the resolved configuration, for checkpoints
  /// FP32, BF16, FP16 with a static loss scale and a dynamic one at its floor: skipped
  /// (non-finite) optimizer steps, with no clean log interval between them, that stop the run
  /// (TRAIN.NONFINITE_PATIENCE; checked at log windows and epoch ends); the first is a warning.
  TORCH_ARG(std::int64_t, nonfinite_patience) = 20;
  /// The forward's peaks (TRAIN.FORWARD_PEAKS; trainer/forward_peaks.hpp): the forward of each
  /// log window's micro-batches is recorded, and the largest |output| of each module logged
  /// (forward-peak/<module> scalars, a line in the text log; a warning names the module where
  /// the output first stops being finite). Costs nothing when off, and between log windows.
  TORCH_ARG(bool, forward_peaks) = false;
  /// A resume from a checkpoint whose configuration (config_json) differs in a key that changes
  /// the trajectory: refused with the differences (false), or allowed and said (true)
  /// (TRAIN.RESUME_CHANGES; resume_changes.hpp says which keys may change freely).
  TORCH_ARG(bool, allow_resume_changes) = false;
  /// SIGINT/SIGTERM stop the loop gracefully (off: the signals keep their handlers).
  TORCH_ARG(bool, handle_signals) = true;
  /// Write checkpoints and logs (false on data-parallel ranks other than 0; they still resume).
  TORCH_ARG(bool, write_files) = true;
  /// Progress lines on stderr.
  TORCH_ARG(bool, progress) = true;
  /// The run's text log, <output_path>/<prefix>-log.txt (log/text_log.hpp).
  TORCH_ARG(bool, text_log) = true;
  /// Micro-batches made ahead of the step on this many threads (NUM_WORKERS_PER_GPU); 0: made
  /// when needed, on the training thread. With workers, task.batch runs on those threads,
  /// concurrently with the step and with itself (see Task::batch).
  TORCH_ARG(std::int64_t, workers) = 0;
  /// Memory for training (TRAIN.MEMORY_BUDGET): a fraction of the device's memory (<= 1) or
  /// bytes; 0: no plan. With a budget, fit measures one forward+backward at a few piece sizes
  /// of a real micro-batch and runs each micro-batch as pieces that fit (task.split; fit.hpp,
  /// "Memory"). The optimizer step stays the whole micro-batch's.
  TORCH_ARG(double, memory_budget) = 0;
  /// The largest piece of a micro-batch, in items (task.items), that one forward+backward
  /// runs (TRAIN.PIECE_ITEMS); larger micro-batches are split (task.split). 0: whole micro-batches, unless a
  /// memory budget plans it. Halved when memory runs out (the window is replayed).
  TORCH_ARG(std::int64_t, piece_items) = 0;

 public:
  /// Throws std::invalid_argument naming the first option out of range.
  void validate() const;
};

inline void FitOptions::validate() const {
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
