#pragma once
/// What a micro-step and an optimizer phase report: StepReport (device scalars read lazily, one
/// host sync for all of them at the first value asked for) and MicroStepResult. Shared by the
/// compiled Trainer<P, A, C> and the type-erased AnyTrainer.
#include <torch/types.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

namespace trainkit {

/// Thrown with NonFinite::abort when an FP32/BF16 window has a non-finite gradient.
class NonFiniteGradient : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What one optimizer phase did. Holds device scalars; the first value asked for copies all of
/// them to the host at once (one sync), so a report that is never read costs no sync.
class StepReport {
 public:
  /// One phase's values, device scalars as the trainer makes them (nothing is read here).
  struct Device {
    torch::Tensor loss, grad_norm, loss_scale, lr, found_inf, skipped, applied;
  };

  StepReport() = default;
  /// The report of optimizer phase `window` (applied + skipped so far) over `micro_batches`
  /// micro-batches of `items` items (0 without item counts).
  StepReport(Device device, std::int64_t window, std::int64_t micro_batches, std::int64_t items)
      : values_(std::make_shared<Values>()), window_(window), micro_batches_(micro_batches), items_(items) {
    values_->device = {std::move(device.loss),      std::move(device.grad_norm), std::move(device.loss_scale),
                       std::move(device.lr),        std::move(device.found_inf), std::move(device.skipped),
                       std::move(device.applied)};
  }

  bool applied() const { return value(kFoundInf) == 0.0; }
  bool skipped() const { return !applied(); }
  /// Applied optimizer steps so far, including this one when applied.
  std::int64_t step() const { return static_cast<std::int64_t>(value(kApplied)); }
  /// Optimizer phases run so far (applied + skipped), known on the host without a sync.
  std::int64_t window() const { return window_; }
  /// The loss of the window: the mean over its micro-batches (or items).
  double loss() const { return value(kLoss); }
  /// Global L2 norm of the (unscaled) gradient before clipping.
  double grad_norm() const { return value(kNorm); }
  /// The loss scale used for this window (1 without loss scaling).
  double loss_scale() const { return value(kScale); }
  /// Learning rate of the first parameter group for this window.
  double lr() const { return value(kLr); }
  /// Skipped steps so far, including this one when skipped.
  std::int64_t skipped_steps() const { return static_cast<std::int64_t>(value(kSkipped)); }
  /// Micro-batches in the window (fewer than N for a flushed partial window).
  std::int64_t micro_batches() const { return micro_batches_; }
  /// Items in the window when item counts were given, else 0.
  std::int64_t items() const { return items_; }
  bool empty() const { return values_ == nullptr; }

 private:
  enum Field { kLoss, kNorm, kScale, kLr, kFoundInf, kSkipped, kApplied, kFields };
  struct Values {
    std::array<torch::Tensor, kFields> device;
    std::optional<std::array<double, kFields>> host;
  };

  double value(Field f) const;

  std::shared_ptr<Values> values_;
  std::int64_t window_ = 0, micro_batches_ = 0, items_ = 0;
};

/// The result of one micro_step: whether it closed a window, and if so that window's report.
struct MicroStepResult {
  bool window_closed = false;
  StepReport report;
};

inline double StepReport::value(Field f) const {
  TORCH_CHECK(values_ != nullptr, "StepReport: this report is empty (no window closed)");
  if (!values_->host) {
    std::vector<torch::Tensor> parts;
    for (const auto& t : values_->device) parts.push_back(t.reshape({1}).to(torch::kDouble));
    const auto host = torch::cat(parts).cpu();  // the one copy (a sync on a GPU)
    const double* read = host.data_ptr<double>();
    std::array<double, kFields> v{};
    std::copy(read, read + kFields, v.begin());
    values_->host = v;
  }
  return (*values_->host)[f];
}

}  // namespace trainkit
