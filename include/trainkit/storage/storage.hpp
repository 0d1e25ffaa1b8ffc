#pragma once
/// Parameter storage: where a trainer's parameters, gradients, fp32 masters and optimizer
/// state live. The precision policy chooses it (`Precision::storage`, built with
/// `Precision::storage_dtype`): FlatStorage for FP32, BF16 and FP16, MasterStorage
/// (master_storage.hpp) for PrecisionPolicy<MasterWeights<T>>. Everything that depends on
/// where a parameter's gradient, master copy and update live is a storage's; the trainer's
/// step calls the same members whatever the storage is.
///
/// Contract — what the trainer calls, and when (every rank makes the same calls in the same order):
///   Storage(model, options, device, dtype)
///                                     at construction: the trainable parameters become views
///                                     into one flat buffer (parameters()), 64-byte aligned and
///                                     grouped by LR multiplier and weight decay (groups());
///                                     their .grad become views of the storage's gradient
///   attach(replicas, model) -> bool   Trainer::set_replicas: every rank takes rank 0's values,
///                                     and the storage cuts its buffers for the replicas
///                                     (detail::Partition). True when the update is sharded:
///                                     the optimizer's state then covers state_numel() local
///                                     elements
///   backward_begins(done)             before each backward (micro-step phase 3), told what
///                                     backward_done() will be: a reduction may start during it
///   backward_done(done)               after each backward (detail::BackwardDone: whether the
///                                     optimizer phase follows, whether the micro-batch ends,
///                                     the window's weights so far)
///   reduce(replicas, window)          optimizer phase 5: the gradient summed over the ranks;
///                                     returns the factor that makes it the window's mean
///   norm()                            phases 6-7: the global L2 norm of the still-scaled
///                                     gradient (a device scalar, no host sync)
///   update(f)                         phase 9: f(groups, gradient) once per chunk of the part
///                                     of the flat buffer this rank updates; after it, the
///                                     model's parameters hold the update on every rank
///   zero()                            phase 11 (and a dropped window)
///   check()                           once per window: the model's parameters and their .grad
///                                     are still the storage's views
///   save(archive, rule) / load(archive, rule)
///                                     the parameters (fp32 masters where they exist) and the
///                                     rule's flat state, one record per parameter name and
///                                     kind; sharded, save() gathers every rank's slices to the
///                                     main rank (a collective: every rank calls it)
///   snapshot(archive, rule) / restore(archive, rule)
///                                     this rank's own buffers as they are, no collective (the
///                                     rollback of a failed load)
///   save_window / load_window         the open window's gradient, for a checkpoint inside one
/// Guarantees: the gaps between parameters and the partition's padding are zeros in every flat
/// buffer (they change no norm and no update); the gradient exists in fp32 (whole, in chunks or
/// as this rank's slices) inside the phase.
///
/// Sharding (TrainerOptions::sharding, with more than one rank: ZeRO's stages 1 and 2). The
/// flat buffers are cut into buckets and every rank owns one slice of each (partition.hpp):
/// reduce() reduce-scatters the gradient into this rank's slices, norm() sums the slices'
/// squared norms with one small all-reduce, update() updates only this rank's slices (its
/// optimizer state and fp32 masters exist for those alone) and all-gathers the parameters.
/// Sharding::gradients also keeps only this rank's slices of the gradient between windows:
/// the model's gradient is released after each reduction and allocated again before the next
/// backward, and a window of several micro-batches reduce-scatters each of them into the
/// slices' sum. Replicated (Sharding::none, or one process) every rank holds everything.
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/checkpoint_io.hpp>
#include <trainkit/detail/flat_layout.hpp>
#include <trainkit/detail/partition.hpp>
#include <trainkit/detail/released_storage.hpp>
#include <trainkit/step/optim.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/step/precision.hpp>
#include <trainkit/step/replicas.hpp>
#include <trainkit/storage/held_bytes.hpp>
#include <trainkit/storage/sharded_units.hpp>

#include <c10/core/CachingDeviceAllocator.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

