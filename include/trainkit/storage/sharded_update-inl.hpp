#pragma once
/// The definitions of trainkit/storage/sharded_update.hpp (header-only: included by it;
/// compiled mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/records.hpp>
#include <trainkit/storage/sharded_update.hpp>
#include <trainkit/storage/storage_core.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE void ShardedUpdate::attach(torch::nn::Module& model) {
  storage_.lay_out(*this, model);
  install();
}

TRAINKIT_INLINE void ShardedUpdate::backward_done(const BackwardDone& done) {
  if (!done.closes) storage_.accumulate();
}

TRAINKIT_INLINE GradientFactor ShardedUpdate::reduce(Replicas&, const WindowWeights& window) {
  // (A window flushed at an epoch's end after a reduced micro-batch has no gradient left:
  // zeros stand for it, and the reduction still brings the window's item total.)
  storage_.prepare_gradient();
  if (!summed_)
    if (auto factor = storage_.reduce_scatter_in_half(*replicas_, partition_, window, local_grad_)) return *factor;
  return reduce_into_sum(window, /*closes=*/true);
}

TRAINKIT_INLINE GradientFactor ShardedUpdate::reduce_now(const WindowWeights& window, bool closes) {
  auto gradient = storage_.fp32_gradient();  // (with master weights a transient fp32 cast)
  return replicas_->reduce_buckets(gradient, reduction_target(), partition_, window, closes);
}

TRAINKIT_INLINE void ShardedUpdate::zero() {
  drop_reduction();  // (after a failed forward or backward too)
  storage_.zero_gradient(/*release=*/false);
  end_window();
}

TRAINKIT_INLINE void ShardedUpdate::save(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                         const UpdateRule& rule) const {
  storage_.save_values(archive, module, *this);
  save_state(archive, rule);
}

TRAINKIT_INLINE void ShardedUpdate::load(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                         UpdateRule& rule) {
  storage_.load_values(archive, module, *this);
  load_state(archive, rule);
}

TRAINKIT_INLINE void ShardedUpdate::save_window(torch::serialize::OutputArchive& archive, bool) const {
  storage_.save_whole_window(archive);
}

TRAINKIT_INLINE void ShardedUpdate::load_window(torch::serialize::InputArchive& archive, bool) {
  check_window_kind(archive, storage_.placement().parameters(), /*reduced=*/false);
  storage_.load_whole_window(archive);
}

TRAINKIT_INLINE const torch::Tensor& ShardedUpdate::replicated_state() const { return storage_.whole_model(); }

TRAINKIT_INLINE bool ShardedUpdate::values_local() const { return storage_.holds_masters(); }

TRAINKIT_INLINE void ShardedUpdate::after_update() { storage_.publish_update(*this); }

TRAINKIT_INLINE void ShardedGradients::attach(torch::nn::Module& model) {
  storage_.lay_out(*this, model);
  install();
}

// A backward the phase does not follow: reduce-scattered into the slices' sum at its
// micro-batch's end (a piece's gradient joins the next piece's first), and the model's gradient
// released until the next backward.
TRAINKIT_INLINE void ShardedGradients::backward_done(const BackwardDone& done) {
  if (done.closes || !done.micro_batch_ends) return;
  reduce_into_sum(done.window, /*closes=*/false);
  storage_.zero_gradient(/*release=*/true);
}

TRAINKIT_INLINE GradientFactor ShardedGradients::reduce(Replicas& replicas, const WindowWeights& window) {
  const GradientFactor factor = ShardedUpdate::reduce(replicas, window);
  storage_.zero_gradient(/*release=*/true);
  return factor;
}

TRAINKIT_INLINE void ShardedGradients::zero() {
  drop_reduction();  // (after a failed forward or backward too)
  storage_.zero_gradient(/*release=*/true);
  end_window();
}

TRAINKIT_INLINE void ShardedGradients::discard_micro_batch() {
  drop_reduction();
  storage_.zero_gradient(/*release=*/true);
}

TRAINKIT_INLINE void ShardedGradients::save_window(torch::serialize::OutputArchive& archive, bool snapshot) const {
  save_reduced_window(archive, snapshot);
}

TRAINKIT_INLINE void ShardedGradients::load_window(torch::serialize::InputArchive& archive, bool snapshot) {
  load_reduced_window(archive, snapshot);
}

}  // namespace trainkit::detail
