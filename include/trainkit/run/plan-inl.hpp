#pragma once
/// The definitions of trainkit/run/plan.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/run/plan.hpp>

namespace trainkit {

TRAINKIT_INLINE std::int64_t world_size_from_environment() {
  const char* env = std::getenv("WORLD_SIZE");
  if (!env || !*env) return 1;
  const nlohmann::json v = detail::resolve_plain_scalar(env);
  if (!v.is_number_integer() || v.get<std::int64_t>() < 1)
    throw ConfigError("WORLD_SIZE", std::string("the environment variable WORLD_SIZE=\"") + env +
                                        "\" is not an integer >= 1 (torchrun sets it to the number of processes)");
  return v.get<std::int64_t>();
}

}  // namespace trainkit
namespace trainkit {
namespace detail {

TRAINKIT_INLINE void plan_precision(const nlohmann::json& t, TrainerKey& key, LossScaleOptions& scale) {
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

TRAINKIT_INLINE void plan_clip(const nlohmann::json& t, TrainerKey& key, TrainerOptions& o) {
  const double norm = t["CLIP_GRAD_NORM"].get<double>(), value = t["CLIP_GRAD_VALUE"].get<double>();
  if (norm > 0) {
    key.clip = ClipKind::ClipNorm;
    o.max_grad_norm(norm);
  } else if (value > 0) {
    key.clip = ClipKind::ClipValue;
    o.clip_value(value);
  }
}

TRAINKIT_INLINE void plan_window(const nlohmann::json& t, TrainerKey& key, TrainerOptions& o) {
  const auto n = t["GRAD_ACCUMULATE_STEPS"].get<std::int64_t>();
  key.accumulation = static_cast<int>(n);
  o.accumulation_steps(n);
  const std::string partial = t["PARTIAL_WINDOW"].get<std::string>();
  o.partial_window(partial == "span" ? PartialWindow::span : partial == "drop" ? PartialWindow::drop : PartialWindow::flush);
}

TRAINKIT_INLINE void plan_parameters(const nlohmann::json& t, TrainerOptions& o) {
  o.nonfinite(t["NONFINITE"].get<std::string>() == "abort" ? NonFinite::abort : NonFinite::skip);
  const auto stage = t["ZERO_STAGE"].get<std::int64_t>();
  o.sharding(stage == 3   ? Sharding::parameters
             : stage == 2 ? Sharding::gradients
             : stage == 1 ? Sharding::optimizer
                          : Sharding::none);
  o.units(t["UNITS"].get<std::vector<std::string>>());
  o.unit_prefetch(t["UNIT_PREFETCH"].get<std::int64_t>());
  o.reshard_after_forward(t["RESHARD_AFTER_FORWARD"].get<bool>());
  o.overlap_reduction(t["OVERLAP_REDUCTION"].get<bool>());
  std::vector<std::pair<std::string, double>> groups;
  for (const auto& pair : t["LR_MULT"]) groups.emplace_back(pair[0].get<std::string>(), pair[1].get<double>());
  o.lr_mult(std::move(groups));
  o.no_decay(t["NO_DECAY"].get<std::vector<std::string>>());
}

TRAINKIT_INLINE void plan_batch(const nlohmann::json& t, std::int64_t world_size, std::int64_t accumulation,
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

TRAINKIT_INLINE OptimizerSettings plan_optimizer(const nlohmann::json& t, std::int64_t total_batch,
                                                 std::string& lr_scaling) {
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

TRAINKIT_INLINE ScheduleOptions plan_schedule(const nlohmann::json& t, std::int64_t end_epoch) {
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

TRAINKIT_INLINE FitOptions plan_fit(const nlohmann::json& top, std::optional<std::int64_t> seed) {
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
      .background_checkpoints(train["CHECKPOINT_BACKGROUND"].get<bool>())
      .checkpoint_format(checkpoint_format_of(train["CHECKPOINT_FORMAT"].get<std::string>()))
      .nonfinite_patience(train["NONFINITE_PATIENCE"].get<std::int64_t>())
      .forward_peaks(train["FORWARD_PEAKS"].get<bool>())
      .allow_resume_changes(train["RESUME_CHANGES"].get<std::string>() == "allow")
      .resume(train["RESUME"].get<bool>())
      .auto_resume(train["AUTO_RESUME"].get<bool>())
      .workers(top["NUM_WORKERS_PER_GPU"].get<std::int64_t>())
      .memory_budget(train["MEMORY_BUDGET"].get<double>())
      .piece_items(train["PIECE_ITEMS"].get<std::int64_t>());
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
}  // namespace trainkit
namespace trainkit {

TRAINKIT_INLINE RunPlan RunPlan::from(const Config& config, std::optional<std::int64_t> world_size,
                                      std::optional<std::int64_t> seed) {
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

TRAINKIT_INLINE void RunPlan::require_training() const {
  if (fit.end_epoch() <= fit.begin_epoch())
    throw ConfigError("TRAIN.END_EPOCH", "must be > TRAIN.BEGIN_EPOCH (" + std::to_string(fit.begin_epoch()) +
                                             ") to train, got " + std::to_string(fit.end_epoch()));
}

TRAINKIT_INLINE EpochClock RunPlan::epoch_clock(std::int64_t micro_batches_per_epoch) const {
  if (micro_batches_per_epoch < 1)
    throw ConfigError("TRAIN", "an epoch needs at least one micro-batch, got " + std::to_string(micro_batches_per_epoch));
  switch (trainer_options.partial_window()) {
    case PartialWindow::span: return EpochClock::span(micro_batches_per_epoch, accumulation_steps);
    case PartialWindow::drop: return EpochClock::drop(micro_batches_per_epoch, accumulation_steps);
    case PartialWindow::flush: break;
  }
  return EpochClock::flush(micro_batches_per_epoch, accumulation_steps);
}

TRAINKIT_INLINE std::shared_ptr<Schedule> RunPlan::make_schedule(std::int64_t micro_batches_per_epoch) const {
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

}  // namespace trainkit
