#pragma once
/// Precision policies: where the forward runs (autocast region) and how the loss is scaled.
///
/// Contract — what the trainer calls, and when:
///   PrecisionPolicy<Mode>(const LossScaleOptions&, torch::Device)   once, at construction
///   region()            micro-step phase 1: an RAII guard; the closure runs inside it
///   scales_loss         constexpr; when true, the loss is multiplied by scale() before backward
///   scale()             a device scalar (fp32), the current loss scale (1 when not scaling)
///   update(found_inf)   optimizer phase 10, once per window, with found_inf an fp32 device
///                       scalar (1.0 = a non-finite gradient was found); no host sync
///   check(step)         the host-side checks that need a value (the collapse error); called
///                       by the trainer only at windows where it reads values anyway
///   save / load         the scaler's state, for checkpoints
///   storage             the parameter storage the trainer holds (storage.hpp): FlatStorage,
///                       or MasterStorage with master weights; built with storage_dtype, the
///                       dtype of the model's parameters
///   master_weights      constexpr; true when the trainer keeps fp32 master copies (below)
/// Guarantees: scale() and every counter stay on the device; with all extras of
/// LossScaleOptions off, FP16Dynamic's scale follows torch.amp.GradScaler exactly.
/// The one run-time branch of a policy inside the step: FP16Dynamic's update() chooses, by a
/// host bool fixed at construction, between ATen's fused GradScaler kernel (no extras) and the
/// element-wise form with hysteresis and clamps. Both are device-only; a type per choice would
/// double the FP16Dynamic trainers for one predictable branch per window.
///
/// Master weights (Apex O2): `PrecisionPolicy<MasterWeights<FP16Dynamic>>` (or FP16Static,
/// BF16) is the wrapped mode's scaler and autocast region, with the model stored in half
/// precision. Its storage, MasterStorage (master_storage.hpp), keeps the fp32 masters, sums
/// the window's gradient in fp32, runs phases 6-9 on fp32 gradients, and rewrites the half
/// parameters from the masters (one copy).
#include <trainkit/detail/inline.hpp>
#include <trainkit/archive/checkpoint_io.hpp>
#include <trainkit/detail/type_traits.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/step/tags.hpp>

#include <ATen/autocast_mode.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <optional>
#include <sstream>
#include <stdexcept>
#include <type_traits>

namespace trainkit {

class FlatStorage;    // storage.hpp
class MasterStorage;  // master_storage.hpp

/// Thrown when the dynamic loss scale has collapsed (see LossScaleOptions::collapse_windows).
class LossScaleCollapsed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// RAII autocast region for one device type: enables autocast to `dtype` and restores the
/// previous state (enabled flag, dtype, cache) on exit, so regions nest and never leak.
class AutocastRegion {
 public:
  AutocastRegion(c10::DeviceType device_type, at::ScalarType dtype);
  ~AutocastRegion();
  AutocastRegion(const AutocastRegion&) = delete;
  AutocastRegion& operator=(const AutocastRegion&) = delete;

 private:
  c10::DeviceType device_type_;
  bool was_enabled_;
  at::ScalarType previous_dtype_;
};

/// The region of FP32: nothing happens.
struct NoRegion {};

/// Primary template: only the four tags are precision modes.
template <class Mode>
class PrecisionPolicy {
  static_assert(detail::always_false<Mode>,
                "trainkit::PrecisionPolicy<T>: T must be one of tk::FP32, tk::BF16, "
                "tk::FP16Static or tk::FP16Dynamic (or tk::MasterWeights<one of the last three>)");
};

namespace detail {

/// Shared by the modes without loss scaling: the scale is the constant 1.
class UnitScale {
 public:
  static constexpr bool scales_loss = false;
  static constexpr bool master_weights = false;
  using storage = FlatStorage;
  static constexpr at::ScalarType storage_dtype = at::kFloat;
  UnitScale(const LossScaleOptions&, torch::Device device)
      : device_(device), one_(torch::ones({}, torch::dtype(torch::kFloat).device(device))) {}
  const torch::Tensor& scale() const { return one_; }
  void update(const torch::Tensor& /*found_inf*/) {}
  void check(std::int64_t /*step*/) const {}
  void save(torch::serialize::OutputArchive&) const {}
  void load(torch::serialize::InputArchive&) {}
  torch::Device device() const { return device_; }

