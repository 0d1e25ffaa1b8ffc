#pragma once
/// The run a configuration asks for, read once. RunPlan::from(config) turns a validated Config
/// into typed values: the Trainer type (TrainerKey) and its TrainerOptions, the optimizer, the
/// fit loop's FitOptions, the LR schedule and the batch arithmetic. Every key is read in
/// exactly one function below (one per concern); Config itself only validates and holds the
/// tree.
///
///   const tk::RunPlan plan = tk::RunPlan::from(config);    // world size: WORLD_SIZE, or 1
///   auto trainer = tk::make_trainer(plan, model);          // trainkit::registry
///   trainer->set_schedule(plan.make_schedule(task.batches_per_epoch(0)));
///   tk::fit(*trainer, task, plan.fit);
///
/// Data parallel: RunPlan::from(config, launch) (launch.hpp) plans for the launch's world size with
/// one seed on every rank.
///
/// RNG_SEED -1 draws a seed here (FitOptions::seed_drawn); the fit loop says which at start,
/// so that the run can be repeated. `seed`, when given, is used instead of that draw.
#include <trainkit/detail/inline.hpp>
#include <trainkit/config/config.hpp>
#include <trainkit/step/optimizer_settings.hpp>
#include <trainkit/detail/module_of.hpp>
#include <trainkit/run/registry.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/fit/fit_options.hpp>
#include <trainkit/step/schedule.hpp>
#include <trainkit/trainer/trainer_key.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

/// The world size of this launch: the WORLD_SIZE environment variable (set by torchrun), or 1.
std::int64_t world_size_from_environment();


namespace detail {

// --- one function per concern; each key of TRAIN and the top level is read in one of them ---

/// The precision: the key's precision and master weights, and the loss scale's settings
/// (BF16, FP16, FP16_LOSS_SCALE, MASTER_WEIGHTS, FP16_INIT_SCALE and GradScaler's knobs).
void plan_precision(const nlohmann::json& t, TrainerKey& key, LossScaleOptions& scale);

/// Clipping: the key's clip policy and its threshold (CLIP_GRAD_NORM, CLIP_GRAD_VALUE). Off
/// (<= 0) leaves the option at its default: the policy type says whether it is used.
void plan_clip(const nlohmann::json& t, TrainerKey& key, TrainerOptions& o);

/// The window: micro-batches per optimizer step and the partial-window rule
/// (GRAD_ACCUMULATE_STEPS, PARTIAL_WINDOW).
void plan_window(const nlohmann::json& t, TrainerKey& key, TrainerOptions& o);

/// The rest of the trainer's options: the non-finite rule, the parameter groups and the
/// data-parallel reduction (NONFINITE, LR_MULT, NO_DECAY, ZERO_STAGE, UNITS, UNIT_PREFETCH,
/// RESHARD_AFTER_FORWARD, OVERLAP_REDUCTION). keep_norm_fp32 keeps its default (on,
/// as Apex O2's).
void plan_parameters(const nlohmann::json& t, TrainerOptions& o);

/// The per-device micro-batch and the total batch (BATCH_IMAGES, TARGET_BATCH), with checked
/// arithmetic: a list of huge entries, or a huge world size, is an error, never a wrapped
/// (negative) total.
void plan_batch(const nlohmann::json& t, std::int64_t world_size, std::int64_t accumulation,
                std::int64_t& batch_images, std::int64_t& total_batch);

/// The optimizer and its base LR (OPTIMIZER, LR, LR_SCALING, WD, MOMENTUM): per_sample scales
/// LR by the total batch (VL-BERT's rule).
OptimizerSettings plan_optimizer(const nlohmann::json& t, std::int64_t total_batch, std::string& lr_scaling);

/// The LR schedule in epochs (LR_SCHEDULE, WARMUP, WARMUP_METHOD, WARMUP_FACTOR, WARMUP_STEPS,
/// LR_FACTOR, LR_STEP); it ends at the loop's END_EPOCH.
ScheduleOptions plan_schedule(const nlohmann::json& t, std::int64_t end_epoch);

/// The fit loop's options (OUTPUT_PATH, MODEL_PREFIX, LOG_FREQUENT, VAL_FREQUENT,
/// CHECKPOINT_FREQUENT, NUM_WORKERS_PER_GPU, RNG_SEED; TRAIN's BEGIN_EPOCH, END_EPOCH,
/// CHECKPOINT_KEEP, CHECKPOINT_BACKGROUND, CHECKPOINT_FORMAT, NONFINITE_PATIENCE, FORWARD_PEAKS, RESUME_CHANGES, RESUME, AUTO_RESUME, MEMORY_BUDGET).
FitOptions plan_fit(const nlohmann::json& top, std::optional<std::int64_t> seed);

}  // namespace detail

