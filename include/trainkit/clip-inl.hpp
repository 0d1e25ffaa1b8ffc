#pragma once
/// The definitions of trainkit/clip.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/clip.hpp>

namespace trainkit {

TRAINKIT_INLINE torch::Tensor ClipPolicy<ClipNorm>::divisor(const torch::Tensor& divisor,
                                                            const torch::Tensor& true_norm) {
  // The same coefficient as torch::nn::utils::clip_grad_norm_ (eps 1e-6, capped at 1), with
  // max_norm as a device scalar made once (a Scalar / Tensor costs two more ATen calls).
  if (!max_norm_tensor_.defined()) max_norm_tensor_ = torch::full({}, max_norm_, true_norm.options());
  const auto coef = at::div(max_norm_tensor_, true_norm + 1e-6).clamp_max(1.0);
  return divisor / coef;
}

TRAINKIT_INLINE void ClipPolicy<ClipValue>::apply(torch::Tensor& gradient, const torch::Tensor& divisor) const {
  gradient.div_(divisor).clamp_(-value_, value_);
}

}  // namespace trainkit
