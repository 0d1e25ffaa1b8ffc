#pragma once
/// Learning-rate schedules.
///
/// Contract: a schedule is a pure function of the number of *applied* optimizer steps
/// (skipped steps do not count) returning a multiplier of the base learning rate. The trainer
/// evaluates it on the host into a lookup table that lives on the training device, and indexes
/// that table with its device-resident applied-step counter, so advancing the schedule only on
/// applied steps needs no host sync. A schedule whose values depend on run-time observations
/// (`plateau`) calls `changed()` when they do; the trainer then rebuilds its table.
#include <cstdint>
#include <memory>
#include <string>

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

}  // namespace trainkit