 private:
  torch::Device device_;
  torch::Tensor one_;
};

}  // namespace detail

/// FP32: no autocast, no scaling.
template <>
class PrecisionPolicy<FP32> : public detail::UnitScale {
 public:
  using mode = FP32;
  using detail::UnitScale::UnitScale;
  NoRegion region() const { return {}; }
};

/// BF16: autocast to bfloat16; bf16 has fp32's range, so no loss scaling.
template <>
class PrecisionPolicy<BF16> : public detail::UnitScale {
 public:
  using mode = BF16;
  using detail::UnitScale::UnitScale;
  AutocastRegion region() const { return {device().type(), at::kBFloat16}; }
};

/// FP16Static: autocast to float16 with a fixed loss scale; an overflowing window is skipped
/// (never applied, unlike Apex's static mode).
template <>
class PrecisionPolicy<FP16Static> {
 public:
  using mode = FP16Static;
  static constexpr bool scales_loss = true;
  static constexpr bool master_weights = false;
  using storage = FlatStorage;
  static constexpr at::ScalarType storage_dtype = at::kFloat;
  PrecisionPolicy(const LossScaleOptions& options, torch::Device device)
      : device_(device),
        scale_(torch::full({}, options.static_scale(),
                           torch::dtype(torch::kFloat).device(device))) {}
  AutocastRegion region() const { return {device_.type(), at::kHalf}; }
  const torch::Tensor& scale() const { return scale_; }
  void update(const torch::Tensor& /*found_inf*/) {}
  void check(std::int64_t /*step*/) const {}
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  torch::Device device_;
  torch::Tensor scale_;
};

/// FP16Dynamic: autocast to float16 with torch.amp.GradScaler's dynamic loss scale, plus
/// DeepSpeed/Apex-style extras (hysteresis, min/max clamps, collapse error), all off by default.
template <>
class PrecisionPolicy<FP16Dynamic> {
 public:
  using mode = FP16Dynamic;
  static constexpr bool scales_loss = true;
  static constexpr bool master_weights = false;
  using storage = FlatStorage;
  static constexpr at::ScalarType storage_dtype = at::kFloat;

  PrecisionPolicy(const LossScaleOptions& options, torch::Device device);

  AutocastRegion region() const { return {device_.type(), at::kHalf}; }
  const torch::Tensor& scale() const { return scale_; }
  const torch::Tensor& growth_tracker() const { return growth_tracker_; }
  const torch::Tensor& overflows_in_a_row() const { return overflows_in_a_row_; }

  /// Phase 10: the scale update. Without extras this is ATen's own GradScaler kernel.
  /// `found_inf`: an fp32 tensor of one element (ATen's kernel checks numel and dtype).
  void update(const torch::Tensor& found_inf);

  /// Host-side check of the collapse error; reads one device value.
  void check(std::int64_t step) const;

  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  // The same arithmetic as _amp_update_scale_ (fp32 products, the growth only when finite),
  // with hysteresis (cut only after H overflows in a row), clamps, and the collapse counter,
  // written as element-wise tensor ops so that nothing leaves the device.
  void update_with_extras(const torch::Tensor& inf);

