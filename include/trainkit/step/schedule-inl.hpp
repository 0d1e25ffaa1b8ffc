#pragma once
/// The definitions of trainkit/step/schedule.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/step/schedule.hpp>

namespace trainkit {

TRAINKIT_INLINE double Warmup::at(std::int64_t p) const {
  if (p >= steps) return 1.0;
  if (method == WarmupMethod::constant) return factor;
  const double alpha = static_cast<double>(p) / static_cast<double>(steps);
  return factor * (1 - alpha) + alpha;
}

TRAINKIT_INLINE std::string Warmup::describe() const {
  if (steps <= 0) return "";
  std::ostringstream s;
  s << "warmup " << (method == WarmupMethod::linear ? "linear" : "constant") << " " << steps
    << " steps from " << factor << "; ";
  return s.str();
}

TRAINKIT_INLINE EpochClock EpochClock::flush(std::int64_t micro_batches, std::int64_t accumulation) {
  check(micro_batches, accumulation);
  return EpochClock(static_cast<double>((micro_batches + accumulation - 1) / accumulation), 1);
}

TRAINKIT_INLINE EpochClock EpochClock::drop(std::int64_t micro_batches, std::int64_t accumulation) {
  check(micro_batches, accumulation);
  return EpochClock(static_cast<double>(micro_batches / accumulation), 1);
}

TRAINKIT_INLINE EpochClock EpochClock::span(std::int64_t micro_batches, std::int64_t accumulation) {
  check(micro_batches, accumulation);
  return EpochClock(static_cast<double>(micro_batches), static_cast<double>(accumulation));
}

TRAINKIT_INLINE std::int64_t EpochClock::step_at(double epoch) const {
  // Same operation order as VL-BERT's Python (epoch * len / N), so the rounding agrees.
  const double step = std::floor(epoch * numerator_ / denominator_);
  constexpr double beyond = 9223372036854775808.0;  // 2^63: the first double past int64
  if (!(step < beyond)) return std::numeric_limits<std::int64_t>::max();  // (NaN included)
  if (step < -beyond) return std::numeric_limits<std::int64_t>::min();
  return static_cast<std::int64_t>(step);
}

TRAINKIT_INLINE void EpochClock::check(std::int64_t micro_batches, std::int64_t accumulation) {
  if (micro_batches < 1 || accumulation < 1)
    throw std::invalid_argument("EpochClock: micro-batches per epoch and accumulation steps must be >= 1, got " +
                                std::to_string(micro_batches) + " and " + std::to_string(accumulation));
}

TRAINKIT_INLINE WarmupMultiStepSchedule::WarmupMultiStepSchedule(Warmup warmup, std::vector<std::int64_t> milestones,
                                                                 double gamma)
    : warmup_(warmup), milestones_(std::move(milestones)), gamma_(gamma) {
  if (!std::is_sorted(milestones_.begin(), milestones_.end()))
    throw std::invalid_argument("step schedule: milestones must be in increasing order");
}

TRAINKIT_INLINE double WarmupMultiStepSchedule::at(std::int64_t p) const {
  // bisect_right: the milestones at or before p have taken effect.
  const auto passed = std::upper_bound(milestones_.begin(), milestones_.end(), p) - milestones_.begin();
  return warmup_.at(p) * std::pow(gamma_, static_cast<double>(passed));
}

TRAINKIT_INLINE std::string WarmupMultiStepSchedule::describe() const {
  std::ostringstream s;
  s << "step(" << warmup_.describe() << "x" << gamma_ << " at steps [";
  for (std::size_t i = 0; i < milestones_.size(); ++i) s << (i ? ", " : "") << milestones_[i];
  s << "])";
  return s.str();
}

TRAINKIT_INLINE double WarmupLinearSchedule::at(std::int64_t p) const {
  if (p < warmup_.steps) return warmup_.at(p);
  const double span = static_cast<double>(std::max<std::int64_t>(1, total_ - warmup_.steps));
  return std::max(0.0, static_cast<double>(total_ - p) / span);
}

TRAINKIT_INLINE std::string WarmupLinearSchedule::describe() const {
  return "triangle(" + warmup_.describe() + "linear to 0 at step " + std::to_string(total_) + ")";
}

TRAINKIT_INLINE double WarmupCosineSchedule::at(std::int64_t p) const {
  if (p < warmup_.steps) return warmup_.at(p);
  const double span = static_cast<double>(std::max<std::int64_t>(1, total_ - warmup_.steps));
  const double progress = std::min(1.0, static_cast<double>(p - warmup_.steps) / span);
  return std::max(0.0, 0.5 * (1.0 + std::cos(3.14159265358979323846 * progress)));
}

TRAINKIT_INLINE std::string WarmupCosineSchedule::describe() const {
  return "cosine(" + warmup_.describe() + "to 0 at step " + std::to_string(total_) + ")";
}

TRAINKIT_INLINE std::string WarmupConstantSchedule::describe() const {
  const std::string w = warmup_.describe();
  return w.empty() ? "constant" : "constant(" + w.substr(0, w.size() - 2) + ")";
}

TRAINKIT_INLINE PlateauSchedule::PlateauSchedule(Warmup warmup, double gamma, PlateauOptions options)
    : warmup_(warmup), gamma_(gamma), options_(options) {
  if (!(gamma > 0 && gamma < 1)) throw std::invalid_argument("plateau schedule: LR_FACTOR must be in (0, 1)");
}

TRAINKIT_INLINE bool PlateauSchedule::on_epoch_end(std::int64_t /*epoch*/, double metric) {
  // ReduceLROnPlateau's is_better in 'rel' mode (a NaN metric is never better).
  const bool better = options_.maximize ? metric > best_ * (1 + options_.threshold)
                                        : metric < best_ * (1 - options_.threshold);
  if (better) {
    best_ = metric;
    bad_epochs_ = 0;
  } else {
    ++bad_epochs_;
  }
  if (cooldown_left_ > 0) {
    --cooldown_left_;
    bad_epochs_ = 0;
  }
  if (bad_epochs_ > options_.patience) {
    const double cut = std::max(multiplier_ * gamma_, options_.min_factor);
    bad_epochs_ = 0;
    cooldown_left_ = options_.cooldown;
    if (multiplier_ - cut > options_.eps) {
      multiplier_ = cut;
      return true;
    }
  }
  return false;
}

TRAINKIT_INLINE std::string PlateauSchedule::describe() const {
  std::ostringstream s;
  s << "plateau(" << warmup_.describe() << "x" << gamma_ << " after " << options_.patience
    << " epochs without " << (options_.maximize ? "increase" : "decrease") << ", cooldown "
    << options_.cooldown << "; now x" << multiplier_ << ")";
  return s.str();
}

TRAINKIT_INLINE std::string PlateauSchedule::state() const {
  return "plateau best=" + hex(best_) + " bad=" + std::to_string(bad_epochs_) +
         " cooldown=" + std::to_string(cooldown_left_) + " multiplier=" + hex(multiplier_);
}

TRAINKIT_INLINE void PlateauSchedule::load_state(const std::string& state) {
  if (state.empty()) return;  // a checkpoint written before any epoch ended
  std::istringstream in(state);
  std::string tag, best, bad, cooldown, mult;
  in >> tag >> best >> bad >> cooldown >> mult;
  auto value = [&](const std::string& field, const char* name) {
    const std::string prefix = std::string(name) + "=";
    if (field.rfind(prefix, 0) != 0)
      throw std::invalid_argument("PlateauSchedule::load_state: not a plateau state: \"" + state + "\"");
    return field.substr(prefix.size());
  };
  if (tag != "plateau") throw std::invalid_argument("PlateauSchedule::load_state: not a plateau state: \"" + state + "\"");
  best_ = std::strtod(value(best, "best").c_str(), nullptr);
  bad_epochs_ = std::stoll(value(bad, "bad"));
  cooldown_left_ = std::stoll(value(cooldown, "cooldown"));
  multiplier_ = std::strtod(value(mult, "multiplier").c_str(), nullptr);
}

TRAINKIT_INLINE std::string describe(const ScheduleOptions& o) {
  std::ostringstream s;
  const std::string w = o.warmup.describe();
  if (o.name == "step") {
    s << "step(" << w << "x" << o.factor << " at epochs [";
    for (std::size_t i = 0; i < o.milestones.size(); ++i) s << (i ? ", " : "") << o.milestones[i];
    s << "])";
  } else if (o.name == "triangle") {
    s << "triangle(" << w << "linear to 0 at epoch " << o.end_epoch << ")";
  } else if (o.name == "cosine") {
    s << "cosine(" << w << "to 0 at epoch " << o.end_epoch << ")";
  } else if (o.name == "plateau") {
    s << "plateau(" << w << "x" << o.factor << " after " << o.plateau.patience << " epochs without "
      << (o.plateau.maximize ? "increase" : "decrease") << ", cooldown " << o.plateau.cooldown << ")";
  } else {
    s << (w.empty() ? "constant" : "constant(" + w.substr(0, w.size() - 2) + ")");
  }
  return s.str();
}

TRAINKIT_INLINE std::shared_ptr<Schedule> make_schedule(const ScheduleOptions& options, const EpochClock& clock) {
  const auto& n = options.name;
  if (n == "step") {
    std::vector<std::int64_t> steps;
    for (double e : options.milestones) steps.push_back(clock.step_at(e));
    return std::make_shared<WarmupMultiStepSchedule>(options.warmup, std::move(steps), options.factor);
  }
  if (n == "triangle" || n == "cosine") {
    const std::int64_t total = clock.step_at(options.end_epoch);
    if (total < 1)
      throw std::invalid_argument(n + " decays to 0 at END_EPOCH, which is at optimizer step " +
                                  std::to_string(total) + "; set TRAIN.END_EPOCH > 0");
    if (n == "triangle") return std::make_shared<WarmupLinearSchedule>(options.warmup, total);
    return std::make_shared<WarmupCosineSchedule>(options.warmup, total);
  }
  if (n == "constant") return std::make_shared<WarmupConstantSchedule>(options.warmup);
  if (n == "plateau") return std::make_shared<PlateauSchedule>(options.warmup, options.factor, options.plateau);
  throw std::invalid_argument("unknown LR schedule \"" + n + "\"; use step, triangle, cosine, constant or plateau");
}

}  // namespace trainkit
