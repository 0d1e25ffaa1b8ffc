#pragma once
/// The definitions of trainkit/step/precision.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/step/precision.hpp>

namespace trainkit {

TRAINKIT_INLINE AutocastRegion::AutocastRegion(c10::DeviceType device_type, at::ScalarType dtype)
    : device_type_(device_type), was_enabled_(at::autocast::is_autocast_enabled(device_type)), previous_dtype_(at::autocast::get_autocast_dtype(device_type)) {
  at::autocast::set_autocast_enabled(device_type_, true);
  at::autocast::set_autocast_dtype(device_type_, dtype);
  at::autocast::increment_nesting();
}

TRAINKIT_INLINE AutocastRegion::~AutocastRegion() {
  // The weight-cast cache lives as long as the outermost region, as in torch.autocast.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, was_enabled_);
  at::autocast::set_autocast_dtype(device_type_, previous_dtype_);
}

TRAINKIT_INLINE void PrecisionPolicy<FP16Static>::save(torch::serialize::OutputArchive& archive) const {
  detail::write_tensor(archive, "scaler.scale", scale_);
}

TRAINKIT_INLINE void PrecisionPolicy<FP16Static>::load(torch::serialize::InputArchive& archive) {
  detail::read_into(archive, "scaler.scale", scale_);
}

TRAINKIT_INLINE PrecisionPolicy<FP16Dynamic>::PrecisionPolicy(const LossScaleOptions& options, torch::Device device)
    : options_(options), device_(device) {
  const auto f32 = torch::dtype(torch::kFloat).device(device);
  const auto i32 = torch::dtype(torch::kInt).device(device);
  // Shapes and dtypes are GradScaler's: scale fp32 [1], growth tracker int32 [1].
  scale_ = torch::full({1}, options.init_scale(), f32);
  growth_tracker_ = torch::zeros({1}, i32);
  overflows_in_a_row_ = torch::zeros({1}, i32);
  collapsed_windows_ = torch::zeros({1}, i32);
  extras_ = options.hysteresis() > 1 || options.collapse_windows() > 0;
  clamps_ = options.min_scale() > 0 || std::isfinite(options.max_scale());
}

TRAINKIT_INLINE void PrecisionPolicy<FP16Dynamic>::update(const torch::Tensor& found_inf) {
  if (!extras_) {
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf, options_.growth_factor(),
                           options_.backoff_factor(), options_.growth_interval());
    if (clamps_) {
      const auto max = std::isfinite(options_.max_scale()) ? std::optional<at::Scalar>(static_cast<float>(options_.max_scale()))
                                                           : std::nullopt;
      scale_.clamp_(std::optional<at::Scalar>(static_cast<float>(options_.min_scale())), max);
    }
    return;
  }
  update_with_extras(found_inf.reshape({1}));
}

TRAINKIT_INLINE void PrecisionPolicy<FP16Dynamic>::check(std::int64_t step) const {
  const auto windows = options_.collapse_windows();
  if (windows <= 0) return;
  if (collapsed_windows_.item<int>() >= windows) {
    std::ostringstream msg;
    msg << "loss scale collapsed at step " << step << ": the scale is at its minimum "
        << options_.min_scale() << " and the gradients still overflowed " << windows
        << " windows in a row. The loss or the gradients are non-finite at any scale: look "
           "for log(0), a division by zero or an exploding activation; lower the learning "
           "rate, clip gradients, or train in BF16 (fp32's range).";
    throw LossScaleCollapsed(msg.str());
  }
}

TRAINKIT_INLINE void PrecisionPolicy<FP16Dynamic>::save(torch::serialize::OutputArchive& archive) const {
  detail::write_tensor(archive, "scaler.scale", scale_);
  detail::write_tensor(archive, "scaler.growth_tracker", growth_tracker_);
  detail::write_tensor(archive, "scaler.overflows_in_a_row", overflows_in_a_row_);
  detail::write_tensor(archive, "scaler.collapsed_windows", collapsed_windows_);
}

TRAINKIT_INLINE void PrecisionPolicy<FP16Dynamic>::load(torch::serialize::InputArchive& archive) {
  detail::read_into(archive, "scaler.scale", scale_);
  detail::read_into(archive, "scaler.growth_tracker", growth_tracker_);
  detail::read_into(archive, "scaler.overflows_in_a_row", overflows_in_a_row_);
  detail::read_into(archive, "scaler.collapsed_windows", collapsed_windows_);
}

TRAINKIT_INLINE void PrecisionPolicy<FP16Dynamic>::update_with_extras(const torch::Tensor& inf) {
  const auto overflow = inf > 0;
  const auto at_min = scale_ <= static_cast<float>(options_.min_scale());
  collapsed_windows_.copy_(torch::where(overflow & at_min, collapsed_windows_ + 1, 0));

  const auto in_a_row = torch::where(overflow, overflows_in_a_row_ + 1, 0);
  const auto cut = overflow & (in_a_row >= options_.hysteresis());
  const auto backed_off =
      (scale_ * static_cast<float>(options_.backoff_factor()))
          .clamp_min(static_cast<float>(options_.min_scale()));

  const auto successful = growth_tracker_ + 1;
  const auto grow = overflow.logical_not() & (successful >= options_.growth_interval());
  auto grown = scale_ * static_cast<float>(options_.growth_factor());
  grown = torch::where(grown.isfinite(),
                       grown.clamp_max(static_cast<float>(options_.max_scale())), scale_);

  scale_.copy_(torch::where(cut, backed_off, torch::where(grow, grown, scale_)));
  growth_tracker_.copy_(torch::where(overflow | grow, 0, successful));
  overflows_in_a_row_.copy_(torch::where(cut, 0, in_a_row));
}

}  // namespace trainkit
