#pragma once
/// What every storage holds, and what a sharding mode (mode.hpp) asks of it. The placed
/// parameters (placement.hpp), the flat fp32 buffer the update writes (the values: the model's
/// parameters, or with master weights the fp32 masters; this rank's slices where a mode shards
/// them), the view check, and, answered by each storage for its precision (FlatStorage,
/// MasterStorage): how the model's gradient is held and made fp32, the optimizer phase on
/// whole buffers, how the buffers are laid out for each mode, the values' records. The modes
/// are written once against it; StorageBase (storage_base.hpp) adds the mode and the calls of
/// the trainer.
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/partition.hpp>
#include <trainkit/step/optim.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/step/replicas.hpp>
#include <trainkit/storage/mode.hpp>
#include <trainkit/storage/placement.hpp>
#include <trainkit/storage/view_check.hpp>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace trainkit::detail {

class Replicated;
class ShardedUpdate;
class ShardedGradients;
class ShardedUnits;

class StorageCore {
 public:
  virtual ~StorageCore() = default;
  StorageCore(const StorageCore&) = delete;
  StorageCore& operator=(const StorageCore&) = delete;

  const Placement& placement() const { return placement_; }

 protected:
  /// The trainable parameters of `model` placed for elements of `element_size` bytes.
  StorageCore(torch::nn::Module& model, const TrainerOptions& options, torch::Device device, std::int64_t element_size,
              bool any_floating_point);

  /// The parameters' old blocks back to the device before the gradients are allocated (CUDA's
  /// caching allocator would keep them, and a model's worth of small blocks cannot serve one
  /// flat gradient): the construction peak stays at twice the model, not three times.
  static void release_cached(torch::Device device);

  friend class ShardingMode;
  friend class Replicated;
  friend class ShardedSlices;
  friend class ShardedUpdate;
  friend class ShardedGradients;
  friend class ShardedUnits;

  /// Before a backward: the model's gradient memory there (allocated where released, or made
  /// at its first use).
  virtual void prepare_gradient() = 0;
  /// After a backward the window's phase does not follow, its gradient kept on this rank
  /// (replicated, stage 1): joins the window's sum.
  virtual void accumulate() = 0;
  /// The micro-batch's or window's fp32 gradient in the flat layout, to reduce: the model's
  /// gradient itself (FlatStorage, reduced in place as the backward produces it), or its fp32
  /// cast (MasterStorage).
  virtual torch::Tensor fp32_gradient() = 0;
  /// Whether fp32_gradient() is the buffer autograd accumulates into (the overlap then reduces
  /// its buckets during the backward).
  virtual bool reduces_in_place() const = 0;
  /// Whether the values are fp32 masters beside a half model (MasterStorage).
  virtual bool holds_masters() const = 0;
  /// The model's gradient zeroed, or released until prepare_gradient() (`release`); the
  /// optimizer phase's own buffers dropped.
  virtual void zero_gradient(bool release) = 0;
  /// Replicated: the optimizer phase on whole buffers (phases 5, 6-7, 9).
  virtual GradientFactor reduce_whole(Replicas& replicas, const Partition& partition, const WindowWeights& window) = 0;
  virtual torch::Tensor norm_whole() = 0;
  virtual void update_whole(const UpdatePart& f) = 0;
  virtual void whole_gradient_parts(std::vector<torch::Tensor>& parts, std::vector<std::int64_t>& owners) const = 0;
  /// Replicated and stage 1: the open window's gradient records as this rank holds them.
  virtual void save_whole_window(torch::serialize::OutputArchive& archive) const = 0;
  virtual void load_whole_window(torch::serialize::InputArchive& archive) = 0;
  /// Sharded, a window of one micro-batch: its gradient reduce-scattered in half precision
  /// into `local` (fp32) where the precision asks for it; nothing otherwise.
  virtual std::optional<GradientFactor> reduce_scatter_in_half(Replicas&, const Partition&, const WindowWeights&,
                                                               torch::Tensor&) {
    return std::nullopt;
  }
  /// Stages 1-2, after the update of this rank's slices: every rank's updated slices into the
  /// model the ranks hold whole.
  virtual void publish_update(const ShardedUpdate& mode) = 0;
  /// Stages 1-2: the model every rank holds whole (what must be alike after a load).
  virtual const torch::Tensor& whole_model() const = 0;
  /// Stage 3, after the update (before the units' root is gathered again): what the precision
  /// keeps beside the units.
  virtual void publish_units() {}
  /// The precision's own buffers in a snapshot (no collective).
  virtual void snapshot_precision(torch::serialize::OutputArchive&) const {}
  virtual void restore_precision(torch::serialize::InputArchive&) {}

  /// The buffers laid out for a mode, when it is attached (the replicas' attach, their
  /// broadcast of rank 0's values, included). ShardedGradients is ShardedUpdate's unless a
  /// storage says otherwise.
  virtual void lay_out(Replicated& mode, torch::nn::Module& model) = 0;
  virtual void lay_out(ShardedUpdate& mode, torch::nn::Module& model) = 0;
  virtual void lay_out(ShardedGradients& mode, torch::nn::Module& model);
  virtual void lay_out(ShardedUnits& mode, torch::nn::Module& model) = 0;
  /// The values' records (model.param.<name>) in each mode. By default: `mode`'s local buffer
  /// of them by name, and the frozen parameters as they are.
  virtual void save_values(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                           const Replicated& mode) const;
  virtual void save_values(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                           const ShardedUpdate& mode) const;
  virtual void load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module, const Replicated& mode);
  virtual void load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                           const ShardedUpdate& mode);
  virtual void load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                           const ShardedUnits& mode);
  void save_local_values(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                         const ShardingMode& mode) const;
  void load_local_values(torch::serialize::InputArchive& archive, torch::nn::Module& module, const ShardingMode& mode);

  TrainerOptions options_;
  torch::Device device_;
  std::int64_t element_size_;  // of the narrowest dtype viewing the buffers (the buckets' bytes)
  // TrainerOptions::sharding asks for sharded units (ZeRO stage 3), read once at construction:
  // the placement lays the units out, and the gradient is made at its first use (attached over
  // several ranks the mode holds one per unit; in one process the mode is Replicated).
  bool units_configured_;
  Placement placement_;
  torch::Tensor params_;  // the flat fp32 buffer the update writes (StorageBase::parameters())
  ViewCheck views_;
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/storage_core-inl.hpp>
#endif
