#pragma once
/// The modes ShardedUpdate and ShardedGradients (mode.hpp): every rank holds the model, and
/// updates its own slices (sharded_slices.hpp).
///   ShardedUpdate      (ZeRO stage 1, Sharding::optimizer) the window's gradient is kept whole on
///                      each rank, as replicated, and reduce-scattered into this rank's slices in
///                      phase 5; after the update every rank's slices are all-gathered into the
///                      model (the storage's publish_update). The optimizer's state, and with
///                      master weights the fp32 masters, exist for this rank's slices only.
///   ShardedGradients   (ZeRO stage 2, Sharding::gradients) the same, and only this rank's slices
///                      of the gradient are kept between backwards: each micro-batch's gradient
///                      is reduce-scattered into the slices' sum at its end and the model's
///                      gradient released until the next backward.
/// With the overlap (TrainerOptions::overlap_reduction) a reduction starts before its backward
/// and each bucket leaves as the hooks find it complete (readiness.hpp).
#include <trainkit/storage/sharded_slices.hpp>

namespace trainkit::detail {

class ShardedUpdate : public ShardedSlices {
 public:
  ShardedUpdate(StorageCore& storage, Replicas& replicas, Partition partition, bool overlap)
      : ShardedSlices(storage, replicas, std::move(partition)), overlap_(overlap) {}

  void attach(torch::nn::Module& model) override;
  void backward_done(const BackwardDone& done) override;
  GradientFactor reduce(Replicas& replicas, const WindowWeights& window) override;
  void zero() override;
  void save(torch::serialize::OutputArchive& archive, torch::nn::Module& module, const UpdateRule& rule) const override;
  void load(torch::serialize::InputArchive& archive, torch::nn::Module& module, UpdateRule& rule) override;
  void save_window(torch::serialize::OutputArchive& archive, bool snapshot) const override;
  void load_window(torch::serialize::InputArchive& archive, bool snapshot) override;
  const torch::Tensor& replicated_state() const override;

 protected:
  /// The hooks of the overlap, once the storage has laid its buffers out.
  void install() {
    if (overlap_) install_readiness();
  }
  GradientFactor reduce_now(const WindowWeights& window, bool closes) override;
  // With master weights only this rank's slices of the masters exist; without, the values are
  // the model's parameters, which every rank holds whole.
  bool values_local() const override;
  void after_update() override;

 private:
  bool overlap_;
};

class ShardedGradients final : public ShardedUpdate {
 public:
  using ShardedUpdate::ShardedUpdate;

  void attach(torch::nn::Module& model) override;
  void backward_done(const BackwardDone& done) override;
  GradientFactor reduce(Replicas& replicas, const WindowWeights& window) override;
  void zero() override;
  bool reduces_each_micro_batch() const override { return true; }
  void discard_micro_batch() override;
  void save_window(torch::serialize::OutputArchive& archive, bool snapshot) const override;
  void load_window(torch::serialize::InputArchive& archive, bool snapshot) override;

 protected:
  bool reduces_after(const BackwardDone&) const override { return true; }
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/sharded_update-inl.hpp>
#endif
