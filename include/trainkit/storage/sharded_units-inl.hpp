#pragma once
/// The definitions of trainkit/storage/sharded_units.hpp (header-only: included by it; compiled
/// mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/records.hpp>
#include <trainkit/storage/sharded_units.hpp>
#include <trainkit/storage/storage_core.hpp>

#include <stdexcept>

namespace trainkit::detail {

TRAINKIT_INLINE ShardedUnits::~ShardedUnits() {
  if (!gathers_) return;
  UnitRegistry::get().remove(gathers_.get());
  gathers_->close();
}

TRAINKIT_INLINE void ShardedUnits::attach(torch::nn::Module& model) {
  storage_.placement().require_units();
  storage_.lay_out(*this, model);
  // (The units launch their reductions from the backward's gathers, not from the hooks.)
  install_hooks(gathers_);
  // An evaluation by unit joins the ranks still forwarding before a collective of the task's.
  replicas_->join_before_all_reduce(gathers_);
}

TRAINKIT_INLINE void ShardedUnits::check_attach_again(bool masters) const {
  ShardedSlices::check_attach_again(masters);
  throw std::logic_error("set_replicas: the parameters are sharded over the ranks already (ZeRO stage 3); attach "
                         "the replicas once");
}

TRAINKIT_INLINE void ShardedUnits::shard(at::ScalarType unit_dtype, const std::function<torch::Tensor(size_t)>& values,
                                         const std::vector<bool>& skip) {
  auto& placement = storage_.placement_;
  auto& placed = placement.parameters();
  // Each unit one bucket, cut in as many aligned slices as there are ranks.
  const std::int64_t multiple = placement.align() * replicas_->world_size();
  placement.place_offsets(multiple);
  partition_ = Partition(placement.unit_ranges(multiple), replicas_->world_size(), replicas_->rank());
  // Unit by unit: an fp32 buffer filled from the parameters' values, this rank's slice of it
  // kept, the unit's own buffer (that one, or its cast) what the parameters become views of,
  // released but the root unit's: the whole model is held once plus one unit, never twice.
  torch::NoGradGuard no_grad;
  const auto fp32 = torch::dtype(torch::kFloat).device(storage_.device_);
  std::vector<UnitGathers::Unit> units;
  std::vector<std::int64_t> member_of(placed.size(), 0), at(placed.size(), 0);
  auto local = torch::zeros({partition_.local_total()}, fp32);
  torch::Tensor filling;  // the open unit's fp32 values
  const auto finish = [&](UnitGathers::Unit& u) {
    const auto bucket = partition_.bucket(u.bucket), s = partition_.slice(u.bucket);
    local.narrow(0, partition_.local(u.bucket), s.length).copy_(filling.narrow(0, s.begin - bucket.begin, s.length));
    if (unit_dtype != at::kFloat) u.buffer.copy_(filling);
    filling = torch::Tensor();
    if (!u.whole) release_storage(u.buffer);
  };
  for (size_t i = 0; i < placed.size(); ++i) {
    auto& e = placed[i];
    if (i == 0 || e.unit != placed[i - 1].unit) {
      if (!units.empty()) finish(units.back());
      const auto b = static_cast<std::int64_t>(units.size());
      const auto& [name, module] = placement.unit_paths().at(static_cast<size_t>(e.unit));
      filling = torch::zeros({partition_.bucket(b).length}, fp32);
      auto buffer = unit_dtype == at::kFloat ? filling : torch::empty_like(filling, filling.options().dtype(unit_dtype));
      units.push_back({name, module, b, buffer, 0, e.unit == 0});
    }
    auto& u = units.back();
    const auto begin = partition_.bucket(u.bucket).begin;
    const auto n = e.param.numel();
    filling.narrow(0, e.offset - begin, n).copy_(values(i));
    if (skip.empty() || !skip[i]) e.param.set_data(u.buffer.narrow(0, e.offset - begin, n).view(e.param.sizes()));
    ++u.members;
    member_of[i] = u.bucket;
    at[i] = e.offset - begin;
  }
  if (!units.empty()) finish(units.back());
  storage_.params_ = local;  // (the construction's flat buffer goes)
  slices_copy_ = unit_dtype != at::kFloat;
  unit_slices_ = slices_copy_ ? storage_.params_.to(unit_dtype) : storage_.params_;
  placement.make_groups(torch::Tensor(), torch::Tensor());  // metadata only: the update reads this rank's slices
  storage_.views_.record_all(placed);
  std::vector<torch::Tensor> trainable;
  for (const auto& e : placed) trainable.push_back(e.param);
  const auto& options = storage_.options_;
  gathers_ = std::make_shared<UnitGathers>(std::move(units), std::move(trainable), std::move(member_of), std::move(at),
                                           *replicas_, partition_, unit_slices_, options.unit_prefetch(),
                                           options.reshard_after_forward());
  StorageCore::release_cached(storage_.device_);
  UnitRegistry::get().add(gathers_);
}

TRAINKIT_INLINE void ShardedUnits::backward_begins(const BackwardDone& done) {
  if (gathers_->held())
    throw std::logic_error("trainkit: a micro-step while every unit is held gathered (hold_parameters(true)); "
                           "call hold_parameters(false) on every rank first");
  // (Every backward's unit gradients, a micro-batch's or a piece's, are reduce-scattered as the
  // backward leaves each unit: no rank holds every unit's gradient from one backward to the next.)
  if (storage_.options_.overlap_reduction())
    reduction_ = replicas_->start_unit_reduction(unit_gradients(), reduction_target(), partition_, done.window, done.closes);
  gathers_->arm(reduction_.get());
}

TRAINKIT_INLINE void ShardedUnits::backward_done(const BackwardDone& done) {
  gathers_->release_all();  // (the units whose parameters got no gradient)
  if (!done.closes) reduce_into_sum(done.window, /*closes=*/false);
}

TRAINKIT_INLINE GradientFactor ShardedUnits::reduce(Replicas&, const WindowWeights& window) {
  return reduce_into_sum(window, /*closes=*/true);
}

TRAINKIT_INLINE GradientFactor ShardedUnits::reduce_now(const WindowWeights& window, bool closes) {
  return replicas_->start_unit_reduction(unit_gradients(), reduction_target(), partition_, window, closes)->finish();
}

TRAINKIT_INLINE void ShardedUnits::zero() {
  drop_backward();  // (after a failed forward or backward too)
  end_window();
}

TRAINKIT_INLINE void ShardedUnits::drop_backward() {
  drop_reduction();
  gathers_->release_all();
  gathers_->drop_gradients();
}

TRAINKIT_INLINE void ShardedUnits::save(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                        const UpdateRule& rule) const {
  // The trainable parameters from every rank's slices (a set: each rank its own pieces; one
  // file: gathered to the main rank, a collective), the frozen ones as they are.
  storage_.save_local_values(archive, module, *this);
  save_state(archive, rule);
}

TRAINKIT_INLINE void ShardedUnits::load(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                        UpdateRule& rule) {
  // This rank's slices (from a set, only their byte ranges); the root unit is gathered from
  // them in after_load(), once every rank has read its part (a collective).
  gathers_->settle_all();  // (the slices are a gather's input)
  storage_.load_values(archive, module, *this);
  refresh_slices();
  load_state(archive, rule);
}

TRAINKIT_INLINE void ShardedUnits::snapshot(torch::serialize::OutputArchive& archive) const {
  if (slices_copy_) write_tensor(archive, "snapshot.unit_slices", unit_slices_);
  write_tensor(archive, "snapshot.root", replicated_state());
}

TRAINKIT_INLINE void ShardedUnits::restore(torch::serialize::InputArchive& archive) {
  if (slices_copy_) read_into(archive, "snapshot.unit_slices", unit_slices_);
  read_into(archive, "snapshot.root", replicated_state());
  gathers_->release_all();
}

TRAINKIT_INLINE const torch::Tensor& ShardedUnits::replicated_state() const {
  for (const auto& u : gathers_->units())
    if (u.whole) return u.buffer;
  return no_state_;
}

TRAINKIT_INLINE std::shared_ptr<UnitSchedule> ShardedUnits::begin_forward() {
  gathers_->begin_forward();
  return gathers_;
}

TRAINKIT_INLINE void ShardedUnits::hold_parameters(bool hold) {
  if (hold) gathers_->hold();
  else gathers_->release_held();
}

TRAINKIT_INLINE void ShardedUnits::evaluate_by_unit(bool on) {
  if (on) gathers_->begin_evaluation();
  else gathers_->end_evaluation();
}

TRAINKIT_INLINE void ShardedUnits::check_loadable(const std::string& source) const {
  // (Every rank holds alike: hold_parameters is collective, so every rank refuses alike.)
  if (gathers_->held())
    throw std::logic_error("load('" + source + "'): every unit is held gathered (hold_parameters(true)), and the "
                           "held copies would keep the parameters from before the load; call hold_parameters(false) "
                           "on every rank first");
}

TRAINKIT_INLINE void ShardedUnits::held_tensors(std::vector<torch::Tensor>& out) const {
  ShardedSlices::held_tensors(out);
  out.push_back(unit_slices_);
  gathers_->held_tensors(out);
}

TRAINKIT_INLINE void ShardedUnits::after_update() {
  refresh_slices();
  storage_.publish_units();
  gathers_->refresh();  // (the root unit; the others where they are used)
}

TRAINKIT_INLINE void ShardedUnits::refresh_slices() {
  if (slices_copy_) unit_slices_.copy_(storage_.params_);
}

TRAINKIT_INLINE GradientBuckets ShardedUnits::unit_gradients() const {
  GradientBuckets buckets;
  buckets.input = [gathers = gathers_.get()](std::int64_t b) { return gathers->gradient(b); };
  buckets.done = [gathers = gathers_.get()](std::int64_t b) { gathers->gradient_done(b); };
  return buckets;
}

}  // namespace trainkit::detail
