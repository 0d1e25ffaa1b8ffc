#pragma once
/// The definitions of trainkit/storage/mode.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/mode.hpp>
#include <trainkit/storage/records.hpp>
#include <trainkit/storage/storage_core.hpp>

#include <stdexcept>

namespace trainkit::detail {

TRAINKIT_INLINE void ShardingMode::backward_begins(const BackwardDone& done) {
  storage_.prepare_gradient();
  if (readiness_ && done.micro_batch_ends && reduces_after(done)) {
    auto gradient = storage_.fp32_gradient();  // (the buffer autograd accumulates into)
    reduction_ = replicas_->start_reduction(gradient, reduction_target(), partition_, done.window, done.closes);
    readiness_->arm(*reduction_);
  }
}

TRAINKIT_INLINE void ShardingMode::discard_micro_batch() {
  throw std::logic_error("discard_micro_batch: this storage reduces its gradient once per window");
}

TRAINKIT_INLINE void ShardingMode::allocate_gradient() { storage_.prepare_gradient(); }

TRAINKIT_INLINE const torch::Tensor& ShardingMode::local_gradients() const {
  static const torch::Tensor none;
  return none;
}

TRAINKIT_INLINE void ShardingMode::read_local(torch::serialize::InputArchive& archive, const std::string& prefix,
                                              const torch::Tensor& local) const {
  const auto& placed = storage_.placement().parameters();
  check_records(archive, placed, prefix);
  torch::NoGradGuard no_grad;
  if (const auto* set = ShardReads::of(archive)) {
    // Only this rank's pieces, read from the set's files.
    for (const auto& e : placed)
      for (const auto& p : slices_of(e)) set->read_range(prefix + e.name, p.from, p.length, local.narrow(0, p.at, p.length));
    return;
  }
  for (const auto& e : placed) {
    const auto saved = read_tensor(archive, prefix + e.name).reshape({-1});
    for (const auto& p : slices_of(e)) local.narrow(0, p.at, p.length).copy_(saved.narrow(0, p.from, p.length));
  }
}

TRAINKIT_INLINE void ShardingMode::install_readiness() {
  std::vector<Range> ranges;
  std::vector<std::int64_t> order;
  std::vector<std::string> names;
  for (const auto& e : storage_.placement().parameters()) {
    ranges.push_back({e.offset, e.param.numel()});
    order.push_back(e.order);
    names.push_back(e.name);
  }
  readiness_ = std::make_shared<Readiness>(ranges, order, std::move(names), partition_);
  install_hooks(readiness_);
}

TRAINKIT_INLINE void ShardingMode::install_hooks(const std::shared_ptr<GradientListener>& listener) {
  const auto& placed = storage_.placement().parameters();
  for (size_t i = 0; i < placed.size(); ++i)
    torch::autograd::impl::set_post_acc_grad_hooks(placed[i].param, std::make_unique<ReadyHook>(listener, i));
}

TRAINKIT_INLINE GradientFactor ShardingMode::finish_started() {
  if (readiness_) {
    readiness_->launch_rest();  // (parameters that got no gradient), in the launch order
    readiness_->disarm();
  }
  disarmed();  // (stage 3: finish() launches the units the backward did not, last first)
  const GradientFactor factor = reduction_->finish();
  reduction_.reset();
  return factor;
}

TRAINKIT_INLINE void ShardingMode::drop_reduction() {
  if (!reduction_) return;
  const auto sent = launched();
  if (readiness_) readiness_->disarm();
  disarmed();
  if (sent == 0) {
    reduction_.reset();  // nothing sent
    return;
  }
  throw std::runtime_error(
      "trainkit: the window was dropped (an out-of-memory error in its backward?) after " + std::to_string(sent) +
      " bucket(s) of its gradient reduction had started on this rank, overlapped with the backward: the other ranks "
      "cannot replay it with this one, so training stops here. Resume from the last checkpoint with a smaller "
      "micro-batch or TRAIN.MEMORY_BUDGET, or set TRAIN.OVERLAP_REDUCTION: false "
      "(TrainerOptions::overlap_reduction) to reduce after the backward, where such a window can be replayed");
}

TRAINKIT_INLINE void ShardingMode::save_state(torch::serialize::OutputArchive& archive, const UpdateRule& rule) const {
  for (const auto* s : rule.flat_states()) write_local(archive, "optim." + s->kind() + ".", s->flat());
}

TRAINKIT_INLINE void ShardingMode::load_state(torch::serialize::InputArchive& archive, UpdateRule& rule) const {
  for (auto* s : rule.flat_states()) read_state(archive, "optim." + s->kind() + ".", s->flat());
}

}  // namespace trainkit::detail
