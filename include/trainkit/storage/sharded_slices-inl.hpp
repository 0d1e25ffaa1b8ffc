#pragma once
/// The definitions of trainkit/storage/sharded_slices.hpp (header-only: included by it;
/// compiled mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/records.hpp>
#include <trainkit/storage/sharded_slices.hpp>
#include <trainkit/storage/storage_core.hpp>

#include <algorithm>

namespace trainkit::detail {

TRAINKIT_INLINE torch::Tensor ShardedSlices::norm() { return replicas_->global_norm(local_grad_); }

TRAINKIT_INLINE void ShardedSlices::update(const UpdatePart& f) {
  before_update();
  const auto& values = storage_.params_;
  const bool local = values_local();
  for (std::int64_t b = 0; b < partition_.buckets(); ++b) {
    auto part = local_grad_.narrow(0, partition_.local(b), partition_.slice(b).length);
    f(storage_.placement().slice_groups(partition_, b, values, local, local_grad_), part);
  }
  after_update();
}

TRAINKIT_INLINE void ShardedSlices::gradient_parts(std::vector<torch::Tensor>& parts,
                                                    std::vector<std::int64_t>& owners) const {
  if (!local_grad_.defined()) return;
  for (const auto& e : storage_.placement().parameters())
    for (const auto& p : slices_of(e)) {
      parts.push_back(local_grad_.narrow(0, p.at, p.length));
      owners.push_back(e.order);
    }
}

TRAINKIT_INLINE std::vector<ParameterSlice> ShardedSlices::slices_of(const PlacedParameter& e) const {
  std::vector<ParameterSlice> out;
  const Range p{e.offset, e.param.numel()};
  for (std::int64_t b = 0; b < partition_.buckets(); ++b) {
    const Range s = partition_.slice(b);
    const auto lo = std::max(s.begin, p.begin), hi = std::min(s.end(), p.end());
    if (lo < hi) out.push_back({partition_.local(b) + (lo - s.begin), lo - p.begin, hi - lo});
  }
  return out;
}

TRAINKIT_INLINE void ShardedSlices::write_local(torch::serialize::OutputArchive& archive, const std::string& prefix,
                                                const torch::Tensor& local) const {
  const auto& placed = storage_.placement().parameters();
  if (const auto* set = ShardedWrites::of(archive)) {
    for (const auto& e : placed) {
      for (const auto& p : slices_of(e)) write_chunk(prefix + e.name, e.param.sizes(), p.from, local.narrow(0, p.at, p.length));
      if (e.param.numel() == 0 && set->main()) write_chunk(prefix + e.name, e.param.sizes(), 0, local.narrow(0, 0, 0));
    }
    return;
  }
  const auto global = replicas_->gather_to_main(local, partition_);
  if (global.defined()) write_by_name(archive, placed, prefix, global);
}

TRAINKIT_INLINE void ShardedSlices::check_attach_again(bool masters) const {
  TORCH_CHECK(!masters, "MasterStorage: the replicas are attached once when the update is sharded");
}

TRAINKIT_INLINE torch::Tensor ShardedSlices::reduction_target() {
  torch::Tensor& target = summed_ ? scratch_ : local_grad_;
  if (!target.defined()) target = torch::empty({partition_.local_total()}, storage_.params_.options());
  return target;
}

TRAINKIT_INLINE GradientFactor ShardedSlices::reduce_into_sum(const WindowWeights& window, bool closes) {
  const GradientFactor factor = reduction_ ? finish_started() : reduce_now(window, closes);
  if (summed_) local_grad_.add_(scratch_);
  summed_ = true;
  return factor;
}

TRAINKIT_INLINE void ShardedSlices::save_reduced_window(torch::serialize::OutputArchive& archive, bool snapshot) const {
  TORCH_CHECK(summed_, "Sharding::gradients: an open window without a reduced micro-batch");
  if (snapshot) {
    write_tensor(archive, "snapshot.window_local", local_grad_);
    return;
  }
  write_local(archive, "window.gradient_reduced.", local_grad_);
}

TRAINKIT_INLINE void ShardedSlices::load_reduced_window(torch::serialize::InputArchive& archive, bool snapshot) {
  if (snapshot) {
    local_grad_ = read_tensor(archive, "snapshot.window_local").to(storage_.params_.device());
    summed_ = true;
    return;
  }
  check_window_kind(archive, storage_.placement().parameters(), /*reduced=*/true);
  local_grad_ = torch::zeros({partition_.local_total()}, storage_.params_.options());
  read_local(archive, "window.gradient_reduced.", local_grad_);
  summed_ = true;
}

}  // namespace trainkit::detail
