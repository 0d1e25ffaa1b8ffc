#pragma once
/// The storage of FP32, BF16 and FP16 (storage.hpp states the contract): the model's parameters
/// are views into one flat fp32 buffer (the values the update writes) and their .grad into a
/// flat fp32 gradient that autograd accumulates into in place, across the window's
/// micro-batches. The optimizer phase reads the gradient as one tensor, or, sharded, this rank's
/// slices of its sum over the ranks (the mode, mode.hpp). Mixed precision comes from the
/// precision policy's autocast region, not from the parameters' dtype.
///
/// What it answers for each mode: replicated and stages 1-2 every rank holds the parameters
/// whole (stage 2 releases the gradient's memory between a micro-batch's reduction and the next
/// backward); stage 3 holds this rank's slices of them and fp32 units (sharded_units.hpp).
#include <trainkit/detail/inline.hpp>
#include <trainkit/storage/storage_base.hpp>

#include <string>
#include <vector>

namespace trainkit {

class FlatStorage : public detail::StorageBase {
 public:
  /// Whether a torch::optim::Optimizer may update the parameters (it sees the model's own).
  static constexpr bool accepts_torch_optimizer = true;
  static void validate(const TrainerOptions& options, const std::string& trainer);

  /// `dtype`: the precision's storage_dtype, fp32 (the model's parameters are the flat buffer).
  FlatStorage(torch::nn::Module& model, const TrainerOptions& options, torch::Device device,
              at::ScalarType dtype = at::kFloat);

  /// The flat gradient (every trainable parameter's .grad is a view into it). With the
  /// gradients sharded (stage 2) its memory exists only from a backward to the reduction after
  /// it; at stage 3 it is empty (one gradient per unit, as needed).
  const torch::Tensor& gradients() const { return grad_; }
  /// StorageBase::held_tensors, and the gradient.
  void held_tensors(std::vector<torch::Tensor>& out) const {
    StorageBase::held_tensors(out);
    out.push_back(grad_);
  }

 protected:
  void prepare_gradient() override;
  void accumulate() override {}  // (autograd accumulates into the flat gradient)
  torch::Tensor fp32_gradient() override { return grad_; }
  bool reduces_in_place() const override { return true; }
  bool holds_masters() const override { return false; }
  void zero_gradient(bool release) override;
  GradientFactor reduce_whole(Replicas& replicas, const detail::Partition& partition,
                              const WindowWeights& window) override;
  torch::Tensor norm_whole() override;
  void update_whole(const detail::UpdatePart& f) override;
  void whole_gradient_parts(std::vector<torch::Tensor>& parts, std::vector<std::int64_t>& owners) const override;
  void save_whole_window(torch::serialize::OutputArchive& archive) const override;
  void load_whole_window(torch::serialize::InputArchive& archive) override;
  void publish_update(const detail::ShardedUpdate& mode) override;
  const torch::Tensor& whole_model() const override { return params_; }

  using StorageBase::lay_out;
  void lay_out(detail::Replicated& mode, torch::nn::Module& model) override;
  void lay_out(detail::ShardedUpdate& mode, torch::nn::Module& model) override;
  void lay_out(detail::ShardedGradients& mode, torch::nn::Module& model) override;
  void lay_out(detail::ShardedUnits& mode, torch::nn::Module& model) override;
  // Replicated and stages 1-2 hold the parameters whole: their records are the module's, in its
  // order; a checkpoint set (stages 1-2) takes each rank's slices' pieces of them.
  using StorageBase::load_values;
  using StorageBase::save_values;
  void save_values(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                   const detail::Replicated& mode) const override;
  void save_values(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                   const detail::ShardedUpdate& mode) const override;
  void load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                   const detail::Replicated& mode) override;
  void load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                   const detail::ShardedUpdate& mode) override;

 private:
  // The parameters copied into a flat buffer of `numel` elements and their views re-pointed;
  // the gradient bound (zeros) unless `gradient` is false (made at its first use).
  void allocate(std::int64_t numel, bool gradient);
  // Replicated and stages 1-2: every rank holds the parameters whole, padded to the partition.
  void lay_out_whole(const detail::ShardingMode& mode, torch::nn::Module& model);
  // The flat gradient of `numel` elements (zeros), the parameters' .grad its views.
  void bind_flat_gradient(std::int64_t numel);

  torch::Tensor grad_;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/flat_storage-inl.hpp>
#endif
