#pragma once
/// Machinery of master weights (PrecisionPolicy<MasterWeights<T>>, see precision.hpp): which
/// parameters stay fp32, and the model-facing half storage that mirrors the trainer's flat
/// fp32 storage element for element.
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/normalization.h>
#include <torch/types.h>

#include <cstdint>
#include <unordered_set>

namespace trainkit::detail {

/// LibTorch's normalisation layers (Apex O2 keeps these in fp32).
inline bool is_normalisation_layer(const torch::nn::Module& m) {
  using namespace torch::nn;
  return dynamic_cast<const LayerNormImpl*>(&m) || dynamic_cast<const GroupNormImpl*>(&m) ||
         dynamic_cast<const BatchNorm1dImpl*>(&m) || dynamic_cast<const BatchNorm2dImpl*>(&m) ||
         dynamic_cast<const BatchNorm3dImpl*>(&m) || dynamic_cast<const InstanceNorm1dImpl*>(&m) ||
         dynamic_cast<const InstanceNorm2dImpl*>(&m) || dynamic_cast<const InstanceNorm3dImpl*>(&m);
}

/// The parameters of normalisation layers, by TensorImpl.
inline std::unordered_set<const c10::TensorImpl*> normalisation_parameters(torch::nn::Module& model) {
  std::unordered_set<const c10::TensorImpl*> out;
  for (const auto& m : model.modules(/*include_self=*/true))
    if (is_normalisation_layer(*m))
      for (const auto& p : m->parameters(/*recurse=*/false)) out.insert(p.unsafeGetTensorImpl());
  return out;
}

/// Stores in `dtype` what the trainer does not flatten: parameters without requires_grad, and
/// the floating-point buffers of normalisation layers (their kernels want the running stats
/// in the parameters' dtype). Other buffers stay as the model made them. Skips normalisation
/// layers when `keep_norm_fp32`.
inline void store_untrained_in(torch::nn::Module& model, at::ScalarType dtype, bool keep_norm_fp32) {
  torch::NoGradGuard no_grad;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    const bool norm = is_normalisation_layer(*m);
    if (norm && keep_norm_fp32) continue;
    for (auto& p : m->parameters(/*recurse=*/false))
      if (!p.requires_grad() && p.is_floating_point()) p.set_data(p.to(dtype));
    if (norm)
      for (auto& b : m->buffers(/*recurse=*/false))
        if (b.is_floating_point()) b.set_data(b.to(dtype));
  }
}

/// The model's half parameters and gradients: two flat buffers laid out exactly as the
/// trainer's fp32 storage (same offsets). Parameters kept in fp32 leave their slices here
/// unused (zero gradient), and live in the fp32 storage itself.
class HalfStorage {
 public:
  void allocate(std::int64_t numel, at::ScalarType dtype, torch::Device device, bool all_half) {
    const auto options = torch::dtype(dtype).device(device);
    params_ = torch::empty({numel}, options);
    grad_ = torch::zeros({numel}, options);
    all_half_ = all_half;
  }
  torch::Tensor param_view(std::int64_t offset, std::int64_t n) const { return params_.narrow(0, offset, n); }
  torch::Tensor grad_view(std::int64_t offset, std::int64_t n) const { return grad_.narrow(0, offset, n); }

  /// The window's half gradient into the fp32 gradient storage, in one pass (the cast is part
  /// of it). With fp32-kept parameters their gradient is already there: add (the half slices
  /// of the fp32 storage are zero between windows, the kept slices of the half storage zero).
  void gather_into(torch::Tensor& flat_grad) const {
    if (all_half_) flat_grad.copy_(grad_);
    else flat_grad.add_(grad_);
  }
  /// The model's parameters from the masters: one copy (a cast, rounding to nearest).
  void write_back(const torch::Tensor& masters) {
    torch::NoGradGuard no_grad;
    params_.copy_(masters);
  }
  void zero_grad() { grad_.zero_(); }

  const torch::Tensor& params() const { return params_; }
  const torch::Tensor& grad() const { return grad_; }

 private:
  torch::Tensor params_, grad_;
  bool all_half_ = true;
};

}  // namespace trainkit::detail