namespace detail {

/// A trainable parameter and where the storage puts it.
struct PlacedParameter {
  std::string name;
  torch::Tensor param;
  double lr_mult = 1.0;
  bool decay = true;
  std::int64_t offset = 0;  ///< in the flat buffers
  std::int64_t order = 0;   ///< its place among the model's trainable parameters
  std::int64_t unit = 0;    ///< Sharding::parameters: its unit (0: the root unit, what no unit holds)
};

/// Overlap (TrainerOptions::overlap_reduction): during an armed backward, which buckets of the
/// partition are complete. Each parameter's post-accumulate-grad hook (ReadyHook) counts its
/// gradient in the buckets it lies in. The buckets are launched in one order fixed when the
/// hooks are installed, the same on every rank: by when a backward is expected to complete
/// them, a backward producing the model's parameters' gradients in reverse order (the bucket
/// whose earliest parameter comes last in the model first). Each is launched as soon as it and
/// every bucket before it in that order are complete. The layout groups parameters by weight
/// decay and LR multiplier, so a bucket may hold parameters of every layer (BERT's biases and
/// norms, TRAIN.NO_DECAY): it comes last, and does not hold the others back. What is left when
/// the backward ends (parameters that got no gradient) is launched by launch_rest(), in that
/// order: every rank's launches are that one sequence.
class Readiness {
 public:
  /// `parameters`: each parameter's elements in the flat layout; `order`: each one's place
  /// among the model's parameters (its gradient is expected after those of later places).
  Readiness(const std::vector<Range>& parameters, const std::vector<std::int64_t>& order, std::vector<std::string> names,
            const Partition& partition);
  void arm(Reduction& reduction);
  void disarm() { reduction_ = nullptr; }
  /// Launches the buckets the armed backward did not complete, in the launch order.
  void launch_rest();
  /// Buckets launched in the armed backward.
  std::int64_t launched() const { return next_; }
  /// The order in which the buckets are launched.
  const std::vector<std::int64_t>& launch_order() const { return order_; }
  /// Buckets launched by the hooks while parameters' gradients were still to come in their
  /// backward (overlapping it), since the hooks were installed.
  std::int64_t overlapped() const { return overlapped_; }
  /// Over every bucket launched since the hooks were installed: the mean share of its
  /// backward's gradient elements still to come when it was launched (0 for those launched at
  /// the backward's end): how much of the backward a bucket's reduction could hide behind.
  double backward_left() const { return launches_ > 0 ? left_sum_ / static_cast<double>(launches_) : 0.0; }

  /// Parameter i's gradient is accumulated (its hook; the autograd engine's thread).
  void ready(size_t i);

 private:
  std::vector<std::string> names_;
  std::vector<std::pair<std::int64_t, std::int64_t>> spans_;  // each parameter's first and last bucket
  std::vector<std::int64_t> initial_, waiting_;
  std::vector<std::int64_t> order_;  // the buckets in launch order
  std::vector<bool> fired_;
  std::int64_t next_ = 0, overlapped_ = 0;  // next_: the place in order_ of the next launch
  std::vector<std::int64_t> elements_;       // each parameter's elements
  std::int64_t total_elements_ = 0, pending_elements_ = 0;  // pending: still to come in this backward
  std::int64_t launches_ = 0;
  double left_sum_ = 0;  // backward_left()'s sum
  Reduction* reduction_ = nullptr;
};

/// The hook a parameter calls after its gradient is accumulated; it outlives nothing: the
/// storage's Readiness gone, it does nothing.
/// ZeRO stage 3 also counts the gradient in its unit (ShardedUnits::ready), overlapping or not.
class ReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  ReadyHook(std::weak_ptr<Readiness> readiness, std::weak_ptr<ShardedUnits> units, size_t index)
      : readiness_(std::move(readiness)), units_(std::move(units)), index_(index) {}
  TRAINKIT_INLINE void operator()(const torch::autograd::Variable&) override;

 private:
  std::weak_ptr<Readiness> readiness_;
  std::weak_ptr<ShardedUnits> units_;
  size_t index_;
};

/// What the trainer tells its storage after each backward.
struct BackwardDone {
  bool closes = false;           ///< the optimizer phase follows before the next backward
  /// False for a micro-batch's pieces but the last (micro_step_pieces), whose gradients join the
  /// next piece's before any reduction (ZeRO stage 3 reduces every backward's regardless).
  bool micro_batch_ends = true;
  WindowWeights window;          ///< the window's weights so far
};

