#pragma once
/// What the sharded modes share (mode.hpp: ShardedUpdate, ShardedGradients, ShardedUnits):
/// every bucket of the partition is cut in a slice per rank (detail::Partition), and this rank
/// holds the reduced gradient, the optimizer's state (and with master weights the fp32 masters)
/// for its slices alone:
///   reduce      the gradient reduce-scattered into this rank's slices, added to the slices'
///               sum of the window's earlier micro-batches where those were reduced already
///   norm        the squares of every rank's slices summed (one small all-reduce)
///   update      the rule applied slice by slice, then every rank's slices made whole where the
///               mode keeps them whole (the mode's after_update)
///   records     by parameter name, each rank's pieces (a checkpoint set: no collective) or
///               gathered to the main rank (one file); read back from any layout
///   window      a checkpoint inside a window, with the gradients sharded: the slices' sum by
///               name, which any world size resumes
#include <trainkit/storage/mode.hpp>

namespace trainkit::detail {

class ShardedSlices : public ShardingMode {
 public:
  torch::Tensor norm() override;
  void update(const UpdatePart& f) override;
  void gradient_parts(std::vector<torch::Tensor>& parts, std::vector<std::int64_t>& owners) const override;
  const torch::Tensor& local_gradients() const override { return local_grad_; }
  void held_tensors(std::vector<torch::Tensor>& out) const override { out.insert(out.end(), {local_grad_, scratch_}); }
  void write_local(torch::serialize::OutputArchive& archive, const std::string& prefix,
                   const torch::Tensor& local) const override;
  std::vector<ParameterSlice> slices_of(const PlacedParameter& e) const override;
  void check_attach_again(bool masters) const override;

 protected:
  ShardedSlices(StorageCore& storage, Replicas& replicas, Partition partition)
      : ShardingMode(storage, &replicas, std::move(partition)) {}

  /// Where a reduction's result goes: this rank's slices of the window's sum, or a scratch
  /// buffer added to them (allocated at its first use).
  torch::Tensor reduction_target() override;
  /// A backward's gradient reduced into this rank's slices of the window's sum: the reduction
  /// started before it (overlap), or reduce_now().
  GradientFactor reduce_into_sum(const WindowWeights& window, bool closes);
  /// The gradient reduced into reduction_target() now, nothing of it started.
  virtual GradientFactor reduce_now(const WindowWeights& window, bool closes) = 0;
  /// Whether the values the update writes are this rank's slices (local layout) rather than
  /// the whole flat buffer.
  virtual bool values_local() const = 0;
  virtual void before_update() {}
  /// After the update of this rank's slices.
  virtual void after_update() = 0;
  /// The window's reduced slices gone (they live from a reduction to the update).
  void end_window() {
    summed_ = false;
    local_grad_ = scratch_ = torch::Tensor();
  }
  /// A checkpoint inside a window: the reduced sum of its micro-batches so far, by parameter
  /// name (a collective), which any world size resumes; a snapshot holds this rank's slices.
  void save_reduced_window(torch::serialize::OutputArchive& archive, bool snapshot) const;
  /// What save_reduced_window() wrote; throws when the checkpoint holds a storage's own window
  /// records instead.
  void load_reduced_window(torch::serialize::InputArchive& archive, bool snapshot);

  torch::Tensor local_grad_;  // this rank's slices of the reduced gradient
  torch::Tensor scratch_;     // gradients reduced per micro-batch: one reduction's slices
  bool summed_ = false;       // local_grad_ holds this window's earlier micro-batches
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/sharded_slices-inl.hpp>
#endif
