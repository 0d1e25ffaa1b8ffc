#pragma once
/// The definitions of trainkit/storage/master_storage.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/master_storage.hpp>

namespace trainkit {

TRAINKIT_INLINE MasterStorage::MasterStorage(torch::nn::Module& model, const TrainerOptions& options,
                                             torch::Device device, at::ScalarType half)
    : options_(options), device_(device), half_dtype_(half) {
  overlap_ = options.overlap_reduction();
  place(model, options, device, static_cast<std::int64_t>(c10::elementSize(half)), /*any_floating_point=*/true);
  params_ = allocate_flat(layout_.padded(), device);
  std::unordered_set<const c10::TensorImpl*> kept;  // parameters that stay fp32 (views into the masters)
  if (options.keep_norm_fp32()) kept = detail::normalisation_parameters(model);
  half_.allocate_parameters(layout_.padded(), half, device);
  detail::store_untrained_in(model, half, options.keep_norm_fp32());
  std::int64_t kept_numel = 0;
  for (auto& e : placed_) {
    auto master = copy_in(e, params_);
    if (kept.count(e.param.unsafeGetTensorImpl())) {
      e.param.set_data(master);
      kept_.push_back(true);
      kept_numel += e.param.numel();
    } else {
      e.param.set_data(half_.param_view(e.offset, e.param.numel()).view(e.param.sizes()));
      kept_.push_back(false);
    }
  }
  release_cached(device);
  half_.allocate_gradients(kept_numel);
  for (size_t i = 0; i < placed_.size(); ++i) {
    auto& e = placed_[i];
    const auto n = e.param.numel();
    e.param.mutable_grad() = (kept_[i] ? half_.add_kept(e.offset, n) : half_.grad_view(e.offset, n)).view(e.param.sizes());
    record_view(e);
  }
  make_groups(torch::Tensor());  // (the groups' gradient is bound in each phase)
  half_.finish();
  half_.write_back(params_);
  // Stage 3 holds one fp32 gradient per unit once sharded: the half one is released until a
  // backward of a process that never shards (backward_begins) needs it.
  if (options.sharding() == Sharding::parameters) half_.zero_grad(/*release=*/true);
}

TRAINKIT_INLINE bool MasterStorage::attach(Replicas& replicas, torch::nn::Module& model) {
  TORCH_CHECK(!sharded(), "MasterStorage: the replicas are attached once when the update is sharded");
  replicas_ = &replicas;
  if (options_.sharding() == Sharding::parameters && replicas.communicates()) {
    require_units();
    single_process_ = false;
    for (auto& e : placed_) e.param.mutable_grad() = torch::Tensor();  // (one gradient per unit, as needed)
    views_.clear();
    replicas.attach(model, params_, /*rewritten=*/half_.params());
    shard_units();
    install_hooks(/*overlap=*/false);  // (the units launch their reductions from the backward's gathers)
    return true;
  }
  replicas.attach(model, params_, /*rewritten=*/half_.params());
  half_.write_back(params_);  // rank 0's masters, into the half parameters attach left alone
  single_process_ = dynamic_cast<const SingleProcess*>(&replicas) != nullptr;
  partition_ = partition_for(replicas, options_.sharding(), half_.params().element_size());
  if (sharded()) shard();
  return sharded();
}

TRAINKIT_INLINE void MasterStorage::backward_done(const detail::BackwardDone& done) {
  if (units_) return end_unit_backward(done);
  if (done.closes) return;
  if (!shards_gradients()) {
    half_.accumulate();
    return;
  }
  if (!done.micro_batch_ends) return;
  scatter_into_sum(done.window, /*closes=*/false);
  half_.zero_grad(/*release=*/true);
}

TRAINKIT_INLINE GradientFactor MasterStorage::reduce(Replicas& replicas, const WindowWeights& window) {
  if (units_) return finish_reduction(replicas, window, /*closes=*/true);
  if (sharded()) {
    half_.allocate_if_released();  // (a window flushed after a reduced micro-batch: zeros)
    const auto factor = scatter_into_sum(window, /*closes=*/true);
    if (shards_gradients()) half_.zero_grad(/*release=*/true);  // (stage 1: zero() after the phase)
    return factor;
  }
  half_.allocate_if_released();  // (stage 3 configured, one process: a window with no backward yet)
  std::optional<GradientFactor> reduced;
  if (reduce_half())
    reduced = half_.reduce_in_half([&](torch::Tensor& h) { return replicas.reduce_buckets(h, {}, partition_, window, true); });
  if ((single_process_ || reduced) && !half_.summed().defined() && params_.numel() > options_.master_chunk()) {
    chunk_ = torch::empty({(options_.master_chunk() + 63) / 64 * 64}, params_.options());
    return reduced ? *reduced : GradientFactor{window.rescale, {}};  // (one process: nothing to sum)
  }
  grad_ = half_.gather();
  bind_gradients(grad_);
  return reduced ? *reduced : replicas.reduce_buckets(grad_, {}, partition_, window, /*closes=*/true);
}

TRAINKIT_INLINE torch::Tensor MasterStorage::norm() {
  if (sharded()) return replicas_->global_norm(local_grad_);
  return chunk_.defined() ? half_.norm_in_chunks(chunk_) : at::linalg_vector_norm(grad_, 2);
}

TRAINKIT_INLINE void MasterStorage::zero() {
  if (units_) {  // (after a failed forward or backward too)
    drop_backward();
  } else {
    half_.zero_grad(/*release=*/shards_gradients());
  }
  grad_ = torch::Tensor();
  chunk_ = torch::Tensor();
  if (!sharded()) bind_gradients(grad_);
  summed_ = false;
  local_grad_ = scratch_ = torch::Tensor();  // sharded: the reduced slices live from a reduction to the update
}

TRAINKIT_INLINE void MasterStorage::save(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                         const detail::UpdateRule& rule) const {
  write_local_by_name(archive, "model.param.", params_);
  for (const auto& p : module.named_parameters(true))
    if (!p.value().requires_grad()) detail::write_tensor(archive, "model.param." + p.key(), p.value());
  save_state(archive, rule);
}

TRAINKIT_INLINE void MasterStorage::load(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                         detail::UpdateRule& rule) {
  if (units_) units_->settle_all();  // (the half slices are a gather's input)
  read_by_name(archive, "model.param.", params_);
  torch::NoGradGuard no_grad;
  if (sharded()) {
    // The half model and the kept parameters from the records (every rank reads them all):
    // no collective. Stage 3: the kept parameters, and this rank's half slices from its
    // masters; the root unit is gathered in after_load().
    for (size_t i = 0; i < placed_.size(); ++i) {
      const auto& e = placed_[i];
      if (units_ && !kept_[i]) continue;
      const auto saved = detail::read_tensor(archive, "model.param." + e.name).reshape({-1});
      if (!units_) half_.params().narrow(0, e.offset, e.param.numel()).copy_(saved);
      if (kept_[i]) e.param.view({-1}).copy_(saved);
    }
    if (units_) unit_slices_.copy_(params_);
  } else {
    half_.write_back(params_);
  }
  for (const auto& p : module.named_parameters(true))
    if (!p.value().requires_grad()) detail::read_into(archive, "model.param." + p.key(), p.value());
  load_state(archive, rule);
}

TRAINKIT_INLINE void MasterStorage::snapshot(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                             const detail::UpdateRule& rule) const {
  detail::write_tensor(archive, "snapshot.masters", params_);
  detail::write_tensor(archive, "snapshot.half", units_ ? unit_slices_ : half_.params());
  if (units_) detail::write_tensor(archive, "snapshot.root", root_unit());
  if (kept_params_.defined()) detail::write_tensor(archive, "snapshot.kept", kept_params_);
  for (const auto& p : module.named_parameters(true))
    if (!p.value().requires_grad()) detail::write_tensor(archive, "model.param." + p.key(), p.value());
  for (const auto* s : rule.flat_states()) detail::write_tensor(archive, "snapshot." + s->kind(), s->flat());
}

TRAINKIT_INLINE void MasterStorage::restore(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                            detail::UpdateRule& rule) {
  torch::NoGradGuard no_grad;
  if (units_) units_->settle_all();  // (the half slices are a gather's input)
  detail::read_into(archive, "snapshot.masters", params_);
  detail::read_into(archive, "snapshot.half", units_ ? unit_slices_ : half_.params());
  if (units_) detail::read_into(archive, "snapshot.root", root_unit());
  if (kept_params_.defined()) detail::read_into(archive, "snapshot.kept", kept_params_);
  for (const auto& p : module.named_parameters(true))
    if (!p.value().requires_grad()) detail::read_into(archive, "model.param." + p.key(), p.value());
  for (auto* s : rule.flat_states()) detail::read_into(archive, "snapshot." + s->kind(), s->flat());
  if (units_) units_->release_all();
}

TRAINKIT_INLINE void MasterStorage::save_window(torch::serialize::OutputArchive& archive, bool snapshot) const {
  if (shards_gradients()) {
    save_reduced_window(archive, snapshot);
    return;
  }
  layout_.write(archive, "window.gradient_half", half_.grad());
  if (half_.summed().defined()) layout_.write(archive, "window.gradient_sum", half_.summed());
  if (half_.kept_grad().defined()) detail::write_tensor(archive, "window.gradient_kept", half_.kept_grad());
}

TRAINKIT_INLINE void MasterStorage::load_window(torch::serialize::InputArchive& archive, bool snapshot) {
  if (load_reduced_window(archive, snapshot, shards_gradients())) return;
  half_.allocate_if_released();
  layout_.read_into(archive, "window.gradient_half", half_.grad());
  torch::Tensor sum;  // the fp32 sum of the window's earlier micro-batches, when it has some
  if (detail::try_read_tensor(archive, "window.gradient_sum", sum))
    layout_.unpack_into(sum, half_.summed_for_load(), "checkpoint record 'window.gradient_sum'");
  else
    half_.drop_sum();
  if (half_.kept_grad().defined()) detail::read_into(archive, "window.gradient_kept", half_.kept_grad());
}

TRAINKIT_INLINE bool MasterStorage::reduce_half() const {
  const auto p = options_.reduce_precision();
  const bool half = p == ReducePrecision::half ||
                    (p == ReducePrecision::automatic && half_dtype_ == at::kHalf);
  return half && !single_process_ && !half_.summed().defined();
}

TRAINKIT_INLINE void MasterStorage::shard() {
  const auto total = partition_.total();
  if (total != params_.numel()) {
    auto masters = torch::zeros({total}, params_.options());
    masters.narrow(0, 0, params_.numel()).copy_(params_);
    params_ = masters;
  }
  half_.extend(total);
  torch::NoGradGuard no_grad;
  move_kept(params_);
  views_.clear();
  for (size_t i = 0; i < placed_.size(); ++i) {
    auto& e = placed_[i];
    const auto n = e.param.numel();
    if (!kept_[i]) {
      e.param.set_data(half_.param_view(e.offset, n).view(e.param.sizes()));
      e.param.mutable_grad() = half_.grad_view(e.offset, n).view(e.param.sizes());
    }
    record_view(e);
  }
  index_kept();
  auto local = torch::zeros({partition_.local_total()}, params_.options());
  for (std::int64_t b = 0; b < partition_.buckets(); ++b) {
    const auto s = partition_.slice(b);
    local.narrow(0, partition_.local(b), s.length).copy_(params_.narrow(0, s.begin, s.length));
  }
  params_ = local;  // (the whole masters go)
  for (auto& g : groups_) g.params = g.grads = torch::Tensor();  // metadata only: see parameters()
  release_cached(device_);
}

TRAINKIT_INLINE void MasterStorage::shard_units() {
  torch::NoGradGuard no_grad;
  const auto masters = params_;  // rank 0's, in the construction's layout (until sharded)
  move_kept(masters);
  std::vector<std::int64_t> offsets;  // (shard_into_units lays the parameters out again)
  for (const auto& e : placed_) offsets.push_back(e.offset);
  half_ = detail::HalfStorage();  // (the parameters keep the whole half model until they move)
  shard_into_units(
      half_dtype_, [&](size_t i) { return masters.narrow(0, offsets[i], placed_[i].param.numel()); }, kept_,
      options_.unit_prefetch(), options_.reshard_after_forward(), device_);
  index_kept();
}

TRAINKIT_INLINE void MasterStorage::move_kept(const torch::Tensor& masters) {
  std::int64_t kept_numel = 0;
  for (size_t i = 0; i < placed_.size(); ++i) kept_numel += kept_[i] ? placed_[i].param.numel() : 0;
  if (kept_numel == 0) return;
  kept_params_ = torch::empty({kept_numel}, params_.options());
  std::int64_t at = 0;
  for (size_t i = 0; i < placed_.size(); ++i) {
    if (!kept_[i]) continue;
    auto& e = placed_[i];
    const auto n = e.param.numel();
    auto view = kept_params_.narrow(0, at, n);
    view.copy_(masters.narrow(0, e.offset, n));
    e.param.set_data(view.view(e.param.sizes()));
    at += n;
  }
}

TRAINKIT_INLINE void MasterStorage::index_kept() {
  std::vector<std::int64_t> local_positions, kept_positions;
  std::int64_t at = 0;
  for (size_t i = 0; i < placed_.size(); ++i) {
    if (!kept_[i]) continue;
    const auto& e = placed_[i];
    for_each_piece(e, [&](std::int64_t local, std::int64_t from, std::int64_t k) {
      for (std::int64_t j = 0; j < k; ++j) {
        local_positions.push_back(local + j);
        kept_positions.push_back(at + from + j);
      }
    });
    at += e.param.numel();
  }
  if (local_positions.empty()) return;
  const auto long_opts = torch::dtype(torch::kLong).device(device_);
  kept_local_index_ = torch::tensor(local_positions, torch::kLong).to(long_opts);
  kept_compact_index_ = torch::tensor(kept_positions, torch::kLong).to(long_opts);
}

TRAINKIT_INLINE GradientFactor MasterStorage::scatter_into_sum(const WindowWeights& window, bool closes) {
  const auto local_total = partition_.local_total();
  if (closes && !summed_ && !half_.summed().defined() && half_precision_reduction()) {
    auto local_half = torch::empty({local_total}, half_.params().options());
    half_.put_kept_in_half();
    auto half = half_.grad();
    const auto factor = replicas_->reduce_buckets(half, local_half, partition_, window, true);
    local_grad_ = local_half.to(torch::kFloat);
    return factor;
  }
  auto full = half_.gather();  // the fp32 gradient (or the window's fp32 sum), transient
  torch::Tensor& target = summed_ ? scratch_ : local_grad_;
  if (!target.defined() || target.numel() != local_total) target = torch::empty({local_total}, params_.options());
  const auto factor = replicas_->reduce_buckets(full, target, partition_, window, closes);
  if (summed_) local_grad_.add_(scratch_);
  summed_ = true;
  return factor;
}

TRAINKIT_INLINE bool MasterStorage::half_precision_reduction() const {
  const auto p = options_.reduce_precision();
  return p == ReducePrecision::half || (p == ReducePrecision::automatic && half_dtype_ == at::kHalf);
}

TRAINKIT_INLINE void MasterStorage::write_back_sharded() {
  torch::NoGradGuard no_grad;
  if (units_) unit_slices_.copy_(params_);  // (settled before the update)
  for (std::int64_t b = 0; b < partition_.buckets() && !units_; ++b) {
    const auto s = partition_.slice(b);
    half_.params().narrow(0, s.begin, s.length).copy_(params_.narrow(0, partition_.local(b), s.length));
  }
  if (kept_params_.defined()) {
    kept_params_.zero_();
    if (kept_local_index_.defined())
      kept_params_.index_copy_(0, kept_compact_index_, params_.index_select(0, kept_local_index_));
    replicas_->sum(kept_params_);
  }
  if (units_) return units_->refresh();  // (the root unit; the others where they are used)
  auto half = half_.params();
  replicas_->all_gather(half, partition_);
}

}  // namespace trainkit