/// The machinery both storages share: placing the parameters, the groups, the partition, the
/// view check and the records by parameter name.
class FlatParameters {
 public:
  /// The flat fp32 buffer the update writes: the model's parameters, or with master weights
  /// the masters (sharded master weights: this rank's slices only).
  const torch::Tensor& parameters() const { return params_; }
  const FlatLayout& layout() const { return layout_; }
  const std::vector<ParamGroup>& groups() const { return groups_; }
  std::int64_t parameter_count() const { return layout_.packed(); }
  /// The model as predict_held (held_bytes.hpp) sees it: the trainable parameters, by unit when
  /// units are named (TrainerOptions::units), and `model`'s others (frozen).
  ModelSize model_size(torch::nn::Module& model) const;
  /// How the buffers are cut for the replicas (one bucket, replicated, in one process).
  const Partition& partition() const { return partition_; }
  /// Elements of the optimizer's flat state: the flat buffer, or this rank's slices.
  std::int64_t state_numel() const { return partition_.local_total(); }
  bool sharded() const { return partition_.sharded(); }
  /// Sharded: this rank's slices of the reduced gradient (the window's sum over the ranks, in
  /// the phase; with Sharding::gradients also the sum of the window's earlier micro-batches).
  const torch::Tensor& local_gradients() const { return local_grad_; }
  /// Gradient buckets whose reduction started during a backward, before its last gradient
  /// (TrainerOptions::overlap_reduction), since the replicas were attached.
  std::int64_t overlapped_buckets() const {
    return readiness_ ? readiness_->overlapped() : units_ ? units_->overlapped() : 0;
  }
  /// The mean share of a backward's gradient still to come when its buckets were launched
  /// (Readiness::backward_left).
  double backward_left_at_launch() const { return readiness_ ? readiness_->backward_left() : 0.0; }

  /// Appends the flat buffers of this base (the update's parameters, the reduced slices and
  /// stage 3's units) to `out`, for Trainer::held_bytes; the storages add theirs.
  void held_tensors(std::vector<torch::Tensor>& out) const {
    out.insert(out.end(), {params_, local_grad_, scratch_, unit_slices_});
    if (units_) units_->held_tensors(out);
  }

  /// Once per window, a pointer compare per parameter.
  void check() const;
  /// Sharding::parameters over several ranks: the units' schedule (null otherwise), which the
  /// trainer's forward makes active (trainer/unit.hpp).
  const std::shared_ptr<ShardedUnits>& sharded_units() const { return units_; }
  /// After a load that every rank completed (Trainer::load, once they agreed): stage 3 gathers
  /// its root unit from the slices just read (a collective); otherwise nothing.
  void after_load() {
    if (units_) units_->refresh();
  }

 protected:
  FlatParameters() = default;
  /// Stage 3: the schedule leaves the process's registry, and a graph that outlives the storage
  /// finds it closed (a gather still in flight waited for first).
  TRAINKIT_INLINE ~FlatParameters();
  FlatParameters(const FlatParameters&) = delete;
  FlatParameters& operator=(const FlatParameters&) = delete;

  // --- ZeRO stage 3 (Sharding::parameters over several ranks), for both storages ------------
  /// Throws when no unit is named (every parameter would be the root unit's, kept whole).
  void require_units() const;
  /// At attach, after replicas.attach(): the layout laid out again in units (each one bucket
  /// of the partition), each unit's parameters made views of its own buffer of `unit_dtype`
  /// (the root unit's gathered, the others released), this rank's slices of the fp32 values
  /// kept in params_ and, in `unit_dtype`, in unit_slices_ (the gathers' input; params_ itself
  /// when fp32), and the schedule (units_) made and registered. `values(i)`: placed parameter
  /// i's fp32 values, flat (read before any parameter moves); `skip[i]` (empty: none): the
  /// parameter stays where it is (master weights' fp32-kept norms), its gradient still its
  /// unit's. One unit's fp32 buffer exists at a time beside the caller's.
  void shard_into_units(at::ScalarType unit_dtype, const std::function<torch::Tensor(size_t)>& values,
                        const std::vector<bool>& skip, std::int64_t prefetch, bool reshard, torch::Device device);
  /// Before a stage-3 backward: its units' reduce-scatters started as the backward leaves them
  /// (overlap_), or after it.
  void begin_unit_backward(const BackwardDone& done);
  /// After a stage-3 backward: the units still gathered released; a micro-batch's end that the
  /// optimizer phase does not follow reduces its units into the slices' sum now.
  void end_unit_backward(const BackwardDone& done);
  /// What a backward left: the reduction it started dropped (drop_reduction) and, at stage 3,
  /// every unit released and every unit's gradient dropped (a failed micro-batch, a dropped
  /// window, zero()).
  void drop_backward();
  /// Stage 3: the root unit's gathered buffer (every rank holds it alike), or an empty tensor.
  const torch::Tensor& root_unit() const;

