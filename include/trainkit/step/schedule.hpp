#pragma once
/// Learning-rate schedules.
///
/// Contract: a schedule is a pure function of the number of *applied* optimizer steps
/// (skipped steps do not count) returning a multiplier of the base learning rate. The trainer
/// evaluates it on the host into a lookup table that lives on the training device, and indexes
/// that table with its device-resident applied-step counter, so advancing the schedule only on
/// applied steps needs no host sync. A schedule whose values depend on run-time observations
/// (`plateau`) calls `changed()` when they do; the trainer then rebuilds its table.
#include <trainkit/detail/inline.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace trainkit {

/// Base class of every schedule: `factor(step)` multiplies the base learning rate at the
/// given applied optimizer step (0 for the first update).
class Schedule {
 public:
  virtual ~Schedule() = default;
  /// LR multiplier at applied step `step` (>= 0).
  virtual double factor(std::int64_t step) const = 0;
  /// Called by the fit loop after each epoch with the validation metric (lower or higher is
  /// better depending on the schedule's options). Returns true when factor() changed.
  virtual bool on_epoch_end(std::int64_t /*epoch*/, double /*metric*/) { return false; }
  /// Human-readable description for logs ("step(warmup linear 1000 from 0.333; x0.1 at 14000)").
  virtual std::string describe() const = 0;
  /// Opaque run-time state beyond the step (plateau's best value and counters), for checkpoints.
  virtual std::string state() const { return {}; }
  virtual void load_state(const std::string& /*state*/) {}
};

/// The schedule used when none is attached: factor 1 at every step.
class ConstantSchedule final : public Schedule {
 public:
  double factor(std::int64_t) const override { return 1.0; }
  std::string describe() const override { return "constant"; }
};

// --- Concrete schedules (TRAIN.LR_SCHEDULE: docs/config-reference.md) -------------------------------------------
//
// Positions. VL-BERT steps its scheduler *before* optimizer.step(), so its k-th update (k from
// 0) runs at scheduler position k + 1, and the LR it logs before training is position 0.
// The schedules below are VL-BERT's closed forms evaluated at position p = step + 1, so that
// factor(k) is exactly the multiplier VL-BERT uses for its k-th update: a linear warmup starts
// from WARMUP_FACTOR at p = 0 and reaches 1 at p = WARMUP_STEPS (update WARMUP_STEPS - 1), a
// `step` milestone m takes effect at update m - 1, and `triangle` reaches 0 at the last update.

/// How warmup ramps: `linear` from `factor` to 1, or `constant` at `factor`, over `steps`.
enum class WarmupMethod { linear, constant };

/// The warmup multiplier (maskrcnn-benchmark's and VL-BERT's WarmupMultiStepLR rule).
struct Warmup {
  WarmupMethod method = WarmupMethod::linear;
  double factor = 1.0 / 3;   ///< WARMUP_FACTOR
  std::int64_t steps = 0;    ///< WARMUP_STEPS, 0 when WARMUP is off

  /// Multiplier at scheduler position p: 1 from p >= steps.
  double at(std::int64_t p) const;
  std::string describe() const;
};

/// Where epoch boundaries fall in applied optimizer steps, with the real number of windows
/// per epoch: `flush` closes a partial window at the end of every epoch (ceil(B/N) windows),
/// `drop` discards it (floor(B/N)), `span` carries it into the next epoch (epoch e starts at
/// floor(e * B / N), VL-BERT's int(epoch * len(train_loader) / GRAD_ACCUMULATE_STEPS)).
/// B: micro-batches per epoch on one rank (the loader's length); N: GRAD_ACCUMULATE_STEPS.
class EpochClock {
 public:
  static EpochClock flush(std::int64_t micro_batches, std::int64_t accumulation);
  static EpochClock drop(std::int64_t micro_batches, std::int64_t accumulation);
  static EpochClock span(std::int64_t micro_batches, std::int64_t accumulation);
  /// Exactly `windows` optimizer steps per epoch.
  static EpochClock windows(std::int64_t windows) { return flush(windows, 1); }

  /// Optimizer windows per epoch (fractional for `span`).
  double windows_per_epoch() const { return numerator_ / denominator_; }
  /// The applied-step position at which (possibly fractional) `epoch` begins; an epoch whose
  /// step is beyond int64 (LR_STEP: [7, 1e100]) is never reached: the largest step.
  std::int64_t step_at(double epoch) const;

 private:
  EpochClock(double numerator, double denominator) : numerator_(numerator), denominator_(denominator) {}
  static void check(std::int64_t micro_batches, std::int64_t accumulation);
  double numerator_, denominator_;
};

/// A schedule given by a closed form of the scheduler position (see "Positions" above).
class PositionSchedule : public Schedule {
 public:
  double factor(std::int64_t step) const final { return at(step + 1); }
  /// The multiplier at scheduler position p (VL-BERT's lr_lambda / get_lr at last_epoch = p).
  virtual double at(std::int64_t p) const = 0;
};