  LossScaleOptions options_;
  torch::Device device_;
  // extras_: hysteresis or the collapse check (update_with_extras). Otherwise ATen's fused
  // update, then clamps_ (a floor or a ceiling): one clamp_, the same values as the extras'
  // clamps (the scale starts inside [min, max], validate() checks it).
  bool extras_ = false, clamps_ = false;
  torch::Tensor scale_, growth_tracker_, overflows_in_a_row_, collapsed_windows_;
};

namespace detail {
/// Stands in for the base of PrecisionPolicy<MasterWeights<T>> with an invalid T, so that the
/// only error is MasterWeights' own static_assert.
struct InvalidMasterWeights {
  static constexpr bool scales_loss = false;
  InvalidMasterWeights(const LossScaleOptions&, torch::Device) {}
};
}  // namespace detail

/// Master weights: the wrapped mode's region and loss scale; the model's parameters stored in
/// storage_dtype (float16 for the FP16 modes, bfloat16 for BF16), fp32 masters in the trainer.
/// The forward keeps the wrapped mode's autocast region: with half weights autocast casts
/// nothing that is already half, still casts fp32 inputs for matmul-like ops (so the model
/// receives its inputs as they are), and keeps its fp32 islands (losses; on CUDA also softmax
/// and normalisation), which Apex O2 has to patch in by hand.
template <class Mode>
class PrecisionPolicy<MasterWeights<Mode>>
    : public std::conditional_t<detail::is_half_mode<Mode>, PrecisionPolicy<Mode>,
                                detail::InvalidMasterWeights> {
  static_assert(detail::is_half_mode<Mode>,
                "trainkit::MasterWeights<T>: T must be one of tk::BF16, tk::FP16Static or "
                "tk::FP16Dynamic (with tk::FP32 the weights are fp32 already: use "
                "tk::PrecisionPolicy<tk::FP32>)");
  using Base = std::conditional_t<detail::is_half_mode<Mode>, PrecisionPolicy<Mode>,
                                  detail::InvalidMasterWeights>;

 public:
  using mode = MasterWeights<Mode>;
  static constexpr bool master_weights = true;
  using storage = MasterStorage;
  static constexpr at::ScalarType storage_dtype =
      std::is_same_v<Mode, BF16> ? at::kBFloat16 : at::kHalf;
  using Base::Base;
};

/// The scaling mode of a precision tag: T itself, or T of MasterWeights<T>.
template <class Mode>
struct scaling_mode {
  using type = Mode;
};
template <class Mode>
struct scaling_mode<MasterWeights<Mode>> {
  using type = Mode;
};
template <class Mode>
using scaling_mode_t = typename scaling_mode<Mode>::type;

namespace detail {
/// The autocast dtype of a precision tag's forward region; std::nullopt for FP32.
template <class Mode>
std::optional<at::ScalarType> autocast_dtype_of() {
  switch (Mode::autocast) {
    case HalfType::bfloat16: return at::kBFloat16;
    case HalfType::float16: return at::kHalf;
    case HalfType::none: break;
  }
  return std::nullopt;
}
}  // namespace detail

namespace detail {
/// A policy states its constants for the step; the tag states them for the configuration
/// (tags.hpp): both must say the same.
template <class Mode>
constexpr bool policy_agrees_with_tag() {
  return PrecisionPolicy<Mode>::scales_loss == Mode::scales_loss &&
         PrecisionPolicy<Mode>::master_weights == Mode::master_weights;
}
static_assert(policy_agrees_with_tag<FP32>() && policy_agrees_with_tag<BF16>() &&
                  policy_agrees_with_tag<FP16Static>() && policy_agrees_with_tag<FP16Dynamic>() &&
                  policy_agrees_with_tag<MasterWeights<BF16>>() &&
                  policy_agrees_with_tag<MasterWeights<FP16Static>>() &&
                  policy_agrees_with_tag<MasterWeights<FP16Dynamic>>(),
              "trainkit: a precision policy's scales_loss and master_weights must be its tag's (tags.hpp)");
}  // namespace detail

/// True for PrecisionPolicy<Tag> with a valid tag (MasterWeights<T> with T a half mode).
template <class T>
struct is_precision_policy : std::false_type {};
template <class Mode>
struct is_precision_policy<PrecisionPolicy<Mode>>
    : std::bool_constant<std::is_same_v<Mode, FP32> || std::is_same_v<Mode, BF16> ||
                         std::is_same_v<Mode, FP16Static> || std::is_same_v<Mode, FP16Dynamic>> {};
template <class Mode>
struct is_precision_policy<PrecisionPolicy<MasterWeights<Mode>>>
    : std::bool_constant<detail::is_half_mode<Mode>> {};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/step/precision-inl.hpp>
#endif