  // --- the reduction ------------------------------------------------------------------------
  /// Where a reduction's result goes: nowhere but the gradient itself (replicated: summed in
  /// place), or this rank's slices (the window's sum, or with the gradients sharded a scratch
  /// buffer added to the sum of the window's earlier micro-batches).
  torch::Tensor reduction_target();
  /// The reduction of the gradient: the one started before the backward (overlap), the
  /// units' (stage 3), or `flat`'s (the whole flat gradient) now; sharded, added to the slices'
  /// sum of the window's earlier micro-batches.
  GradientFactor finish_reduction(Replicas& replicas, const WindowWeights& window, bool closes,
                                  torch::Tensor* flat = nullptr);
  /// A window dropped (replayed after an out-of-memory error) while its reduction had started.
  /// Buckets already sent cannot be taken back from the other ranks: the ranks would disagree.
  void drop_reduction();
  /// Stage 3: each unit's gradient buffer for a reduction (ShardedUnits::gradient), released
  /// as its collective completes.
  GradientBuckets unit_gradients() const;
  /// The overflow diagnosis's view (trainer/nonfinite_watch.hpp) of `gradient`, a buffer in
  /// this rank's local layout: each parameter's parts of it, and each part's parameter (its
  /// place among the model's trainable parameters).
  void pieces_of(const torch::Tensor& gradient, std::vector<torch::Tensor>& pieces, std::vector<std::int64_t>& owners) const {
    if (!gradient.defined()) return;
    for (const auto& e : placed_)
      for_each_piece(e, [&](std::int64_t at, std::int64_t, std::int64_t n) {
        pieces.push_back(gradient.narrow(0, at, n));
        owners.push_back(e.order);
      });
  }

  /// The trainable parameters of `model` on `device`, grouped by (LR multiplier, decay) in
  /// order of first appearance (the model's order inside each group), placed in layout_ with
  /// each parameter 64-byte aligned for elements of `element_size` bytes (into placed_).
  void place(torch::nn::Module& model, const TrainerOptions& options, torch::Device device, std::int64_t element_size,
             bool any_floating_point);

  /// The partition for `replicas`: one bucket in one process; buckets of the replicas'
  /// bucket_bytes with several, sharded with `sharding`.
  Partition partition_for(const Replicas& replicas, Sharding sharding, std::int64_t element_size) const;

  /// A post-accumulate-grad hook on every trainable parameter (after the partition): for the
  /// overlap (`overlap`: the buckets' Readiness) and for ZeRO stage 3's units (units_).
  void install_hooks(bool overlap);

  /// Sharding::parameters: the units of `model` that `paths` names (TrainerOptions::units)
  /// into unit_paths_, and each placed parameter's unit; a path that names no module, one unit
  /// inside another, or a path given twice throws.
  void resolve_units(torch::nn::Module& model, const std::vector<std::string>& paths);
  /// The parameters' offsets in unit order, each unit starting at a multiple of `multiple`
  /// elements (into layout_ and each placed parameter's offset).
  void place_offsets(std::int64_t multiple);
  /// Sharding::parameters: each unit's range of the flat layout (a bucket each), in unit order;
  /// `multiple`: place_offsets()'s.
  std::vector<Range> unit_ranges(std::int64_t multiple) const;

  /// `numel` elements of fp32 on `device`, the layout's gaps zero (before the parameters are
  /// copied in).
  torch::Tensor allocate_flat(std::int64_t numel, torch::Device device) const;

