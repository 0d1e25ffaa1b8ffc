#pragma once
/// The definitions of trainkit/storage/master_storage.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/master_storage.hpp>
#include <trainkit/storage/records.hpp>

#include <unordered_set>

namespace trainkit {

TRAINKIT_INLINE void MasterStorage::validate(const TrainerOptions& options, const std::string& trainer) {
  if (options.sharding() == Sharding::parameters && options.reduce_precision() == ReducePrecision::half)
    throw std::invalid_argument("trainkit::TrainerOptions: " + trainer + ": reduce_precision half "
                                "with ZeRO stage 3 (Sharding::parameters, "
                                "TRAIN.ZERO_STAGE: 3): each unit's gradient is summed in fp32 as its half gradients "
                                "arrive and reduce-scattered in fp32 at each micro-batch's end; set reduce_precision "
                                "automatic or fp32, or use stage 2 for a half reduction");
}

TRAINKIT_INLINE MasterStorage::MasterStorage(torch::nn::Module& model, const TrainerOptions& options,
                                             torch::Device device, at::ScalarType half)
    : StorageBase(model, options, device, static_cast<std::int64_t>(c10::elementSize(half)),
                  /*any_floating_point=*/true),
      half_dtype_(half) {
  const auto padded = placement_.layout().padded();
  params_ = placement_.allocate_flat(padded, device);
  std::unordered_set<const c10::TensorImpl*> kept;  // parameters that stay fp32 (views into the masters)
  if (options.keep_norm_fp32()) kept = detail::normalisation_parameters(model);
  half_.allocate_parameters(padded, half, device);
  detail::store_untrained_in(model, half, options.keep_norm_fp32());
  std::int64_t kept_numel = 0;
  auto& placed = placement_.parameters();
  for (auto& e : placed) {
    auto master = detail::Placement::copy_in(e, params_);
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
  for (size_t i = 0; i < placed.size(); ++i) {
    auto& e = placed[i];
    const auto n = e.param.numel();
    e.param.mutable_grad() = (kept_[i] ? half_.add_kept(e.offset, n) : half_.grad_view(e.offset, n)).view(e.param.sizes());
    views_.record(e);
  }
  placement_.make_groups(params_, torch::Tensor());  // (the groups' gradient is bound in each phase)
  half_.finish();
  half_.write_back(params_);
  // Sharded units hold one fp32 gradient per unit once attached: the half one is released until
  // a backward of a process that never shards (prepare_gradient) needs it.
  if (units_configured_) half_.zero_grad(/*release=*/true);
}

TRAINKIT_INLINE void MasterStorage::zero_gradient(bool release) {
  half_.zero_grad(release);
  grad_ = torch::Tensor();
  chunk_ = torch::Tensor();
  placement_.bind_gradients(grad_);  // (sharded: unbound already)
}

TRAINKIT_INLINE GradientFactor MasterStorage::reduce_whole(Replicas& replicas, const detail::Partition& partition,
                                                           const WindowWeights& window) {
  std::optional<GradientFactor> reduced;
  if (reduce_half())
    reduced = half_.reduce_in_half([&](torch::Tensor& h) { return replicas.reduce_buckets(h, {}, partition, window, true); });
  if ((single_process_ || reduced) && !half_.summed().defined() && params_.numel() > options_.master_chunk()) {
    chunk_ = torch::empty({(options_.master_chunk() + 63) / 64 * 64}, params_.options());
    return reduced ? *reduced : GradientFactor{window.rescale, {}};  // (one process: nothing to sum)
  }
  grad_ = half_.gather();
  placement_.bind_gradients(grad_);
  return reduced ? *reduced : replicas.reduce_buckets(grad_, {}, partition, window, /*closes=*/true);
}

TRAINKIT_INLINE torch::Tensor MasterStorage::norm_whole() {
  return chunk_.defined() ? half_.norm_in_chunks(chunk_) : at::linalg_vector_norm(grad_, 2);
}

TRAINKIT_INLINE void MasterStorage::update_whole(const detail::UpdatePart& f) {
  if (chunk_.defined()) {
    const auto total = params_.numel(), size = chunk_.numel();
    for (std::int64_t begin = 0; begin < total; begin += size, ++phase_chunks_) {
      const auto n = std::min(size, total - begin);
      auto part = chunk_.narrow(0, 0, n);
      half_.gradient_chunk(begin, n, part);
      f(placement_.chunk_groups({begin, n}, params_.narrow(0, begin, n), part, begin), part);
    }
  } else {
    f(placement_.groups(), grad_);
  }
  half_.write_back(params_);  // the model's half parameters from the masters, one copy
}

TRAINKIT_INLINE void MasterStorage::whole_gradient_parts(std::vector<torch::Tensor>& parts,
                                                          std::vector<std::int64_t>& owners) const {
  if (grad_.defined()) return placement_.whole_parts(grad_, parts, owners);
  placement_.whole_parts(half_.grad(), parts, owners);
  const auto& placed = placement_.parameters();
  for (size_t i = 0; i < placed.size(); ++i)
    if (kept_[i] && placed[i].param.grad().defined()) {
      parts.push_back(placed[i].param.grad().view({-1}));
      owners.push_back(placed[i].order);
    }
}

TRAINKIT_INLINE void MasterStorage::save_whole_window(torch::serialize::OutputArchive& archive) const {
  const auto& layout = placement_.layout();
  layout.write(archive, "window.gradient_half", half_.grad());
  if (half_.summed().defined()) layout.write(archive, "window.gradient_sum", half_.summed());
  if (half_.kept_grad().defined()) detail::write_tensor(archive, "window.gradient_kept", half_.kept_grad());
}

TRAINKIT_INLINE void MasterStorage::load_whole_window(torch::serialize::InputArchive& archive) {
  const auto& layout = placement_.layout();
  half_.allocate_if_released();
  layout.read_into(archive, "window.gradient_half", half_.grad());
  torch::Tensor sum;  // the fp32 sum of the window's earlier micro-batches, when it has some
  if (detail::try_read_tensor(archive, "window.gradient_sum", sum))
    layout.unpack_into(sum, half_.summed_for_load(), "checkpoint record 'window.gradient_sum'");
  else
    half_.drop_sum();
  if (half_.kept_grad().defined()) detail::read_into(archive, "window.gradient_kept", half_.kept_grad());
}

TRAINKIT_INLINE std::optional<GradientFactor> MasterStorage::reduce_scatter_in_half(Replicas& replicas,
                                                                                   const detail::Partition& partition,
                                                                                   const WindowWeights& window,
                                                                                   torch::Tensor& local) {
  if (half_.summed().defined() || !half_precision_reduction()) return std::nullopt;
  auto local_half = torch::empty({partition.local_total()}, half_.params().options());
  half_.put_kept_in_half();
  auto half = half_.grad();
  const auto factor = replicas.reduce_buckets(half, local_half, partition, window, true);
  local = local_half.to(torch::kFloat);
  return factor;
}

TRAINKIT_INLINE void MasterStorage::publish_update(const detail::ShardedUpdate& mode) {
  torch::NoGradGuard no_grad;
  const auto& partition = mode.partition();
  for (std::int64_t b = 0; b < partition.buckets(); ++b) {
    const auto s = partition.slice(b);
    half_.params().narrow(0, s.begin, s.length).copy_(params_.narrow(0, partition.local(b), s.length));
  }
  sum_kept(*mode.replicas());
  auto half = half_.params();
  mode.replicas()->all_gather(half, partition);
}

TRAINKIT_INLINE void MasterStorage::sum_kept(Replicas& replicas) {
  if (!kept_params_.defined()) return;
  torch::NoGradGuard no_grad;
  kept_params_.zero_();
  if (kept_local_index_.defined())
    kept_params_.index_copy_(0, kept_compact_index_, params_.index_select(0, kept_local_index_));
  replicas.sum(kept_params_);
}

TRAINKIT_INLINE void MasterStorage::snapshot_precision(torch::serialize::OutputArchive& archive) const {
  if (half_.params().defined()) detail::write_tensor(archive, "snapshot.half", half_.params());
  if (kept_params_.defined()) detail::write_tensor(archive, "snapshot.kept", kept_params_);
}

TRAINKIT_INLINE void MasterStorage::restore_precision(torch::serialize::InputArchive& archive) {
  if (half_.params().defined()) detail::read_into(archive, "snapshot.half", half_.params());
  if (kept_params_.defined()) detail::read_into(archive, "snapshot.kept", kept_params_);
}

TRAINKIT_INLINE void MasterStorage::lay_out(detail::Replicated& mode, torch::nn::Module& model) {
  mode.replicas()->attach(model, params_, /*rewritten=*/half_.params());
  half_.write_back(params_);  // rank 0's masters, into the half parameters attach left alone
  single_process_ = dynamic_cast<const SingleProcess*>(mode.replicas()) != nullptr;
}

TRAINKIT_INLINE void MasterStorage::lay_out(detail::ShardedUpdate& mode, torch::nn::Module& model) {
  mode.replicas()->attach(model, params_, /*rewritten=*/half_.params());
  half_.write_back(params_);  // rank 0's masters, into the half parameters attach left alone
  single_process_ = false;
  shard(mode);
}

TRAINKIT_INLINE void MasterStorage::lay_out(detail::ShardedUnits& mode, torch::nn::Module& model) {
  single_process_ = false;
  auto& placed = placement_.parameters();
  for (auto& e : placed) e.param.mutable_grad() = torch::Tensor();  // (one gradient per unit, as needed)
  views_.clear();
  mode.replicas()->attach(model, params_, /*rewritten=*/half_.params());
  torch::NoGradGuard no_grad;
  const auto masters = params_;  // rank 0's, in the construction's layout (until sharded)
  move_kept(masters);
  std::vector<std::int64_t> offsets;  // (the mode lays the parameters out again)
  for (const auto& e : placed) offsets.push_back(e.offset);
  half_ = detail::HalfStorage();  // (the parameters keep the whole half model until they move)
  mode.shard(half_dtype_, [&](size_t i) { return masters.narrow(0, offsets[i], placed[i].param.numel()); }, kept_);
  index_kept(mode);
}

TRAINKIT_INLINE void MasterStorage::shard(const detail::ShardingMode& mode) {
  const auto& partition = mode.partition();
  const auto total = partition.total();
  if (total != params_.numel()) {
    auto masters = torch::zeros({total}, params_.options());
    masters.narrow(0, 0, params_.numel()).copy_(params_);
    params_ = masters;
  }
  half_.extend(total);
  torch::NoGradGuard no_grad;
  move_kept(params_);
  views_.clear();
  auto& placed = placement_.parameters();
  for (size_t i = 0; i < placed.size(); ++i) {
    auto& e = placed[i];
    const auto n = e.param.numel();
    if (!kept_[i]) {
      e.param.set_data(half_.param_view(e.offset, n).view(e.param.sizes()));
      e.param.mutable_grad() = half_.grad_view(e.offset, n).view(e.param.sizes());
    }
    views_.record(e);
  }
  index_kept(mode);
  auto local = torch::zeros({partition.local_total()}, params_.options());
  for (std::int64_t b = 0; b < partition.buckets(); ++b) {
    const auto s = partition.slice(b);
    local.narrow(0, partition.local(b), s.length).copy_(params_.narrow(0, s.begin, s.length));
  }
  params_ = local;  // (the whole masters go)
  placement_.unbind_groups();  // metadata only: see parameters()
  release_cached(device_);
}

TRAINKIT_INLINE void MasterStorage::move_kept(const torch::Tensor& masters) {
  auto& placed = placement_.parameters();
  std::int64_t kept_numel = 0;
  for (size_t i = 0; i < placed.size(); ++i) kept_numel += kept_[i] ? placed[i].param.numel() : 0;
  if (kept_numel == 0) return;
  kept_params_ = torch::empty({kept_numel}, params_.options());
  std::int64_t at = 0;
  for (size_t i = 0; i < placed.size(); ++i) {
    if (!kept_[i]) continue;
    auto& e = placed[i];
    const auto n = e.param.numel();
    auto view = kept_params_.narrow(0, at, n);
    view.copy_(masters.narrow(0, e.offset, n));
    e.param.set_data(view.view(e.param.sizes()));
    at += n;
  }
}

TRAINKIT_INLINE void MasterStorage::index_kept(const detail::ShardingMode& mode) {
  std::vector<std::int64_t> local_positions, kept_positions;
  std::int64_t at = 0;
  const auto& placed = placement_.parameters();
  for (size_t i = 0; i < placed.size(); ++i) {
    if (!kept_[i]) continue;
    const auto& e = placed[i];
    for (const auto& p : mode.slices_of(e))
      for (std::int64_t j = 0; j < p.length; ++j) {
        local_positions.push_back(p.at + j);
        kept_positions.push_back(at + p.from + j);
      }
    at += e.param.numel();
  }
  if (local_positions.empty()) return;
  const auto long_opts = torch::dtype(torch::kLong).device(device_);
  kept_local_index_ = torch::tensor(local_positions, torch::kLong).to(long_opts);
  kept_compact_index_ = torch::tensor(kept_positions, torch::kLong).to(long_opts);
}

TRAINKIT_INLINE void MasterStorage::load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                                const detail::Replicated& mode) {
  mode.read_local(archive, "model.param.", params_);
  torch::NoGradGuard no_grad;
  half_.write_back(params_);
  detail::read_frozen(archive, module);
}

TRAINKIT_INLINE void MasterStorage::load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                                const detail::ShardedUpdate& mode) {
  // This rank's masters; the half model and the kept parameters from the records (every rank
  // reads them all): no collective.
  mode.read_local(archive, "model.param.", params_);
  torch::NoGradGuard no_grad;
  const auto& placed = placement_.parameters();
  for (size_t i = 0; i < placed.size(); ++i) {
    const auto& e = placed[i];
    const auto saved = detail::read_tensor(archive, "model.param." + e.name).reshape({-1});
    half_.params().narrow(0, e.offset, e.param.numel()).copy_(saved);
    if (kept_[i]) e.param.view({-1}).copy_(saved);
  }
  detail::read_frozen(archive, module);
}

TRAINKIT_INLINE void MasterStorage::load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                                const detail::ShardedUnits& mode) {
  // This rank's masters and the kept parameters (every rank reads those records whole); the
  // mode makes the half slices from the masters.
  mode.read_local(archive, "model.param.", params_);
  torch::NoGradGuard no_grad;
  const auto& placed = placement_.parameters();
  for (size_t i = 0; i < placed.size(); ++i)
    if (kept_[i]) placed[i].param.view({-1}).copy_(detail::read_tensor(archive, "model.param." + placed[i].name).reshape({-1}));
  detail::read_frozen(archive, module);
}

TRAINKIT_INLINE bool MasterStorage::reduce_half() const {
  return half_precision_reduction() && !single_process_ && !half_.summed().defined();
}

TRAINKIT_INLINE bool MasterStorage::half_precision_reduction() const {
  const auto p = options_.reduce_precision();
  return p == ReducePrecision::half || (p == ReducePrecision::automatic && half_dtype_ == at::kHalf);
}

}  // namespace trainkit
