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
/// Data parallel: tk::plan(config, launch) (launch.hpp) plans for the launch's world size with
/// one seed on every rank.
///
/// RNG_SEED -1 draws a seed here (FitOptions::seed_drawn); the fit loop says which at start,
/// so that the run can be repeated. `seed`, when given, is used instead of that draw.
#include <trainkit/config.hpp>
#include <trainkit/config/optimizer_settings.hpp>
#include <trainkit/detail/module_of.hpp>
#include <trainkit/registry.hpp>
#include <trainkit/options.hpp>
#include <trainkit/fit_options.hpp>
#include <trainkit/schedule.hpp>
#include <trainkit/trainer_key.hpp>

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
inline std::int64_t world_size_from_environment() {
  const char* env = std::getenv("WORLD_SIZE");
  if (!env || !*env) return 1;
  const nlohmann::json v = detail::resolve_plain_scalar(env);
  if (!v.is_number_integer() || v.get<std::int64_t>() < 1)
    throw ConfigError("WORLD_SIZE", std::string("the environment variable WORLD_SIZE=\"") + env +
                                        "\" is not an integer >= 1 (torchrun sets it to the number of processes)");
  return v.get<std::int64_t>();
}


namespace detail {

// --- one function per concern; each key of TRAIN and the top level is read in one of them ---

/// The precision: the key's precision and master weights, and the loss scale's settings
/// (BF16, FP16, FP16_LOSS_SCALE, MASTER_WEIGHTS, FP16_INIT_SCALE and GradScaler's knobs).
inline void plan_precision(const nlohmann::json& t, TrainerKey& key, LossScaleOptions& scale) {
  const nlohmann::json& loss_scale = t["FP16_LOSS_SCALE"];
  if (t["BF16"].get<bool>()) key.precision = PrecisionKind::BF16;
  else if (t["FP16"].get<bool>())
    key.precision = loss_scale.is_string() ? PrecisionKind::FP16Dynamic : PrecisionKind::FP16Static;
  key.master_weights = t["MASTER_WEIGHTS"].get<bool>();
  scale.init_scale(t["FP16_INIT_SCALE"].get<double>())
      .growth_factor(t["FP16_GROWTH_FACTOR"].get<double>())
      .backoff_factor(t["FP16_BACKOFF_FACTOR"].get<double>())
      .growth_interval(t["FP16_GROWTH_INTERVAL"].get<std::int64_t>())
      .hysteresis(t["FP16_HYSTERESIS"].get<std::int64_t>())
      .min_scale(t["FP16_MIN_LOSS_SCALE"].get<double>())
      .max_scale(t["FP16_MAX_LOSS_SCALE"].get<double>());
  if (loss_scale.is_number()) scale.static_scale(loss_scale.get<double>());
}

/// Clipping: the key's clip policy and its threshold (CLIP_GRAD_NORM, CLIP_GRAD_VALUE). Off
/// (<= 0) leaves the option at its default: the policy type says whether it is used.
inline void plan_clip(const nlohmann::json& t, TrainerKey& key, TrainerOptions& o) {
  const double norm = t["CLIP_GRAD_NORM"].get<double>(), value = t["CLIP_GRAD_VALUE"].get<double>();
  if (norm > 0) {
    key.clip = ClipKind::ClipNorm;
    o.max_grad_norm(norm);
  } else if (value > 0) {
    key.clip = ClipKind::ClipValue;
    o.clip_value(value);
  }
}

/// The window: micro-batches per optimizer step and the partial-window rule
/// (GRAD_ACCUMULATE_STEPS, PARTIAL_WINDOW).
inline void plan_window(const nlohmann::json& t, TrainerKey& key, TrainerOptions& o) {
  const auto n = t["GRAD_ACCUMULATE_STEPS"].get<std::int64_t>();
  key.accumulation = static_cast<int>(n);
  o.accumulation_steps(n);
  const std::string partial = t["PARTIAL_WINDOW"].get<std::string>();
  o.partial_window(partial == "span" ? PartialWindow::span : partial == "drop" ? PartialWindow::drop : PartialWindow::flush);
}

/// The rest of the trainer's options: the non-finite rule, the parameter groups and the
/// data-parallel reduction (NONFINITE, LR_MULT, NO_DECAY, ZERO_STAGE, OVERLAP_REDUCTION). keep_norm_fp32 keeps its default (on,
/// as Apex O2's).
inline void plan_parameters(const nlohmann::json& t, TrainerOptions& o) {
  o.nonfinite(t["NONFINITE"].get<std::string>() == "abort" ? NonFinite::abort : NonFinite::skip);
  const auto stage = t["ZERO_STAGE"].get<std::int64_t>();
  o.sharding(stage == 2 ? Sharding::gradients : stage == 1 ? Sharding::optimizer : Sharding::none);
  o.overlap_reduction(t["OVERLAP_REDUCTION"].get<bool>());
  std::vector<std::pair<std::string, double>> groups;
  for (const auto& pair : t["LR_MULT"]) groups.emplace_back(pair[0].get<std::string>(), pair[1].get<double>());
  o.lr_mult(std::move(groups));
  o.no_decay(t["NO_DECAY"].get<std::vector<std::string>>());
}

/// The per-device micro-batch and the total batch (BATCH_IMAGES, TARGET_BATCH), with checked
/// arithmetic: a list of huge entries, or a huge world size, is an error, never a wrapped
/// (negative) total.
inline void plan_batch(const nlohmann::json& t, std::int64_t world_size, std::int64_t accumulation,
                       std::int64_t& batch_images, std::int64_t& total_batch) {
  const auto overflow = [&](const std::string& what) {
    return ConfigError("TRAIN.BATCH_IMAGES", what + " does not fit in 64 bits; BATCH_IMAGES is the per-device micro-batch");
  };
  const nlohmann::json& b = t["BATCH_IMAGES"];
  batch_images = 0;
  if (b.is_array()) {
    for (const auto& x : b)
      if (__builtin_add_overflow(batch_images, x.get<std::int64_t>(), &batch_images)) throw overflow("the sum of the list");
  } else {
    batch_images = b.get<std::int64_t>();
  }
  if (const auto target = t["TARGET_BATCH"].get<std::int64_t>(); target > 0) {  // in place of BATCH_IMAGES
    const std::int64_t per_device = target / (world_size * accumulation);
    if (per_device * world_size * accumulation != target)
      throw ConfigError("TRAIN.TARGET_BATCH", "the effective batch " + std::to_string(target) +
                                                  " is not a multiple of world size " + std::to_string(world_size) +
                                                  " x GRAD_ACCUMULATE_STEPS " + std::to_string(accumulation) +
                                                  "; choose a multiple, or set GRAD_ACCUMULATE_STEPS: 1 and let "
                                                  "TRAIN.MEMORY_BUDGET split the batch");
    batch_images = per_device;
  }
  if (__builtin_mul_overflow(world_size, batch_images, &total_batch) ||
      __builtin_mul_overflow(total_batch, accumulation, &total_batch))
    throw overflow("the total batch (world size " + std::to_string(world_size) + " x BATCH_IMAGES " +
                   std::to_string(batch_images) + " x GRAD_ACCUMULATE_STEPS " + std::to_string(accumulation) + ")");
}

/// The optimizer and its base LR (OPTIMIZER, LR, LR_SCALING, WD, MOMENTUM): per_sample scales
/// LR by the total batch (VL-BERT's rule).
inline OptimizerSettings plan_optimizer(const nlohmann::json& t, std::int64_t total_batch, std::string& lr_scaling) {
  OptimizerSettings o;
  const double lr = t["LR"].get<double>();
  lr_scaling = t["LR_SCALING"].get<std::string>();
  o.lr = lr_scaling == "per_sample" ? lr * static_cast<double>(total_batch) : lr;
  o.name = t["OPTIMIZER"].get<std::string>();
  o.weight_decay = t["WD"].get<double>();
  o.momentum = t["MOMENTUM"].get<double>();
  o.eps = o.name == "AdamW" ? 1e-6 : 1e-8;  // VL-BERT's AdamW; torch.optim.Adam's default
  return o;
}

/// The LR schedule in epochs (LR_SCHEDULE, WARMUP, WARMUP_METHOD, WARMUP_FACTOR, WARMUP_STEPS,
/// LR_FACTOR, LR_STEP); it ends at the loop's END_EPOCH.
inline ScheduleOptions plan_schedule(const nlohmann::json& t, std::int64_t end_epoch) {
  ScheduleOptions o;
  o.name = t["LR_SCHEDULE"].get<std::string>();
  o.warmup.method = t["WARMUP_METHOD"].get<std::string>() == "constant" ? WarmupMethod::constant : WarmupMethod::linear;
  o.warmup.factor = t["WARMUP_FACTOR"].get<double>();
  o.warmup.steps = t["WARMUP"].get<bool>() ? t["WARMUP_STEPS"].get<std::int64_t>() : 0;  // VL-BERT: 0 when off
  o.factor = t["LR_FACTOR"].get<double>();
  o.milestones = t["LR_STEP"].get<std::vector<double>>();
  o.end_epoch = static_cast<double>(end_epoch);
  return o;
}

/// The fit loop's options (OUTPUT_PATH, MODEL_PREFIX, LOG_FREQUENT, VAL_FREQUENT,
/// CHECKPOINT_FREQUENT, NUM_WORKERS_PER_GPU, RNG_SEED; TRAIN's BEGIN_EPOCH, END_EPOCH,
/// CHECKPOINT_KEEP, NONFINITE_PATIENCE, RESUME_CHANGES, RESUME, AUTO_RESUME, MEMORY_BUDGET).
inline FitOptions plan_fit(const nlohmann::json& top, std::optional<std::int64_t> seed) {
  const nlohmann::json& train = top["TRAIN"];
  FitOptions o;
  o.output_path(top["OUTPUT_PATH"].get<std::string>())
      .prefix(top["MODEL_PREFIX"].get<std::string>())
      .begin_epoch(train["BEGIN_EPOCH"].get<std::int64_t>())
      .end_epoch(train["END_EPOCH"].get<std::int64_t>())
      .log_frequent(top["LOG_FREQUENT"].get<std::int64_t>())
      .val_frequent(top["VAL_FREQUENT"].get<std::int64_t>())
      .checkpoint_frequent(top["CHECKPOINT_FREQUENT"].get<std::int64_t>())
      .checkpoint_keep(train["CHECKPOINT_KEEP"].get<std::int64_t>())
      .nonfinite_patience(train["NONFINITE_PATIENCE"].get<std::int64_t>())
      .allow_resume_changes(train["RESUME_CHANGES"].get<std::string>() == "allow")
      .resume(train["RESUME"].get<bool>())
      .auto_resume(train["AUTO_RESUME"].get<bool>())
      .workers(top["NUM_WORKERS_PER_GPU"].get<std::int64_t>())
      .memory_budget(train["MEMORY_BUDGET"].get<double>());
  const auto configured = top["RNG_SEED"].get<std::int64_t>();
  if (configured >= 0) {
    o.seed(configured);
  } else {
    o.seed(seed ? *seed : static_cast<std::int64_t>(std::random_device{}() & 0x7fffffff));
    o.seed_drawn(true);
  }
  return o;
}

}  // namespace detail

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
                      std::optional<std::int64_t> seed = std::nullopt) {
    const nlohmann::json& t = config.tree()["TRAIN"];
    RunPlan p;
    p.world_size = world_size ? *world_size : world_size_from_environment();
    if (p.world_size < 1) throw ConfigError("WORLD_SIZE", "must be >= 1, got " + std::to_string(p.world_size));
    LossScaleOptions scale;
    detail::plan_precision(t, p.trainer, scale);
    p.trainer_options.loss_scale(scale);
    detail::plan_clip(t, p.trainer, p.trainer_options);
    detail::plan_window(t, p.trainer, p.trainer_options);
    detail::plan_parameters(t, p.trainer_options);
    p.trainer_options.config_json(config.dump(-1));
    p.accumulation_steps = p.trainer_options.accumulation_steps();
    detail::plan_batch(t, p.world_size, p.accumulation_steps, p.batch_images, p.total_batch);
    p.optimizer = detail::plan_optimizer(t, p.total_batch, p.lr_scaling);
    p.base_lr = p.optimizer.lr;
    p.fit = detail::plan_fit(config.tree(), seed);
    p.fit.config_json(p.trainer_options.config_json()).total_batch(p.total_batch);
    p.schedule = detail::plan_schedule(t, p.fit.end_epoch());
    return p;
  }

  /// TRAIN.END_EPOCH > TRAIN.BEGIN_EPOCH, or a ConfigError naming END_EPOCH: call before
  /// training (a file that only evaluates may leave END_EPOCH at 0).
  void require_training() const {
    if (fit.end_epoch() <= fit.begin_epoch())
      throw ConfigError("TRAIN.END_EPOCH", "must be > TRAIN.BEGIN_EPOCH (" + std::to_string(fit.begin_epoch()) +
                                               ") to train, got " + std::to_string(fit.end_epoch()));
  }

  /// How epochs map to applied optimizer steps with `micro_batches_per_epoch` micro-batches
  /// per epoch on each rank (the loader's length), by the window and the partial-window rule.
  EpochClock epoch_clock(std::int64_t micro_batches_per_epoch) const {
    if (micro_batches_per_epoch < 1)
      throw ConfigError("TRAIN", "an epoch needs at least one micro-batch, got " + std::to_string(micro_batches_per_epoch));
    switch (trainer_options.partial_window()) {
      case PartialWindow::span: return EpochClock::span(micro_batches_per_epoch, accumulation_steps);
      case PartialWindow::drop: return EpochClock::drop(micro_batches_per_epoch, accumulation_steps);
      case PartialWindow::flush: break;
    }
    return EpochClock::flush(micro_batches_per_epoch, accumulation_steps);
  }
  /// The LR schedule with its epoch milestones converted by epoch_clock().
  std::shared_ptr<Schedule> make_schedule(std::int64_t micro_batches_per_epoch) const {
    const EpochClock clock = epoch_clock(micro_batches_per_epoch);
    if ((schedule.name == "triangle" || schedule.name == "cosine") && clock.step_at(schedule.end_epoch) < 1)
      throw ConfigError("TRAIN.END_EPOCH", schedule.name + " decays to 0 at END_EPOCH, so END_EPOCH must be > 0 "
                                           "(and at least one optimizer step), got " + std::to_string(fit.end_epoch()));
    try {
      return trainkit::make_schedule(schedule, clock);
    } catch (const std::invalid_argument& e) {
      throw ConfigError("TRAIN.LR_SCHEDULE", e.what());
    }
  }
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