  /// The view of `e` in `flat`, the parameter's current values copied in.
  static torch::Tensor copy_in(const PlacedParameter& e, const torch::Tensor& flat);

  /// The parameters' old blocks back to the device before the gradients are allocated (CUDA's
  /// caching allocator would keep them, and a model's worth of small blocks cannot serve one
  /// flat gradient): the construction peak stays at twice the model, not three times.
  static void release_cached(torch::Device device);

  /// One group per run of parameters with the same (LR multiplier, decay): slices of params_
  /// and of `grads` (undefined: bound in each optimizer phase); the state at the group's offset.
  /// `bind_params` false: the groups' params undefined too (their place in the layout alone).
  void make_groups(const torch::Tensor& grads, bool bind_params = true);

  /// Records the views check() compares against (after each parameter's data and .grad are set).
  void record_view(const PlacedParameter& e);

  /// The groups' gradients as slices of `grads` (the whole flat gradient), or none.
  void bind_gradients(const torch::Tensor& grads);

  /// The groups restricted to the flat elements `range`: their parameters in `params` and
  /// their gradients in `grads` (both `range`'s elements, in any buffer), their state from
  /// `state_begin` on; a group outside the range has undefined params. The chunks of the
  /// master-weights phase and a rank's slices are updated through these.
  std::vector<ParamGroup> chunk_groups(Range range, const torch::Tensor& params, const torch::Tensor& grads,
                                       std::int64_t state_begin) const;
  /// chunk_groups over this rank's slice of bucket b: parameters from `params` (global layout,
  /// or local when `params_local`), gradients and state in the local layout.
  std::vector<ParamGroup> slice_groups(std::int64_t b, const torch::Tensor& params, bool params_local,
                                       const torch::Tensor& local_grads) const;

  // --- records by parameter name ----------------------------------------------------------
  /// `global` (a buffer in the flat layout, on any device) as one record per parameter:
  /// `prefix` + name, with the parameter's shape. Views of one storage: written once.
  void write_by_name(torch::serialize::OutputArchive& archive, const std::string& prefix,
                     const torch::Tensor& global) const;
  /// `local` (this rank's layout: the flat buffer, or its slices when sharded) as one record
  /// per parameter: write_by_name of the buffer gathered to the main rank (a collective when
  /// sharded), or inside a ShardedWrites scope this rank's pieces alone (no collective).
  void write_local_by_name(torch::serialize::OutputArchive& archive, const std::string& prefix,
                           const torch::Tensor& local) const;
  /// The records `prefix` + name into `local` (this rank's layout: the flat layout, or its
  /// slices when sharded; from a set, only the byte ranges of those slices are read). Throws
  /// naming the first record that is missing or misshapen, before anything is copied.
  void read_by_name(torch::serialize::InputArchive& archive, const std::string& prefix,
                    const torch::Tensor& local) const;
  /// The parts of parameter `e` this rank holds in its local layout: f(local offset, offset in
  /// the parameter, elements); the whole parameter at its flat offset when replicated.
  template <class F>
  void for_each_piece(const PlacedParameter& e, F&& f) const {
    const Range p{e.offset, e.param.numel()};
    if (!partition_.sharded()) {
      f(p.begin, 0, p.length);
      return;
    }
    for (std::int64_t b = 0; b < partition_.buckets(); ++b) {
      const Range s = partition_.slice(b);
      const auto lo = std::max(s.begin, p.begin), hi = std::min(s.end(), p.end());
      if (lo < hi) f(partition_.local(b) + (lo - s.begin), lo - p.begin, hi - lo);
    }
  }
  /// A local buffer in the flat layout on the main rank (gathered from every rank's slices when
  /// sharded, on the host); undefined on the other ranks of a sharded run. A collective when
  /// sharded.
  torch::Tensor global_of(const torch::Tensor& local) const;

  /// The rule's flat state by parameter name: optim.<kind>.<name> (checkpoints of version 0.1
  /// hold it per group, optim.<kind>.<g>, packed: read too).
  void save_state(torch::serialize::OutputArchive& archive, const UpdateRule& rule) const;
  void load_state(torch::serialize::InputArchive& archive, UpdateRule& rule) const;

