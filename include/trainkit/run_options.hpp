#pragma once
/// From a validated Config to the run-time options of each part, in one place:
///   config.derived()          world size, total batch, base LR, trainer key, optimizer (config.hpp)
///   trainer_options(config)   TrainerOptions: loss-scale knobs, clip thresholds, window length...
///   fit_options(config)       FitOptions: output path, epochs, log/validation/checkpoint rhythm...
/// Each reads only the keys it maps; a key maps to exactly one option.
#include <trainkit/config.hpp>
#include <trainkit/options.hpp>

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

/// The run-time numbers of a configuration: loss scale knobs, clip thresholds, the window
/// length (for AccumulationPolicy<Dynamic>), the partial-window rule, the non-finite rule,
/// the LR_MULT groups, and the resolved configuration as JSON for checkpoints.
inline TrainerOptions trainer_options(const Config& config) {
  const nlohmann::json& t = config.tree()["TRAIN"];
  LossScaleOptions scale;
  scale.init_scale(t["FP16_INIT_SCALE"].get<double>())
      .growth_factor(t["FP16_GROWTH_FACTOR"].get<double>())
      .backoff_factor(t["FP16_BACKOFF_FACTOR"].get<double>())
      .growth_interval(t["FP16_GROWTH_INTERVAL"].get<std::int64_t>())
      .hysteresis(t["FP16_HYSTERESIS"].get<std::int64_t>())
      .min_scale(t["FP16_MIN_LOSS_SCALE"].get<double>())
      .max_scale(t["FP16_MAX_LOSS_SCALE"].get<double>());
  if (t["FP16_LOSS_SCALE"].is_number()) scale.static_scale(t["FP16_LOSS_SCALE"].get<double>());

  TrainerOptions o;
  o.loss_scale(scale);
  // Off (<= 0) leaves the option at its default: the policy type says whether it is used.
  if (t["CLIP_GRAD_NORM"].get<double>() > 0) o.max_grad_norm(t["CLIP_GRAD_NORM"].get<double>());
  if (t["CLIP_GRAD_VALUE"].get<double>() > 0) o.clip_value(t["CLIP_GRAD_VALUE"].get<double>());
  o.accumulation_steps(t["GRAD_ACCUMULATE_STEPS"].get<std::int64_t>());
  const std::string partial = t["PARTIAL_WINDOW"].get<std::string>();
  o.partial_window(partial == "span" ? PartialWindow::span : partial == "drop" ? PartialWindow::drop : PartialWindow::flush);
  o.nonfinite(t["NONFINITE"].get<std::string>() == "abort" ? NonFinite::abort : NonFinite::skip);
  std::vector<std::pair<std::string, double>> groups;  // TrainerOptions::lr_mult
  for (const auto& pair : t["LR_MULT"]) groups.emplace_back(pair[0].get<std::string>(), pair[1].get<double>());
  o.lr_mult(std::move(groups));
  o.no_decay(t["NO_DECAY"].get<std::vector<std::string>>());
  // keep_norm_fp32 keeps its default (on, as Apex O2's keep_batchnorm_fp32).
  o.config_json(config.dump(-1));
  return o;
}

/// Run-time settings of the loop; fit_options(config) fills them from a validated Config.
struct FitOptions {
  TORCH_ARG(std::string, output_path) = "./output";    ///< checkpoints and logs (OUTPUT_PATH)
  TORCH_ARG(std::string, prefix) = "model";            ///< checkpoint file prefix (MODEL_PREFIX)
  TORCH_ARG(std::int64_t, begin_epoch) = 0;            ///< TRAIN.BEGIN_EPOCH
  TORCH_ARG(std::int64_t, end_epoch) = 0;              ///< TRAIN.END_EPOCH (exclusive)
  TORCH_ARG(std::int64_t, log_frequent) = 50;          ///< log every N optimizer windows
  TORCH_ARG(std::int64_t, val_frequent) = 1;           ///< validate every N epochs
  TORCH_ARG(std::int64_t, checkpoint_frequent) = 1;    ///< checkpoint every N epochs
  TORCH_ARG(std::int64_t, checkpoint_keep) = 3;        ///< newest checkpoints kept, plus the best
  TORCH_ARG(bool, resume) = false;                     ///< TRAIN.RESUME
  TORCH_ARG(bool, auto_resume) = true;                 ///< TRAIN.AUTO_RESUME
  TORCH_ARG(std::int64_t, seed) = -1;                  ///< the run's seed (recorded, checked on resume)
  TORCH_ARG(std::string, config_json) = {};            ///< the resolved configuration, for checkpoints
  /// FP32/BF16: skipped (non-finite) optimizer steps, with no clean log interval between them,
  /// that stop the run (TRAIN.NONFINITE_PATIENCE); the first is a warning.
  TORCH_ARG(std::int64_t, nonfinite_patience) = 20;
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
  /// runs; larger micro-batches are split (task.split). 0: whole micro-batches, unless a
  /// memory budget plans it. Halved when memory runs out (the window is replayed).
  TORCH_ARG(std::int64_t, piece_items) = 0;

 public:
  /// Throws std::invalid_argument naming the first option out of range.
  void validate() const {
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
};

/// The loop's settings from a validated configuration (with --model-dir and --resume already
/// applied as overrides, see CommandLine). RNG_SEED -1 draws a random seed and says which on
/// stderr, so that the run can be repeated; `seed`, when given, is used instead of RNG_SEED's
/// draw (launch.hpp: one seed for every rank).
inline FitOptions fit_options(const Config& config, std::optional<std::int64_t> seed_drawn = std::nullopt) {
  const nlohmann::json& t = config.tree();
  const nlohmann::json& train = t["TRAIN"];
  FitOptions o;
  o.output_path(t["OUTPUT_PATH"].get<std::string>())
      .prefix(t["MODEL_PREFIX"].get<std::string>())
      .begin_epoch(train["BEGIN_EPOCH"].get<std::int64_t>())
      .end_epoch(train["END_EPOCH"].get<std::int64_t>())
      .log_frequent(t["LOG_FREQUENT"].get<std::int64_t>())
      .val_frequent(t["VAL_FREQUENT"].get<std::int64_t>())
      .checkpoint_frequent(t["CHECKPOINT_FREQUENT"].get<std::int64_t>())
      .checkpoint_keep(train["CHECKPOINT_KEEP"].get<std::int64_t>())
      .nonfinite_patience(train["NONFINITE_PATIENCE"].get<std::int64_t>())
      .allow_resume_changes(train["RESUME_CHANGES"].get<std::string>() == "allow")
      .resume(train["RESUME"].get<bool>())
      .auto_resume(train["AUTO_RESUME"].get<bool>())
      .workers(t["NUM_WORKERS_PER_GPU"].get<std::int64_t>())
      .memory_budget(train["MEMORY_BUDGET"].get<double>())
      .config_json(config.dump(-1));
  std::int64_t seed = t["RNG_SEED"].get<std::int64_t>();
  if (seed < 0 && seed_drawn) {
    seed = *seed_drawn;
  } else if (seed < 0) {
    seed = static_cast<std::int64_t>(std::random_device{}() & 0x7fffffff);
    std::cerr << "trainkit: RNG_SEED is -1: this run uses seed " << seed << " (set RNG_SEED: " << seed
              << " to repeat it)\n";
  }
  o.seed(seed);
  return o;
}

}  // namespace trainkit