/// `step`: warmup, then x gamma at each milestone (VL-BERT's WarmupMultiStepLR). Milestones
/// are optimizer-step positions (EpochClock::step_at of LR_STEP's epochs), non-decreasing.
class WarmupMultiStepSchedule final : public PositionSchedule {
 public:
  WarmupMultiStepSchedule(Warmup warmup, std::vector<std::int64_t> milestones, double gamma);
  TRAINKIT_INLINE double at(std::int64_t p) const override;
  TRAINKIT_INLINE std::string describe() const override;

 private:
  Warmup warmup_;
  std::vector<std::int64_t> milestones_;
  double gamma_;
};

/// `triangle`: warmup, then linear decay to 0 at position `total` (the last update), VL-BERT's
/// WarmupLinearSchedule: max(0, (total - p) / max(1, total - warmup steps)).
class WarmupLinearSchedule final : public PositionSchedule {
 public:
  WarmupLinearSchedule(Warmup warmup, std::int64_t total) : warmup_(warmup), total_(total) {}
  TRAINKIT_INLINE double at(std::int64_t p) const override;
  TRAINKIT_INLINE std::string describe() const override;

 private:
  Warmup warmup_;
  std::int64_t total_;
};

/// `cosine`: warmup, then half a cosine from 1 to 0 at position `total` (the last update),
/// pytorch_pretrained_bert's WarmupCosineSchedule with its default half cycle.
class WarmupCosineSchedule final : public PositionSchedule {
 public:
  WarmupCosineSchedule(Warmup warmup, std::int64_t total) : warmup_(warmup), total_(total) {}
  TRAINKIT_INLINE double at(std::int64_t p) const override;
  TRAINKIT_INLINE std::string describe() const override;

 private:
  Warmup warmup_;
  std::int64_t total_;
};

/// `constant`: warmup, then 1.
class WarmupConstantSchedule final : public PositionSchedule {
 public:
  explicit WarmupConstantSchedule(Warmup warmup) : warmup_(warmup) {}
  double at(std::int64_t p) const override { return warmup_.at(p); }
  TRAINKIT_INLINE std::string describe() const override;

 private:
  Warmup warmup_;
};

/// Plateau settings; the defaults are VL-BERT's ReduceLROnPlateau (it validates on accuracy).
struct PlateauOptions {
  bool maximize = true;          ///< true: a higher metric is better (mode 'max')
  std::int64_t patience = 1;     ///< epochs without improvement tolerated before a cut
  double threshold = 1e-4;       ///< relative: better means > best * (1 + threshold)
  std::int64_t cooldown = 2;     ///< epochs after a cut during which bad epochs are not counted
  double min_factor = 0.0;       ///< the multiplier never goes below this
  double eps = 1e-8;             ///< a cut smaller than this is ignored
};

/// `plateau`: warmup, times a multiplier cut by `gamma` after `patience` epochs without
/// improvement (torch.optim.lr_scheduler.ReduceLROnPlateau's rule, relative threshold).
/// state() round-trips the best value, the counters and the multiplier exactly.
class PlateauSchedule final : public PositionSchedule {
 public:
  PlateauSchedule(Warmup warmup, double gamma, PlateauOptions options = {});
  double at(std::int64_t p) const override { return warmup_.at(p) * multiplier_; }

  TRAINKIT_INLINE bool on_epoch_end(std::int64_t /*epoch*/, double metric) override;
  /// The current multiplier (1 until the first cut).
  double multiplier() const { return multiplier_; }

  TRAINKIT_INLINE std::string describe() const override;
  TRAINKIT_INLINE std::string state() const override;
  TRAINKIT_INLINE void load_state(const std::string& state) override;

 private:
  static std::string hex(double x) {  // exact round trip through text
    char buf[64];
    std::snprintf(buf, sizeof buf, "%a", x);
    return buf;
  }
  Warmup warmup_;
  double gamma_;
  PlateauOptions options_;
  double best_ = options_.maximize ? -std::numeric_limits<double>::infinity()
                                   : std::numeric_limits<double>::infinity();
  std::int64_t bad_epochs_ = 0;
  std::int64_t cooldown_left_ = 0;
  double multiplier_ = 1.0;
};

/// A schedule as the configuration describes it (TRAIN.LR_SCHEDULE and its keys,
/// docs/config-reference.md); positions in epochs.
struct ScheduleOptions {
  std::string name = "constant";    ///< step, triangle, cosine, constant or plateau
  Warmup warmup;
  double factor = 0.1;              ///< LR_FACTOR (step, plateau)
  std::vector<double> milestones;   ///< LR_STEP epochs (step)
  double end_epoch = 0;             ///< END_EPOCH: triangle and cosine reach 0 here
  PlateauOptions plateau;
};

/// "step(warmup linear 1000 steps from 0.333; x0.1 at epochs [14, 18])": the schedule in epochs,
/// before the number of windows per epoch is known.
std::string describe(const ScheduleOptions& o);

/// The schedule of `options`, with epochs converted to applied optimizer steps by `clock`.
/// Throws std::invalid_argument for an unknown name or a decay that ends at step 0.
std::shared_ptr<Schedule> make_schedule(const ScheduleOptions& options, const EpochClock& clock);

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/step/schedule-inl.hpp>
#endif