  /// Sharding::gradients, a checkpoint inside a window: the reduced sum of its micro-batches so
  /// far, gathered by parameter name (a collective), which any world size resumes; a snapshot
  /// holds this rank's slices as they are.
  void save_reduced_window(torch::serialize::OutputArchive& archive, bool snapshot) const;
  /// The reduced sum save_reduced_window() wrote, when this run shards its gradients
  /// (`shards_gradients`): true when read; false when the checkpoint holds the storage's own
  /// window records. Throws when the checkpoint's kind and this run's differ.
  bool load_reduced_window(torch::serialize::InputArchive& archive, bool snapshot, bool shards_gradients);

  FlatLayout layout_;
  std::int64_t align_ = 16;
  std::vector<PlacedParameter> placed_;
  torch::Tensor params_;  // the flat fp32 buffer the update writes (see parameters())
  std::vector<ParamGroup> groups_;
  std::vector<Range> ranges_;  // each group's elements in the flat layout
  Partition partition_;
  Replicas* replicas_ = nullptr;  // the trainer's, from attach()
  std::shared_ptr<Readiness> readiness_;  // overlap: defined when the hooks are installed
  // Sharding::parameters: the units named (unit_paths_[0] is the root, ""), and their
  // schedule once the parameters are sharded over several ranks.
  std::vector<std::pair<std::string, const torch::nn::Module*>> unit_paths_;
  std::shared_ptr<ShardedUnits> units_;
  torch::Tensor unit_slices_;  // stage 3: this rank's slices in the units' dtype (the gathers' input)
  torch::Tensor no_state_ = torch::zeros({0});  // stage 3 without a root unit: nothing replicated
  bool overlap_ = false;  // TrainerOptions::overlap_reduction
  std::unique_ptr<Reduction> reduction_;  // overlap: started before the backward, finished after
  // Sharded:
  torch::Tensor local_grad_;  // this rank's slices of the reduced gradient
  torch::Tensor scratch_;     // Sharding::gradients with several micro-batches: one reduction's slices
  bool summed_ = false;       // local_grad_ holds this window's earlier micro-batches

  struct View {
    torch::Tensor param;
    const c10::StorageImpl* grad_storage;   // the .grad's storage
    const c10::StorageImpl* param_storage;  // the parameter's (its data move when a unit of stage 3 is gathered)
    std::string name;
  };
  std::vector<View> views_;
};

}  // namespace detail

/// FP32, BF16 and FP16: the parameters are views into one flat fp32 buffer and their .grad
/// into a flat fp32 gradient that autograd accumulates into in place, across the window's
/// micro-batches. The optimizer phase reads the gradient as one tensor, or, sharded, this
/// rank's slices of its sum over the ranks.
class FlatStorage : public detail::FlatParameters {
 public:
  /// Whether a torch::optim::Optimizer may update the parameters (it sees the model's own).
  static constexpr bool accepts_torch_optimizer = true;
  static void validate(const TrainerOptions& options, const std::string& trainer);

  /// `dtype`: the precision's storage_dtype, fp32 (the model's parameters are the flat buffer).
  FlatStorage(torch::nn::Module& model, const TrainerOptions& options, torch::Device device,
              at::ScalarType dtype = at::kFloat);

