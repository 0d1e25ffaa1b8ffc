#pragma once
/// The definitions of trainkit/storage/storage_base.hpp (header-only: included by it; compiled
/// mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/records.hpp>
#include <trainkit/storage/replicated.hpp>
#include <trainkit/storage/sharded_update.hpp>
#include <trainkit/storage/sharded_units.hpp>
#include <trainkit/storage/storage_base.hpp>

#include <algorithm>

namespace trainkit::detail {

// (StorageCore's defaults for the modes that derive from others, written here where every
// mode is complete.)

TRAINKIT_INLINE StorageBase::StorageBase(torch::nn::Module& model, const TrainerOptions& options, torch::Device device,
                                         std::int64_t element_size, bool any_floating_point)
    : StorageCore(model, options, device, element_size, any_floating_point),
      mode_(std::make_unique<Replicated>(*this, nullptr, buckets(SingleProcess(), false), /*overlap=*/false)) {}

TRAINKIT_INLINE StorageBase::~StorageBase() = default;

TRAINKIT_INLINE Partition StorageBase::buckets(const Replicas& replicas, bool sharded) const {
  const auto padded = placement_.layout().padded();
  return replicas.communicates()
             ? Partition(padded, std::max<std::int64_t>(1, replicas.bucket_bytes() / element_size_), placement_.align(),
                         replicas.world_size(), replicas.rank(), sharded)
             : Partition(padded, std::max<std::int64_t>(1, padded), placement_.align(), 1, 0, false);
}

TRAINKIT_INLINE bool StorageBase::attach(Replicas& replicas, torch::nn::Module& model) {
  mode_->check_attach_again(holds_masters());
  // The one place a mode is chosen: TrainerOptions::sharding, with ranks to shard over.
  const auto sharding = options_.sharding();
  const bool overlap = options_.overlap_reduction() && reduces_in_place() && replicas.communicates();
  std::unique_ptr<ShardingMode> mode;
  if (sharding == Sharding::none || !replicas.communicates())
    mode = std::make_unique<Replicated>(*this, &replicas, buckets(replicas, false), overlap);
  else if (sharding == Sharding::parameters)
    mode = std::make_unique<ShardedUnits>(*this, replicas);
  else if (sharding == Sharding::gradients)
    mode = std::make_unique<ShardedGradients>(*this, replicas, buckets(replicas, true), overlap);
  else
    mode = std::make_unique<ShardedUpdate>(*this, replicas, buckets(replicas, true), overlap);
  mode_ = std::move(mode);  // (the previous mode's hooks find their listener gone)
  mode_->attach(model);
  return sharded();
}

TRAINKIT_INLINE const Partition& StorageBase::partition() const { return mode_->partition(); }
TRAINKIT_INLINE std::int64_t StorageBase::state_numel() const { return mode_->partition().local_total(); }
TRAINKIT_INLINE bool StorageBase::sharded() const { return mode_->partition().sharded(); }
TRAINKIT_INLINE const torch::Tensor& StorageBase::local_gradients() const { return mode_->local_gradients(); }
TRAINKIT_INLINE std::int64_t StorageBase::overlapped_buckets() const { return mode_->overlapped_buckets(); }
TRAINKIT_INLINE double StorageBase::backward_left_at_launch() const { return mode_->backward_left_at_launch(); }
TRAINKIT_INLINE const UnitGathers* StorageBase::unit_gathers() const { return mode_->unit_gathers(); }

TRAINKIT_INLINE void StorageBase::backward_begins(const BackwardDone& done) { mode_->backward_begins(done); }
TRAINKIT_INLINE void StorageBase::backward_done(const BackwardDone& done) { mode_->backward_done(done); }
TRAINKIT_INLINE GradientFactor StorageBase::reduce(Replicas& replicas, const WindowWeights& window) {
  return mode_->reduce(replicas, window);
}
TRAINKIT_INLINE torch::Tensor StorageBase::norm() { return mode_->norm(); }
TRAINKIT_INLINE void StorageBase::update(const UpdatePart& f) { mode_->update(f); }
TRAINKIT_INLINE void StorageBase::zero() { mode_->zero(); }
TRAINKIT_INLINE void StorageBase::gradient_parts(std::vector<torch::Tensor>& parts,
                                                  std::vector<std::int64_t>& owners) const {
  mode_->gradient_parts(parts, owners);
}
TRAINKIT_INLINE bool StorageBase::reduces_each_micro_batch() const { return mode_->reduces_each_micro_batch(); }
TRAINKIT_INLINE void StorageBase::discard_micro_batch() { mode_->discard_micro_batch(); }
TRAINKIT_INLINE void StorageBase::allocate_gradient() { mode_->allocate_gradient(); }

TRAINKIT_INLINE void StorageBase::save(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                       const UpdateRule& rule) const {
  mode_->save(archive, module, rule);
}
TRAINKIT_INLINE void StorageBase::load(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                       UpdateRule& rule) {
  mode_->load(archive, module, rule);
}

// A snapshot holds what this rank holds, as it is: the values, the mode's own buffers, the
// precision's, the frozen parameters and the rule's state (read back only by restore()).
TRAINKIT_INLINE void StorageBase::snapshot(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                           const UpdateRule& rule) const {
  write_tensor(archive, "snapshot.values", params_);
  mode_->snapshot(archive);
  snapshot_precision(archive);
  write_frozen(archive, module);
  for (const auto* s : rule.flat_states()) write_tensor(archive, "snapshot." + s->kind(), s->flat());
}

TRAINKIT_INLINE void StorageBase::restore(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                          UpdateRule& rule) {
  torch::NoGradGuard no_grad;
  mode_->before_restore();
  read_into(archive, "snapshot.values", params_);
  restore_precision(archive);
  read_frozen(archive, module);
  for (auto* s : rule.flat_states()) read_into(archive, "snapshot." + s->kind(), s->flat());
  mode_->restore(archive);
}

TRAINKIT_INLINE void StorageBase::save_window(torch::serialize::OutputArchive& archive, bool snapshot) const {
  mode_->save_window(archive, snapshot);
}
TRAINKIT_INLINE void StorageBase::load_window(torch::serialize::InputArchive& archive, bool snapshot) {
  mode_->load_window(archive, snapshot);
}
TRAINKIT_INLINE void StorageBase::after_load() { mode_->after_load(); }
TRAINKIT_INLINE const torch::Tensor& StorageBase::replicated_state() const { return mode_->replicated_state(); }

TRAINKIT_INLINE std::shared_ptr<UnitSchedule> StorageBase::begin_forward() { return mode_->begin_forward(); }
TRAINKIT_INLINE bool StorageBase::shards_parameters() const { return mode_->shards_parameters(); }
TRAINKIT_INLINE void StorageBase::hold_parameters(bool hold) { mode_->hold_parameters(hold); }
TRAINKIT_INLINE void StorageBase::evaluate_by_unit(bool on) { mode_->evaluate_by_unit(on); }
TRAINKIT_INLINE void StorageBase::check_loadable(const std::string& source) const { mode_->check_loadable(source); }

TRAINKIT_INLINE void StorageBase::held_tensors(std::vector<torch::Tensor>& out) const {
  out.push_back(params_);
  mode_->held_tensors(out);
}

TRAINKIT_INLINE void StorageCore::lay_out(ShardedGradients& mode, torch::nn::Module& model) {
  lay_out(static_cast<ShardedUpdate&>(mode), model);
}

TRAINKIT_INLINE void StorageCore::save_values(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                              const Replicated& mode) const {
  save_local_values(archive, module, mode);
}
TRAINKIT_INLINE void StorageCore::save_values(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                              const ShardedUpdate& mode) const {
  save_local_values(archive, module, mode);
}
TRAINKIT_INLINE void StorageCore::load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                              const Replicated& mode) {
  load_local_values(archive, module, mode);
}
TRAINKIT_INLINE void StorageCore::load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                              const ShardedUpdate& mode) {
  load_local_values(archive, module, mode);
}
TRAINKIT_INLINE void StorageCore::load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                              const ShardedUnits& mode) {
  load_local_values(archive, module, mode);
}


}  // namespace trainkit::detail
