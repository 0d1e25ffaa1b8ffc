#pragma once
/// The definitions of trainkit/storage/master_weights.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/master_weights.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE bool is_normalisation_layer(const torch::nn::Module& m) {
  using namespace torch::nn;
  return dynamic_cast<const LayerNormImpl*>(&m) || dynamic_cast<const GroupNormImpl*>(&m) ||
         dynamic_cast<const BatchNorm1dImpl*>(&m) || dynamic_cast<const BatchNorm2dImpl*>(&m) ||
         dynamic_cast<const BatchNorm3dImpl*>(&m) || dynamic_cast<const InstanceNorm1dImpl*>(&m) ||
         dynamic_cast<const InstanceNorm2dImpl*>(&m) || dynamic_cast<const InstanceNorm3dImpl*>(&m);
}

TRAINKIT_INLINE std::unordered_set<const c10::TensorImpl*> normalisation_parameters(torch::nn::Module& model) {
  std::unordered_set<const c10::TensorImpl*> out;
  for (const auto& m : model.modules(/*include_self=*/true))
    if (is_normalisation_layer(*m))
      for (const auto& p : m->parameters(/*recurse=*/false)) out.insert(p.unsafeGetTensorImpl());
  return out;
}

TRAINKIT_INLINE void store_untrained_in(torch::nn::Module& model, at::ScalarType dtype, bool keep_norm_fp32) {
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

TRAINKIT_INLINE void HalfStorage::allocate_parameters(std::int64_t numel, at::ScalarType dtype, torch::Device device) {
  params_ = torch::empty({numel}, torch::dtype(dtype).device(device));
}

TRAINKIT_INLINE void HalfStorage::allocate_gradients(std::int64_t kept_numel) {
  grad_ = torch::zeros_like(params_);
  if (kept_numel > 0) kept_grad_ = torch::zeros({kept_numel}, params_.options().dtype(torch::kFloat));
}

TRAINKIT_INLINE torch::Tensor HalfStorage::add_kept(std::int64_t offset, std::int64_t n) {
  auto view = kept_grad_.narrow(0, kept_used_, n);
  kept_used_ += n;
  kept_positions_.push_back(torch::arange(offset, offset + n, torch::kLong));
  return view;
}

TRAINKIT_INLINE void HalfStorage::finish() {
  if (!kept_positions_.empty()) {
    kept_index_host_ = torch::cat(kept_positions_);  // ascending: add_kept() runs in layout order
    kept_index_ = kept_index_host_.to(grad_.device());
  }
  kept_positions_.clear();
}

TRAINKIT_INLINE void HalfStorage::accumulate() {
  ensure_sum();
  if (summed_) add_into_sum();
  else sum_.copy_(grad_);
  summed_ = true;
  grad_.zero_();
}

TRAINKIT_INLINE torch::Tensor HalfStorage::gather() {
  auto flat = summed_ ? add_into_sum() : grad_.to(torch::kFloat);
  if (kept_index_.defined()) flat.index_copy_(0, kept_index_, kept_grad_);
  return flat;
}

TRAINKIT_INLINE torch::Tensor HalfStorage::norm_in_chunks(torch::Tensor& buffer) const {
  const auto chunk = buffer.numel(), total = grad_.numel();
  const auto count = (total + chunk - 1) / chunk;
  auto norms = torch::zeros({count + 1}, buffer.options());
  for (std::int64_t i = 0; i < count; ++i) {
    const auto n = std::min(chunk, total - i * chunk);
    auto part = buffer.narrow(0, 0, n);
    part.copy_(grad_.narrow(0, i * chunk, n));
    auto out = norms.select(0, i);
    at::linalg_vector_norm_out(out, part, 2);
  }
  if (kept_grad_.defined()) {
    auto out = norms.select(0, count);
    at::linalg_vector_norm_out(out, kept_grad_, 2);
  }
  return at::linalg_vector_norm(norms, 2);
}

TRAINKIT_INLINE void HalfStorage::gradient_chunk(std::int64_t begin, std::int64_t n, torch::Tensor& out) {
  out.copy_(grad_.narrow(0, begin, n));
  if (!kept_index_host_.defined()) return;
  // The kept positions in [begin, begin + n): a range of the ascending kept index.
  const auto* first = kept_index_host_.data_ptr<std::int64_t>();
  const auto* last = first + kept_index_host_.numel();
  const auto lo = std::lower_bound(first, last, begin) - first;
  const auto hi = std::lower_bound(first, last, begin + n) - first;
  if (hi == lo) return;
  auto local = kept_index_.narrow(0, lo, hi - lo) - begin;
  out.index_copy_(0, local, kept_grad_.narrow(0, lo, hi - lo));
}

TRAINKIT_INLINE torch::Tensor& HalfStorage::summed_for_load() {
  ensure_sum();
  summed_ = true;
  return sum_;
}

TRAINKIT_INLINE void HalfStorage::write_back(const torch::Tensor& masters) {
  torch::NoGradGuard no_grad;
  params_.copy_(masters);
}

TRAINKIT_INLINE void HalfStorage::zero_grad(bool release) {
  if (release) {
    if (!is_released(grad_)) release_storage(grad_);
  } else if (!is_released(grad_)) {  // (released: zeros when allocated again)
    grad_.zero_();
  }
  if (kept_grad_.defined()) kept_grad_.zero_();
  summed_ = false;  // the next window's first accumulate() copies
}

TRAINKIT_INLINE void HalfStorage::allocate_if_released() {
  if (is_released(grad_)) allocate_released(grad_);
}

TRAINKIT_INLINE void HalfStorage::extend(std::int64_t numel) {
  if (numel == params_.numel()) return;
  auto params = torch::zeros({numel}, params_.options());
  params.narrow(0, 0, params_.numel()).copy_(params_);
  params_ = params;
  grad_ = torch::zeros({numel}, params_.options());
}

TRAINKIT_INLINE void HalfStorage::put_kept_in_half() {
  if (kept_index_.defined()) grad_.index_copy_(0, kept_index_, kept_grad_.to(grad_.scalar_type()));
}

TRAINKIT_INLINE torch::Tensor& HalfStorage::add_into_sum() {
  if (!grad_.is_cpu()) return sum_.add_(grad_);
  constexpr std::int64_t slice = std::int64_t{1} << 20;
  const auto total = grad_.numel();
  for (std::int64_t begin = 0; begin < total; begin += slice) {
    const auto n = std::min(slice, total - begin);
    sum_.narrow(0, begin, n).add_(grad_.narrow(0, begin, n));
  }
  return sum_;
}

}  // namespace trainkit::detail