  /// The flat gradient (every trainable parameter's .grad is a view into it). Sharded with
  /// Sharding::gradients, its memory exists only from a backward to the reduction after it.
  const torch::Tensor& gradients() const { return grad_; }
  /// FlatParameters::held_tensors, and the gradient.
  void held_tensors(std::vector<torch::Tensor>& out) const {
    FlatParameters::held_tensors(out);
    out.push_back(grad_);
  }
  bool attach(Replicas& replicas, torch::nn::Module& model);
  // A backward that a reduction follows (the window's last; with Sharding::gradients every
  // one) starts that reduction before it when overlapping: its buckets leave as the hooks
  // find them complete.
  void backward_begins(const detail::BackwardDone& done);
  // Sharding::gradients: a backward the phase does not follow is reduce-scattered into the
  // slices' sum now, and the model's gradient released until the next backward.
  void backward_done(const detail::BackwardDone& done);
  GradientFactor reduce(Replicas& replicas, const WindowWeights& window);
  torch::Tensor norm() const;
  /// The gradient norm() sees, parameter by parameter (the overflow diagnosis).
  void gradient_pieces(std::vector<torch::Tensor>& pieces, std::vector<std::int64_t>& owners) const {
    pieces_of(sharded() ? local_grad_ : grad_, pieces, owners);
  }
  /// The gradient's memory, where Sharding::gradients released it, allocated (zeros): for a
  /// backward outside the step (the memory plan's measurement), which zero() releases again.
  void allocate_gradient();
  /// Sharding::gradients with several ranks: each micro-batch's gradient is reduce-scattered
  /// into this rank's slices of the window's sum at its end.
  bool reduces_each_micro_batch() const { return shards_gradients(); }
  /// With reduces_each_micro_batch(): the gradient of a micro-batch that failed before its
  /// reduction dropped; the window's earlier micro-batches, already summed on every rank,
  /// stay. Throws when the failed backward had sent buckets (overlap): the other ranks have
  /// them.
  void discard_micro_batch();
  template <class Update>
  void update(Update&& f) {
    if (!sharded()) {
      f(groups_, grad_);
      return;
    }
    if (units_) units_->settle_all();  // (this rank's slices are a gather's input)
    for (std::int64_t b = 0; b < partition_.buckets(); ++b) {
      auto part = local_grad_.narrow(0, partition_.local(b), partition_.slice(b).length);
      f(slice_groups(b, params_, /*params_local=*/units_ != nullptr, local_grad_), part);
    }
    // Stage 3: the units are gathered where they are used; the root unit now.
    if (units_) units_->refresh();
    else replicas_->all_gather(params_, partition_);
  }
  void zero();

  /// The parameters by name (model.param.<name>) and the rule's flat state; `module` for the
  /// parameters the trainer does not hold (frozen ones).
  void save(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
            const detail::UpdateRule& rule) const;
  void load(torch::serialize::InputArchive& archive, torch::nn::Module& module, detail::UpdateRule& rule);
  void snapshot(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                const detail::UpdateRule& rule) const;
  void restore(torch::serialize::InputArchive& archive, torch::nn::Module& module, detail::UpdateRule& rule);
  /// What every rank must hold alike after a load (compared across the ranks): the parameters,
  /// or with stage 3 the root unit's (the rest is each rank's own slices).
  const torch::Tensor& replicated_state() const { return units_ ? root_unit() : params_; }

  /// The open window's gradient (a checkpoint inside a window, PARTIAL_WINDOW: span): this
  /// rank's gradient as it is (replicated and Sharding::optimizer: the main rank's, as every
  /// record), or with Sharding::gradients the reduced sum of the window's micro-batches so far,
  /// gathered by parameter name (a collective), which any world size can resume.
  void save_window(torch::serialize::OutputArchive& archive, bool snapshot = false) const;
  void load_window(torch::serialize::InputArchive& archive, bool snapshot = false);

 private:
  void save_parameters(torch::serialize::OutputArchive& archive, torch::nn::Module& module) const;
  void load_parameters(torch::serialize::InputArchive& archive, torch::nn::Module& module);

  bool shards_gradients() const {
    return sharded() && (sharding_ == Sharding::gradients || sharding_ == Sharding::parameters);
  }
  // Stage 3 at attach: the layout in units, the buffers cut, the parameters sharded.
  void attach_units(Replicas& replicas, torch::nn::Module& model);
  // Stage 3: the frozen parameters (those the trainer does not hold) by name.
  void write_frozen(torch::serialize::OutputArchive& archive, torch::nn::Module& module) const;
  void read_frozen(torch::serialize::InputArchive& archive, torch::nn::Module& module);

  // The flat buffers at `numel` elements: the parameters copied in and their views re-pointed,
  // the gradient zero (at construction, and at attach() when the partition pads the buffers).
  void allocate(std::int64_t numel);
  // The flat gradient of `numel` elements (zeros), the parameters' .grad its views.
  void bind_flat_gradient(std::int64_t numel);

  Sharding sharding_;
  std::int64_t unit_prefetch_;   // stage 3 (TrainerOptions::unit_prefetch)
  bool reshard_after_forward_;
  torch::Device device_;
  torch::Tensor grad_;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/storage-inl.hpp>
#endif