class Launch;  // (launch.hpp)

/// See the file comment.
struct RunPlan {
  std::int64_t world_size = 1;
  std::int64_t batch_images = 1;        ///< per-device micro-batch: sum(TRAIN.BATCH_IMAGES), or from TARGET_BATCH
  std::int64_t accumulation_steps = 1;  ///< TRAIN.GRAD_ACCUMULATE_STEPS
  std::int64_t total_batch = 1;         ///< world_size x batch_images x accumulation_steps
  double base_lr = 0.1;                 ///< LR x total_batch (per_sample) or LR (none)
  std::string lr_scaling = "per_sample";  ///< TRAIN.LR_SCALING
  TrainerKey trainer;                   ///< as asked for; trainer.dispatched() is what runs
  OptimizerSettings optimizer;          ///< its lr is base_lr
  TrainerOptions trainer_options;       ///< with the resolved configuration as config_json
  FitOptions fit;
  ScheduleOptions schedule;             ///< positions in epochs; make_schedule() converts them

  /// The plan of a validated configuration for `world_size` processes (default: the
  /// WORLD_SIZE environment variable, or 1) and, with RNG_SEED -1, `seed` (default: drawn).
  static RunPlan from(const Config& config, std::optional<std::int64_t> world_size = std::nullopt,
                      std::optional<std::int64_t> seed = std::nullopt);
  /// The plan of `config` for a launch (defined in launch.hpp): its world size, and with
  /// RNG_SEED -1 one seed for every rank, drawn by rank 0 (the ranks' shards come from one
  /// permutation).
  static RunPlan from(const Config& config, const Launch& launch);

  /// TRAIN.END_EPOCH > TRAIN.BEGIN_EPOCH, or a ConfigError naming END_EPOCH: call before
  /// training (a file that only evaluates may leave END_EPOCH at 0).
  void require_training() const;

  /// How epochs map to applied optimizer steps with `micro_batches_per_epoch` micro-batches
  /// per epoch on each rank (the loader's length), by the window and the partial-window rule.
  EpochClock epoch_clock(std::int64_t micro_batches_per_epoch) const;
  /// The LR schedule with its epoch milestones converted by epoch_clock().
  std::shared_ptr<Schedule> make_schedule(std::int64_t micro_batches_per_epoch) const;
};

/// The trainer a plan asks for (its key, optimizer and trainer options; the LR already scaled
/// by the plan's world size), over `model`. Set its LR schedule with
/// trainer->set_schedule(plan.make_schedule(batches_per_epoch)).
template <class Model>
std::unique_ptr<AnyTrainer> make_trainer(const RunPlan& plan, Model& model) {
  auto module = detail::module_of(model);
  // A NO_DECAY entry that names no parameter is a configuration error (the Trainer would
  // throw too, without the key).
  for (const auto& entry : plan.trainer_options.no_decay()) {
    bool used = false;
    std::string example;
    for (const auto& p : module->named_parameters(true))
      if (p.value().requires_grad()) {
        if (example.empty()) example = p.key();
        used = used || p.key().find(entry) != std::string::npos;
      }
    if (!used)
      throw ConfigError("TRAIN.NO_DECAY", "'" + entry + "' is in no trainable parameter's name (they look like '" +
                                              example + "')");
  }
  return make_trainer(plan.trainer, std::move(module), plan.optimizer, plan.trainer_options);
}

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/run/plan-inl.hpp>
#endif
