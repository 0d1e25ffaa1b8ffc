#pragma once
/// Clip policies: what happens to the window's gradient between the norm and the update.
///
/// Contract — what the trainer calls, and when (optimizer phase 8):
///   ClipPolicy<Mode>(const TrainerOptions&)       once, at construction
///   divisor(divisor, true_norm) -> torch::Tensor  once per phase
///       divisor:   device scalar: the accumulated gradient is the true gradient times this
///                  (loss scale / rescale)
///       true_norm: device scalar, the global L2 norm of the true gradient (computed once by
///                  the trainer, reused here)
///       returns the device scalar the optimizer divides the gradient by. A policy either folds
///       itself into that scalar (ClipNorm: divisor / coef, no pass over the gradient) or acts
///       on the gradient in apply() and returns 1 (ClipValue, which needs true values to clamp)
///   apply(gradient, divisor)                      on each chunk of the gradient, before its
///                                                 update (nothing for NoClip and ClipNorm)
/// Guarantees: clipping never sees scaled gradients; a non-finite norm gives a non-finite
/// result, and the trainer skips the update then; nothing is read back to the host.
#include <trainkit/detail/type_traits.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/step/tags.hpp>

#include <torch/types.h>

namespace trainkit {

template <class Mode>
class ClipPolicy {
  static_assert(detail::always_false<Mode>,
                "trainkit::ClipPolicy<T>: T must be one of tk::NoClip, tk::ClipNorm or "
                "tk::ClipValue");
};

template <>
class ClipPolicy<NoClip> {
 public:
  using mode = NoClip;
  explicit ClipPolicy(const TrainerOptions&) {}
  const torch::Tensor& divisor(const torch::Tensor& divisor, const torch::Tensor&) { return divisor; }
  void apply(torch::Tensor&, const torch::Tensor&) const {}
};

/// ClipNorm: gradient *= min(1, max_norm / (norm + 1e-6)), folded into the optimizer's divisor.
template <>
class ClipPolicy<ClipNorm> {
 public:
  using mode = ClipNorm;
  explicit ClipPolicy(const TrainerOptions& options) : max_norm_(options.max_grad_norm()) {}
  torch::Tensor divisor(const torch::Tensor& divisor, const torch::Tensor& true_norm);
  void apply(torch::Tensor&, const torch::Tensor&) const {}
  double max_norm() const { return max_norm_; }

 private:
  double max_norm_;
  torch::Tensor max_norm_tensor_;
};

/// ClipValue: clamp the true gradient to [-v, v]; needs one pass to unscale and clamp.
template <>
class ClipPolicy<ClipValue> {
 public:
  using mode = ClipValue;
  explicit ClipPolicy(const TrainerOptions& options) : value_(options.clip_value()) {}
  torch::Tensor divisor(const torch::Tensor& divisor, const torch::Tensor&) { return torch::ones_like(divisor); }
  void apply(torch::Tensor& gradient, const torch::Tensor& divisor) const;
  double value() const { return value_; }

 private:
  double value_;
};

template <class T>
struct is_clip_policy : std::false_type {};
template <class Mode>
struct is_clip_policy<ClipPolicy<Mode>>
    : std::bool_constant<std::is_same_v<Mode, NoClip> || std::is_same_v<Mode, ClipNorm> ||
                         std::is_same_v<Mode, ClipValue>> {};

inline torch::Tensor ClipPolicy<ClipNorm>::divisor(const torch::Tensor& divisor,
                                                   const torch::Tensor& true_norm) {
  // The same coefficient as torch::nn::utils::clip_grad_norm_ (eps 1e-6, capped at 1), with
  // max_norm as a device scalar made once (a Scalar / Tensor costs two more ATen calls).
  if (!max_norm_tensor_.defined()) max_norm_tensor_ = torch::full({}, max_norm_, true_norm.options());
  const auto coef = at::div(max_norm_tensor_, true_norm + 1e-6).clamp_max(1.0);
  return divisor / coef;
}

inline void ClipPolicy<ClipValue>::apply(torch::Tensor& gradient, const torch::Tensor& divisor) const {
  gradient.div_(divisor).clamp_(-value_, value_);
}

}  // namespace trainkit
