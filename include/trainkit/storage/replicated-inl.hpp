#pragma once
/// The definitions of trainkit/storage/replicated.hpp (header-only: included by it; compiled
/// mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/records.hpp>
#include <trainkit/storage/replicated.hpp>
#include <trainkit/storage/storage_core.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE void Replicated::attach(torch::nn::Module& model) {
  storage_.lay_out(*this, model);
  if (overlap_) install_readiness();
}

TRAINKIT_INLINE void Replicated::backward_done(const BackwardDone& done) {
  if (!done.closes) storage_.accumulate();
}

TRAINKIT_INLINE GradientFactor Replicated::reduce(Replicas& replicas, const WindowWeights& window) {
  storage_.prepare_gradient();
  if (reduction_) return finish_started();
  return storage_.reduce_whole(replicas, partition_, window);
}

TRAINKIT_INLINE torch::Tensor Replicated::norm() { return storage_.norm_whole(); }

TRAINKIT_INLINE void Replicated::update(const UpdatePart& f) { storage_.update_whole(f); }

TRAINKIT_INLINE void Replicated::zero() {
  drop_reduction();  // (after a failed forward or backward too)
  storage_.zero_gradient(/*release=*/false);
}

TRAINKIT_INLINE void Replicated::gradient_parts(std::vector<torch::Tensor>& parts,
                                                 std::vector<std::int64_t>& owners) const {
  storage_.whole_gradient_parts(parts, owners);
}

TRAINKIT_INLINE void Replicated::save(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                      const UpdateRule& rule) const {
  storage_.save_values(archive, module, *this);
  save_state(archive, rule);
}

TRAINKIT_INLINE void Replicated::load(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                      UpdateRule& rule) {
  storage_.load_values(archive, module, *this);
  load_state(archive, rule);
}

TRAINKIT_INLINE void Replicated::save_window(torch::serialize::OutputArchive& archive, bool) const {
  storage_.save_whole_window(archive);
}

TRAINKIT_INLINE void Replicated::load_window(torch::serialize::InputArchive& archive, bool) {
  check_window_kind(archive, storage_.placement().parameters(), /*reduced=*/false);
  storage_.load_whole_window(archive);
}

TRAINKIT_INLINE const torch::Tensor& Replicated::replicated_state() const { return storage_.params_; }

TRAINKIT_INLINE void Replicated::write_local(torch::serialize::OutputArchive& archive, const std::string& prefix,
                                             const torch::Tensor& local) const {
  write_by_name(archive, storage_.placement().parameters(), prefix, local);
}

TRAINKIT_INLINE void Replicated::read_state(torch::serialize::InputArchive& archive, const std::string& prefix,
                                            const torch::Tensor& flat) const {
  const auto& placement = storage_.placement();
  const auto& placed = placement.parameters();
  if (!placed.empty() && !tensor_shape(archive, prefix + placed.front().name) && tensor_shape(archive, prefix + "0")) {
    for (size_t g = 0; g < placement.groups().size(); ++g) {
      const auto& range = placement.group_ranges()[g];
      placement.groups()[g].layout.read_into(archive, prefix + std::to_string(g), flat.narrow(0, range.begin, range.length));
    }
    return;
  }
  read_local(archive, prefix, flat);
}

}  // namespace trainkit::detail
