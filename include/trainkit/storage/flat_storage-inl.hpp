#pragma once
/// The definitions of trainkit/storage/flat_storage.hpp (header-only: included by it; compiled
/// mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/flat_storage.hpp>
#include <trainkit/storage/records.hpp>

namespace trainkit {

TRAINKIT_INLINE void FlatStorage::validate(const TrainerOptions& options, const std::string& trainer) {
  if (options.reduce_precision() == ReducePrecision::half)
    throw std::invalid_argument(
        "trainkit::TrainerOptions: reduce_precision half needs master weights (PrecisionPolicy<MasterWeights<T>>): "
        "without them the gradient is fp32, and " + trainer + " all-reduces it as it is");
}

TRAINKIT_INLINE FlatStorage::FlatStorage(torch::nn::Module& model, const TrainerOptions& options, torch::Device device,
                                         at::ScalarType dtype)
    : StorageBase(model, options, device, /*element_size=*/4, /*any_floating_point=*/false) {
  TORCH_CHECK(dtype == at::kFloat, "FlatStorage holds fp32 parameters, not ", dtype);
  // Sharded units hold a gradient per unit once attached: until then there is no flat one;
  // prepare_gradient() makes it at its first use if the replicas never shard, so that
  // construction holds the model once, not twice.
  allocate(placement_.layout().padded(), /*gradient=*/!units_configured_);
}

TRAINKIT_INLINE void FlatStorage::allocate(std::int64_t numel, bool gradient) {
  // The old gradient goes first (the parameters' .grad and the groups hold views of it), so
  // that at most the parameters are held twice.
  auto& placed = placement_.parameters();
  for (auto& e : placed) e.param.mutable_grad() = torch::Tensor();
  placement_.unbind_groups();
  views_.clear();
  grad_ = torch::Tensor();
  auto flat = placement_.allocate_flat(numel, device_);
  for (auto& e : placed) e.param.set_data(detail::Placement::copy_in(e, flat));  // (releases the old storage)
  params_ = flat;
  release_cached(device_);
  if (gradient) return bind_flat_gradient(numel);
  views_.record_all(placed);
  placement_.make_groups(params_, grad_);
}

TRAINKIT_INLINE void FlatStorage::bind_flat_gradient(std::int64_t numel) {
  grad_ = torch::zeros({numel}, params_.options());
  views_.clear();
  for (auto& e : placement_.parameters()) {
    e.param.mutable_grad() = grad_.narrow(0, e.offset, e.param.numel()).view(e.param.sizes());
    views_.record(e);
  }
  placement_.make_groups(params_, grad_);
}

TRAINKIT_INLINE void FlatStorage::prepare_gradient() {
  if (!grad_.defined()) bind_flat_gradient(params_.numel());  // (sharded units configured, one process: its first use)
  else if (detail::is_released(grad_)) detail::allocate_released(grad_);
}

TRAINKIT_INLINE void FlatStorage::zero_gradient(bool release) {
  if (release) {
    if (!detail::is_released(grad_)) detail::release_storage(grad_);
  } else if (grad_.defined()) {  // (none yet: sharded units configured, before the first backward)
    grad_.zero_();
  }
}

TRAINKIT_INLINE GradientFactor FlatStorage::reduce_whole(Replicas& replicas, const detail::Partition& partition,
                                                         const WindowWeights& window) {
  return replicas.reduce_buckets(grad_, {}, partition, window, /*closes=*/true);
}

TRAINKIT_INLINE torch::Tensor FlatStorage::norm_whole() { return at::linalg_vector_norm(grad_, 2); }

TRAINKIT_INLINE void FlatStorage::update_whole(const detail::UpdatePart& f) { f(placement_.groups(), grad_); }

TRAINKIT_INLINE void FlatStorage::whole_gradient_parts(std::vector<torch::Tensor>& parts,
                                                        std::vector<std::int64_t>& owners) const {
  placement_.whole_parts(grad_, parts, owners);
}

TRAINKIT_INLINE void FlatStorage::save_whole_window(torch::serialize::OutputArchive& archive) const {
  placement_.layout().write(archive, "window.gradient", grad_);
}

TRAINKIT_INLINE void FlatStorage::load_whole_window(torch::serialize::InputArchive& archive) {
  prepare_gradient();
  placement_.layout().read_into(archive, "window.gradient", grad_);
}

TRAINKIT_INLINE void FlatStorage::publish_update(const detail::ShardedUpdate& mode) {
  mode.replicas()->all_gather(params_, mode.partition());
}

TRAINKIT_INLINE void FlatStorage::lay_out(detail::Replicated& mode, torch::nn::Module& model) {
  lay_out_whole(mode, model);
}

TRAINKIT_INLINE void FlatStorage::lay_out(detail::ShardedUpdate& mode, torch::nn::Module& model) {
  lay_out_whole(mode, model);
}

TRAINKIT_INLINE void FlatStorage::lay_out_whole(const detail::ShardingMode& mode, torch::nn::Module& model) {
  // (The partition pads the buffers to whole buckets: the parameters move into longer ones.)
  if (mode.partition().total() != params_.numel()) allocate(mode.partition().total(), /*gradient=*/true);
  mode.replicas()->attach(model, params_);
}

TRAINKIT_INLINE void FlatStorage::lay_out(detail::ShardedGradients& mode, torch::nn::Module& model) {
  lay_out(static_cast<detail::ShardedUpdate&>(mode), model);
  zero_gradient(/*release=*/true);  // (its memory exists from a backward to its reduction)
}

TRAINKIT_INLINE void FlatStorage::lay_out(detail::ShardedUnits& mode, torch::nn::Module& model) {
  // The whole gradient goes first (the mode holds one per unit, and only as needed); every rank
  // takes rank 0's values in the construction's layout (one broadcast).
  auto& placed = placement_.parameters();
  for (auto& e : placed) e.param.mutable_grad() = torch::Tensor();
  placement_.bind_gradients(torch::Tensor());
  views_.clear();
  grad_ = torch::empty({0}, params_.options());
  mode.replicas()->attach(model, params_);
  // Each parameter's values are its own view of the construction's flat buffer until moved.
  mode.shard(at::kFloat, [&](size_t i) { return placed[i].param.reshape({-1}); }, {});
}

TRAINKIT_INLINE void FlatStorage::save_values(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                              const detail::Replicated&) const {
  detail::write_module_parameters(archive, module);
}

TRAINKIT_INLINE void FlatStorage::save_values(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                              const detail::ShardedUpdate& mode) const {
  const auto* set = detail::ShardedWrites::of(archive);
  if (set == nullptr) return detail::write_module_parameters(archive, module);
  // Every rank holds the parameters; each writes the parts its slices cover (a set's files then
  // split the model over the ranks), the main rank the frozen ones (and the empty ones, which no
  // slice covers).
  for (const auto& e : placement_.parameters()) {
    for (const auto& p : mode.slices_of(e))
      detail::write_chunk("model.param." + e.name, e.param.sizes(), p.from, params_.narrow(0, e.offset + p.from, p.length));
    if (e.param.numel() == 0 && set->main()) detail::write_chunk("model.param." + e.name, e.param.sizes(), 0, e.param);
  }
  detail::write_frozen(archive, module);
}

TRAINKIT_INLINE void FlatStorage::load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                              const detail::Replicated&) {
  detail::read_module_parameters(archive, module);
}

TRAINKIT_INLINE void FlatStorage::load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                              const detail::ShardedUpdate&) {
  detail::read_module_parameters(archive, module);  // (every rank reads every record)
}

}  // namespace trainkit
