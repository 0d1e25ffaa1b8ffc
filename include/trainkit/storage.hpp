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
#include <trainkit/detail/checkpoint_io.hpp>
#include <trainkit/detail/flat_layout.hpp>
#include <trainkit/detail/partition.hpp>
#include <trainkit/detail/released_storage.hpp>
#include <trainkit/optim.hpp>
#include <trainkit/options.hpp>
#include <trainkit/precision.hpp>
#include <trainkit/replicas.hpp>

#include <c10/core/CachingDeviceAllocator.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
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
};

/// Overlap (TrainerOptions::overlap_reduction): during an armed backward, which buckets of the
/// partition are complete. Each parameter's post-accumulate-grad hook (ReadyHook) counts its
/// gradient in the buckets it lies in; the buckets are launched in descending order (a backward
/// produces the last parameters' gradients first), each as soon as it and every bucket above it
/// are complete, so every rank launches them in the same order. What is left when the backward
/// ends (parameters that got no gradient) is launched by Reduction::finish().
class Readiness {
 public:
  Readiness(const std::vector<Range>& parameters, std::vector<std::string> names, const Partition& partition)
      : names_(std::move(names)), initial_(static_cast<size_t>(partition.buckets()), 0) {
    for (const auto& p : parameters) {
      std::int64_t first = 0;
      while (first + 1 < partition.buckets() && partition.bucket(first + 1).begin <= p.begin) ++first;
      std::int64_t last = first;
      while (last + 1 < partition.buckets() && partition.bucket(last + 1).begin < p.end()) ++last;
      spans_.push_back({first, last});
      for (auto b = first; b <= last; ++b) ++initial_[static_cast<size_t>(b)];
    }
  }
  void arm(Reduction& reduction) {
    waiting_ = initial_;
    fired_.assign(spans_.size(), false);
    next_ = static_cast<std::int64_t>(initial_.size()) - 1;
    reduction_ = &reduction;
  }
  void disarm() { reduction_ = nullptr; }
  /// Buckets launched in the armed backward.
  std::int64_t launched() const { return static_cast<std::int64_t>(initial_.size()) - 1 - next_; }
  /// Buckets launched by the hooks, during backward passes, since the hooks were installed.
  std::int64_t overlapped() const { return overlapped_; }

  /// Parameter i's gradient is accumulated (its hook; the autograd engine's thread).
  void ready(size_t i) {
    if (!reduction_) return;
    const auto [first, last] = spans_[i];
    if (fired_[i]) {
      // A second accumulation in one backward: the reentrant backward of tk::recompute for a
      // parameter used inside and outside its region. Harmless until the bucket has left.
      if (last > next_)
        throw std::runtime_error("trainkit: parameter '" + names_[i] + "' received a second gradient in one backward "
                                 "after its bucket's reduction had started (a parameter used both inside and outside "
                                 "tk::recompute?); set TrainerOptions::overlap_reduction(false) (TRAIN.OVERLAP_REDUCTION: false)");
      return;
    }
    fired_[i] = true;
    for (auto b = first; b <= last; ++b) --waiting_[static_cast<size_t>(b)];
    while (next_ >= 0 && waiting_[static_cast<size_t>(next_)] == 0) {
      reduction_->launch(next_--);
      ++overlapped_;
    }
  }

 private:
  std::vector<std::string> names_;
  std::vector<std::pair<std::int64_t, std::int64_t>> spans_;  // each parameter's first and last bucket
  std::vector<std::int64_t> initial_, waiting_;
  std::vector<bool> fired_;
  std::int64_t next_ = -1, overlapped_ = 0;
  Reduction* reduction_ = nullptr;
};

/// The hook a parameter calls after its gradient is accumulated; it outlives nothing: the
/// storage's Readiness gone, it does nothing.
class ReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  ReadyHook(std::weak_ptr<Readiness> readiness, size_t index) : readiness_(std::move(readiness)), index_(index) {}
  void operator()(const torch::autograd::Variable&) override {
    if (auto r = readiness_.lock()) r->ready(index_);
  }

 private:
  std::weak_ptr<Readiness> readiness_;
  size_t index_;
};

/// What the trainer tells its storage after each backward.
struct BackwardDone {
  bool closes = false;           ///< the optimizer phase follows before the next backward
  bool micro_batch_ends = true;  ///< false for a micro-batch's pieces but the last (micro_step_pieces)
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
  /// How the buffers are cut for the replicas (one bucket, replicated, in one process).
  const Partition& partition() const { return partition_; }
  /// Elements of the optimizer's flat state: the flat buffer, or this rank's slices.
  std::int64_t state_numel() const { return partition_.local_total(); }
  bool sharded() const { return partition_.sharded(); }
  /// Sharded: this rank's slices of the reduced gradient (the window's sum over the ranks, in
  /// the phase; with Sharding::gradients also the sum of the window's earlier micro-batches).
  const torch::Tensor& local_gradients() const { return local_grad_; }
  /// Gradient buckets whose reduction started during a backward (TrainerOptions::
  /// overlap_reduction), since the replicas were attached.
  std::int64_t overlapped_buckets() const { return readiness_ ? readiness_->overlapped() : 0; }

  /// Once per window, a pointer compare per parameter.
  void check() const {
    for (const auto& v : views_)
      if (v.param.data_ptr() != v.param_data)
        throw std::logic_error(
            "Trainer: parameter '" + v.name + "' no longer lives in the trainer's storage: its data were replaced "
            "after the trainer was built (torch::load(model, file), param.set_data(...), model->to(...)), so the "
            "optimizer would update a copy the model does not read and the loss would never change. Load weights "
            "or move the model before building the trainer, or use trainer.load(path) or tk::load_weights(model, "
            "path), which copy into the parameters");
    for (const auto& v : views_)
      if (!v.param.grad().defined() || v.param.grad().storage().unsafeGetStorageImpl() != v.grad_storage)
        throw std::logic_error(
            "Trainer: the .grad of parameter '" + v.name +
            "' was replaced or reset (model->zero_grad() or an optimizer's zero_grad()?); the "
            "trainer owns gradients and zeroes them itself after each optimizer step");
  }

 protected:
  /// The trainable parameters of `model` on `device`, grouped by (LR multiplier, decay) in
  /// order of first appearance (the model's order inside each group), placed in layout_ with
  /// each parameter 64-byte aligned for elements of `element_size` bytes (into placed_).
  void place(torch::nn::Module& model, const TrainerOptions& options, torch::Device device,
             std::int64_t element_size, bool any_floating_point) {
    std::vector<bool> no_decay_used(options.no_decay().size(), false);
    std::vector<PlacedParameter> placed;
    for (const auto& p : model.named_parameters(true)) {
      if (!p.value().requires_grad()) continue;
      const auto& t = p.value();
      TORCH_CHECK(t.device() == device, "Trainer: parameter '", p.key(), "' is on ", t.device(),
                  ", the others on ", device, "; move the whole model to one device first");
      if (any_floating_point) {
        TORCH_CHECK(t.is_floating_point(), "Trainer: parameter '", p.key(), "' is ", t.scalar_type(),
                    "; master weights need floating-point parameters");
      } else {
        TORCH_CHECK(t.scalar_type() == torch::kFloat, "Trainer: parameter '", p.key(), "' is ", t.scalar_type(),
                    "; trainkit keeps parameters in fp32 (mixed precision comes from the precision policy)");
      }
      PlacedParameter e{p.key(), t};
      for (const auto& [substring, m] : options.lr_mult())
        if (p.key().find(substring) != std::string::npos) {
          e.lr_mult = m;
          break;
        }
      for (size_t k = 0; k < options.no_decay().size(); ++k)
        if (p.key().find(options.no_decay()[k]) != std::string::npos) e.decay = false, no_decay_used[k] = true;
      placed.push_back(std::move(e));
    }
    for (size_t k = 0; k < no_decay_used.size(); ++k)
      TORCH_CHECK(no_decay_used[k], "Trainer: no_decay (TRAIN.NO_DECAY) '", options.no_decay()[k],
                  "' is in no trainable parameter's name (they look like '",
                  placed.empty() ? std::string() : placed.front().name, "')");
    using Key = std::pair<double, bool>;
    std::vector<Key> order;
    for (const auto& e : placed)
      if (std::find(order.begin(), order.end(), Key{e.lr_mult, e.decay}) == order.end()) order.push_back({e.lr_mult, e.decay});
    const auto rank = [&](const PlacedParameter& e) { return std::find(order.begin(), order.end(), Key{e.lr_mult, e.decay}); };
    std::stable_sort(placed.begin(), placed.end(),
                     [&](const PlacedParameter& a, const PlacedParameter& b) { return rank(a) < rank(b); });
    align_ = aligned_elements(element_size);
    layout_ = FlatLayout(align_);
    for (auto& e : placed) e.offset = layout_.add(e.param.numel());
    placed_ = std::move(placed);
    partition_ = Partition(layout_.padded(), std::max<std::int64_t>(1, layout_.padded()), align_, 1, 0, false);
  }

  /// The partition for `replicas`: one bucket in one process; buckets of the replicas'
  /// bucket_bytes with several, sharded with `sharding`.
  Partition partition_for(const Replicas& replicas, Sharding sharding, std::int64_t element_size) const {
    if (replicas.world_size() == 1)
      return Partition(layout_.padded(), std::max<std::int64_t>(1, layout_.padded()), align_, 1, 0, false);
    return Partition(layout_.padded(), std::max<std::int64_t>(1, replicas.bucket_bytes() / element_size), align_,
                     replicas.world_size(), replicas.rank(), sharding != Sharding::none);
  }

  /// Overlap: a post-accumulate-grad hook on every trainable parameter (after the partition).
  void install_hooks() {
    std::vector<Range> ranges;
    std::vector<std::string> names;
    for (const auto& e : placed_) {
      ranges.push_back({e.offset, e.param.numel()});
      names.push_back(e.name);
    }
    readiness_ = std::make_shared<Readiness>(ranges, std::move(names), partition_);
    for (size_t i = 0; i < placed_.size(); ++i)
      torch::autograd::impl::set_post_acc_grad_hooks(placed_[i].param, std::make_unique<ReadyHook>(readiness_, i));
  }

  /// `numel` elements of fp32 on `device`, the layout's gaps zero (before the parameters are
  /// copied in).
  torch::Tensor allocate_flat(std::int64_t numel, torch::Device device) const {
    auto flat = torch::empty({numel}, torch::dtype(torch::kFloat).device(device));
    layout_.zero_gaps(flat);
    return flat;
  }

  /// The view of `e` in `flat`, the parameter's current values copied in.
  static torch::Tensor copy_in(const PlacedParameter& e, const torch::Tensor& flat) {
    torch::NoGradGuard no_grad;
    auto view = flat.narrow(0, e.offset, e.param.numel()).view(e.param.sizes());
    view.copy_(e.param);
    return view;
  }

  /// The parameters' old blocks back to the device before the gradients are allocated (CUDA's
  /// caching allocator would keep them, and a model's worth of small blocks cannot serve one
  /// flat gradient): the construction peak stays at twice the model, not three times.
  static void release_cached(torch::Device device) {
    if (!device.is_cpu()) c10::getDeviceAllocator(device.type())->emptyCache();
  }

  /// One group per run of parameters with the same (LR multiplier, decay): slices of params_
  /// and of `grads` (undefined: bound in each optimizer phase); the state at the group's offset.
  void make_groups(const torch::Tensor& grads) {
    groups_.clear();
    ranges_.clear();
    std::int64_t begin = 0;
    for (size_t i = 0; i < placed_.size(); ++i) {
      const auto& e = placed_[i];
      if (i == 0 || placed_[i - 1].lr_mult != e.lr_mult || placed_[i - 1].decay != e.decay) begin = e.offset;
      const bool ends = i + 1 == placed_.size() || placed_[i + 1].lr_mult != e.lr_mult || placed_[i + 1].decay != e.decay;
      if (!ends) continue;
      const auto end = e.offset + e.param.numel();
      groups_.push_back({params_.narrow(0, begin, end - begin),
                         grads.defined() ? grads.narrow(0, begin, end - begin) : torch::Tensor(), e.lr_mult, e.decay,
                         layout_.slice(begin, end), /*state_offset=*/begin});
      ranges_.push_back({begin, end - begin});
    }
  }

  /// Records the views check() compares against (after each parameter's data and .grad are set).
  void record_view(const PlacedParameter& e) {
    views_.push_back({e.param, e.param.grad().storage().unsafeGetStorageImpl(), e.param.data_ptr(), e.name});
  }

  /// The groups' gradients as slices of `grads` (the whole flat gradient), or none.
  void bind_gradients(const torch::Tensor& grads) {
    for (size_t g = 0; g < groups_.size(); ++g)
      groups_[g].grads = grads.defined() ? grads.narrow(0, ranges_[g].begin, ranges_[g].length) : torch::Tensor();
  }

  /// The groups restricted to the flat elements `range`: their parameters in `params` and
  /// their gradients in `grads` (both `range`'s elements, in any buffer), their state from
  /// `state_begin` on; a group outside the range has undefined params. The chunks of the
  /// master-weights phase and a rank's slices are updated through these.
  std::vector<ParamGroup> chunk_groups(Range range, const torch::Tensor& params, const torch::Tensor& grads,
                                       std::int64_t state_begin) const {
    std::vector<ParamGroup> out(groups_.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      const auto lo = std::max(range.begin, ranges_[g].begin), hi = std::min(range.end(), ranges_[g].end());
      if (lo >= hi) continue;
      out[g].params = params.narrow(0, lo - range.begin, hi - lo);
      out[g].grads = grads.narrow(0, lo - range.begin, hi - lo);
      out[g].lr_mult = groups_[g].lr_mult;
      out[g].decay = groups_[g].decay;
      out[g].state_offset = state_begin + (lo - range.begin);
    }
    return out;
  }
  /// chunk_groups over this rank's slice of bucket b: parameters from `params` (global layout,
  /// or local when `params_local`), gradients and state in the local layout.
  std::vector<ParamGroup> slice_groups(std::int64_t b, const torch::Tensor& params, bool params_local,
                                       const torch::Tensor& local_grads) const {
    const Range s = partition_.slice(b);
    const auto at = partition_.local(b);
    return chunk_groups(s, params.narrow(0, params_local ? at : s.begin, s.length), local_grads.narrow(0, at, s.length), at);
  }

  // --- records by parameter name ----------------------------------------------------------
  /// `global` (a buffer in the flat layout, on any device) as one record per parameter:
  /// `prefix` + name, with the parameter's shape. Views of one storage: written once.
  void write_by_name(torch::serialize::OutputArchive& archive, const std::string& prefix,
                     const torch::Tensor& global) const {
    for (const auto& e : placed_)
      write_tensor(archive, prefix + e.name, global.narrow(0, e.offset, e.param.numel()).view(e.param.sizes()));
  }
  /// The records `prefix` + name into `local` (this rank's layout: the flat layout, or its
  /// slices when sharded). Throws naming the first record that is missing or misshapen, before
  /// anything is copied.
  void read_by_name(torch::serialize::InputArchive& archive, const std::string& prefix, const torch::Tensor& local) const {
    std::vector<torch::Tensor> saved;
    saved.reserve(placed_.size());
    for (const auto& e : placed_) {
      auto t = read_tensor(archive, prefix + e.name);
      if (t.sizes() != e.param.sizes())
        throw std::runtime_error("checkpoint record '" + prefix + e.name + "' has shape " + shape_string(t.sizes()) +
                                 ", this run needs " + shape_string(e.param.sizes()));
      saved.push_back(t.reshape({-1}));
    }
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < placed_.size(); ++i)
      for_each_piece(placed_[i], [&](std::int64_t at, std::int64_t from, std::int64_t n) {
        local.narrow(0, at, n).copy_(saved[i].narrow(0, from, n));
      });
  }
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
  torch::Tensor global_of(const torch::Tensor& local) const {
    if (!partition_.sharded()) return local;
    return replicas_->gather_to_main(local, partition_);
  }

  /// The rule's flat state by parameter name: optim.<kind>.<name> (checkpoints of version 0.1
  /// hold it per group, optim.<kind>.<g>, packed: read too).
  void save_state(torch::serialize::OutputArchive& archive, const UpdateRule& rule) const {
    for (const auto* s : rule.flat_states()) {
      const auto global = global_of(s->flat());
      if (global.defined()) write_by_name(archive, "optim." + s->kind() + ".", global);
    }
  }
  void load_state(torch::serialize::InputArchive& archive, UpdateRule& rule) const {
    for (auto* s : rule.flat_states()) {
      const std::string prefix = "optim." + s->kind() + ".";
      torch::Tensor probe;
      if (!placed_.empty() && !archive.try_read(prefix + placed_.front().name, probe, true) &&
          archive.try_read(prefix + "0", probe, true) && !partition_.sharded()) {
        for (size_t g = 0; g < groups_.size(); ++g)
          groups_[g].layout.read_into(archive, prefix + std::to_string(g),
                                      s->flat().narrow(0, ranges_[g].begin, ranges_[g].length));
        continue;
      }
      read_by_name(archive, prefix, s->flat());
    }
  }

  /// Sharding::gradients, a checkpoint inside a window: the reduced sum of its micro-batches so
  /// far, gathered by parameter name (a collective), which any world size resumes; a snapshot
  /// holds this rank's slices as they are.
  void save_reduced_window(torch::serialize::OutputArchive& archive, bool snapshot) const {
    TORCH_CHECK(summed_, "Sharding::gradients: an open window without a reduced micro-batch");
    if (snapshot) {
      write_tensor(archive, "snapshot.window_local", local_grad_);
      return;
    }
    const auto global = global_of(local_grad_);
    if (global.defined()) write_by_name(archive, "window.gradient_reduced.", global);
  }
  /// The reduced sum save_reduced_window() wrote, when this run shards its gradients
  /// (`shards_gradients`): true when read; false when the checkpoint holds the storage's own
  /// window records. Throws when the checkpoint's kind and this run's differ.
  bool load_reduced_window(torch::serialize::InputArchive& archive, bool snapshot, bool shards_gradients) {
    if (snapshot && shards_gradients) {
      local_grad_ = read_tensor(archive, "snapshot.window_local").to(params_.device());
      summed_ = true;
      return true;
    }
    torch::Tensor probe;
    const bool reduced = !placed_.empty() && archive.try_read("window.gradient_reduced." + placed_.front().name, probe, true);
    if (reduced != shards_gradients)
      throw std::runtime_error(std::string("it was written inside a window (PARTIAL_WINDOW: span) ") +
                               (reduced ? "with gradients sharded (TRAIN.ZERO_STAGE: 2), and this run does not shard them"
                                        : "without sharded gradients, and this run shards them (TRAIN.ZERO_STAGE: 2)") +
                               "; resume with the checkpoint's TRAIN.ZERO_STAGE, or from a checkpoint at a window's end");
    if (!reduced) return false;
    local_grad_ = torch::zeros({partition_.local_total()}, params_.options());
    read_by_name(archive, "window.gradient_reduced.", local_grad_);
    summed_ = true;
    return true;
  }

  FlatLayout layout_;
  std::int64_t align_ = 16;
  std::vector<PlacedParameter> placed_;
  torch::Tensor params_;  // the flat fp32 buffer the update writes (see parameters())
  std::vector<ParamGroup> groups_;
  std::vector<Range> ranges_;  // each group's elements in the flat layout
  Partition partition_;
  Replicas* replicas_ = nullptr;  // the trainer's, from attach()
  std::shared_ptr<Readiness> readiness_;  // overlap: defined when the hooks are installed
  // Sharded:
  torch::Tensor local_grad_;  // this rank's slices of the reduced gradient
  torch::Tensor scratch_;     // Sharding::gradients with several micro-batches: one reduction's slices
  bool summed_ = false;       // local_grad_ holds this window's earlier micro-batches

  struct View {
    torch::Tensor param;
    const c10::StorageImpl* grad_storage;  // the .grad's storage
    const void* param_data;                // the parameter's
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
  static void validate(const TrainerOptions& options, const std::string& trainer) {
    if (options.reduce_precision() == ReducePrecision::half)
      throw std::invalid_argument(
          "trainkit::TrainerOptions: reduce_precision half needs master weights (PrecisionPolicy<MasterWeights<T>>): "
          "without them the gradient is fp32, and " + trainer + " all-reduces it as it is");
  }

  /// `dtype`: the precision's storage_dtype, fp32 (the model's parameters are the flat buffer).
  FlatStorage(torch::nn::Module& model, const TrainerOptions& options, torch::Device device,
              at::ScalarType dtype = at::kFloat)
      : sharding_(options.sharding()), overlap_(options.overlap_reduction()), device_(device) {
    TORCH_CHECK(dtype == at::kFloat, "FlatStorage holds fp32 parameters, not ", dtype);
    place(model, options, device, /*element_size=*/4, /*any_floating_point=*/false);
    allocate(layout_.padded());
  }

  /// The flat gradient (every trainable parameter's .grad is a view into it). Sharded with
  /// Sharding::gradients, its memory exists only from a backward to the reduction after it.
  const torch::Tensor& gradients() const { return grad_; }
  bool attach(Replicas& replicas, torch::nn::Module& model) {
    replicas_ = &replicas;
    partition_ = partition_for(replicas, sharding_, /*element_size=*/4);
    if (partition_.total() != params_.numel()) allocate(partition_.total());
    replicas.attach(model, params_);
    local_grad_ = torch::Tensor();
    summed_ = false;
    if (shards_gradients()) detail::release_storage(grad_);
    readiness_.reset();
    if (overlap_ && replicas.world_size() > 1) install_hooks();
    return sharded();
  }
  // A backward that a reduction follows (the window's last; with Sharding::gradients every
  // one) starts that reduction before it when overlapping: its buckets leave as the hooks
  // find them complete.
  void backward_begins(const detail::BackwardDone& done) {
    allocate_gradient();
    if (readiness_ && done.micro_batch_ends && (done.closes || shards_gradients())) {
      reduction_ = replicas_->start_reduction(grad_, reduction_target(), partition_, done.window, done.closes);
      readiness_->arm(*reduction_);
    }
  }
  // Sharding::gradients: a backward the phase does not follow is reduce-scattered into the
  // slices' sum now, and the model's gradient released until the next backward.
  void backward_done(const detail::BackwardDone& done) {
    if (done.closes || !done.micro_batch_ends || !shards_gradients()) return;
    finish_reduction(*replicas_, done.window, /*closes=*/false);
    detail::release_storage(grad_);
  }
  GradientFactor reduce(Replicas& replicas, const WindowWeights& window) {
    // (A window flushed at an epoch's end after a reduced micro-batch has no gradient left:
    // zeros stand for it, and the reduction still brings the window's item total.)
    allocate_gradient();
    const GradientFactor factor = finish_reduction(replicas, window, /*closes=*/true);
    if (shards_gradients()) detail::release_storage(grad_);
    return factor;
  }
  torch::Tensor norm() const {
    return sharded() ? replicas_->global_norm(local_grad_) : at::linalg_vector_norm(grad_, 2);
  }
  template <class Update>
  void update(Update&& f) {
    if (!sharded()) {
      f(groups_, grad_);
      return;
    }
    for (std::int64_t b = 0; b < partition_.buckets(); ++b) {
      auto part = local_grad_.narrow(0, partition_.local(b), partition_.slice(b).length);
      f(slice_groups(b, params_, /*params_local=*/false, local_grad_), part);
    }
    replicas_->all_gather(params_, partition_);
  }
  void zero() {
    drop_reduction();
    summed_ = false;
    if (!sharded()) {
      grad_.zero_();
      return;
    }
    if (shards_gradients()) {
      if (!detail::is_released(grad_)) detail::release_storage(grad_);
    } else {
      grad_.zero_();
    }
    local_grad_ = scratch_ = torch::Tensor();  // the reduced slices live from a reduction to the update
  }

  /// The parameters by name (model.param.<name>) and the rule's flat state; `module` for the
  /// parameters the trainer does not hold (frozen ones).
  void save(torch::serialize::OutputArchive& archive, torch::nn::Module& module, const detail::UpdateRule& rule) const {
    save_parameters(archive, module);
    save_state(archive, rule);
  }
  void load(torch::serialize::InputArchive& archive, torch::nn::Module& module, detail::UpdateRule& rule) {
    load_parameters(archive, module);
    load_state(archive, rule);
  }
  void snapshot(torch::serialize::OutputArchive& archive, torch::nn::Module& module, const detail::UpdateRule& rule) const {
    save_parameters(archive, module);
    for (const auto* s : rule.flat_states()) detail::write_tensor(archive, "snapshot." + s->kind(), s->flat());
  }
  void restore(torch::serialize::InputArchive& archive, torch::nn::Module& module, detail::UpdateRule& rule) {
    load_parameters(archive, module);
    for (auto* s : rule.flat_states()) detail::read_into(archive, "snapshot." + s->kind(), s->flat());
  }
  /// What every rank must hold alike after a load (compared across the ranks).
  const torch::Tensor& replicated_state() const { return params_; }

  /// The open window's gradient (a checkpoint inside a window, PARTIAL_WINDOW: span): this
  /// rank's gradient as it is (replicated and Sharding::optimizer: the main rank's, as every
  /// record), or with Sharding::gradients the reduced sum of the window's micro-batches so far,
  /// gathered by parameter name (a collective), which any world size can resume.
  void save_window(torch::serialize::OutputArchive& archive, bool snapshot = false) const {
    if (shards_gradients()) save_reduced_window(archive, snapshot);
    else layout_.write(archive, "window.gradient", grad_);
  }
  void load_window(torch::serialize::InputArchive& archive, bool snapshot = false) {
    if (load_reduced_window(archive, snapshot, shards_gradients())) return;
    allocate_gradient();
    layout_.read_into(archive, "window.gradient", grad_);
  }

 private:
  void save_parameters(torch::serialize::OutputArchive& archive, torch::nn::Module& module) const {
    for (const auto& p : module.named_parameters(true)) detail::write_tensor(archive, "model.param." + p.key(), p.value());
  }
  void load_parameters(torch::serialize::InputArchive& archive, torch::nn::Module& module) {
    torch::NoGradGuard no_grad;
    for (const auto& p : module.named_parameters(true)) detail::read_into(archive, "model.param." + p.key(), p.value());
  }

  bool shards_gradients() const { return sharded() && sharding_ == Sharding::gradients; }

  // The flat buffers at `numel` elements: the parameters copied in and their views re-pointed,
  // the gradient zero (at construction, and at attach() when the partition pads the buffers).
  void allocate(std::int64_t numel) {
    // The old gradient goes first (the parameters' .grad and the groups hold views of it), so
    // that at most the parameters are held twice.
    for (auto& e : placed_) e.param.mutable_grad() = torch::Tensor();
    groups_.clear();
    views_.clear();
    grad_ = torch::Tensor();
    auto flat = allocate_flat(numel, device_);
    for (auto& e : placed_) e.param.set_data(copy_in(e, flat));  // (releases the old storage)
    params_ = flat;
    release_cached(device_);
    grad_ = torch::zeros({numel}, params_.options());
    views_.clear();
    for (auto& e : placed_) {
      e.param.mutable_grad() = grad_.narrow(0, e.offset, e.param.numel()).view(e.param.sizes());
      record_view(e);
    }
    make_groups(grad_);
  }

  void allocate_gradient() {
    if (detail::is_released(grad_)) detail::allocate_released(grad_);
  }
  // Where a reduction's result goes: nowhere but the gradient itself (replicated: summed in
  // place), or this rank's slices (the window's sum, or with Sharding::gradients a scratch
  // buffer added to the sum of the window's earlier micro-batches).
  torch::Tensor reduction_target() {
    if (!sharded()) return {};
    torch::Tensor& target = summed_ ? scratch_ : local_grad_;
    if (!target.defined()) target = torch::empty({partition_.local_total()}, params_.options());
    return target;
  }
  // The reduction of the gradient: the one started before the backward (overlap), or a whole
  // one now.
  GradientFactor finish_reduction(Replicas& replicas, const WindowWeights& window, bool closes) {
    GradientFactor factor;
    if (reduction_) {
      readiness_->disarm();
      factor = reduction_->finish();
      reduction_.reset();
    } else {
      factor = replicas.reduce_buckets(grad_, reduction_target(), partition_, window, closes);
    }
    if (sharded()) {
      if (summed_) local_grad_.add_(scratch_);
      summed_ = true;
    }
    return factor;
  }
  // A window dropped (replayed after an out-of-memory error) while its reduction had started.
  // Buckets already sent cannot be taken back from the other ranks: the ranks would disagree.
  void drop_reduction() {
    if (!reduction_) return;
    const auto launched = readiness_->launched();
    readiness_->disarm();
    if (launched == 0) {
      reduction_.reset();  // nothing sent
      return;
    }
    throw std::runtime_error(
        "trainkit: the window was dropped (an out-of-memory error in its backward?) after " + std::to_string(launched) +
        " bucket(s) of its gradient reduction had started on this rank, overlapped with the backward: the other ranks "
        "cannot replay it with this one, so training stops here. Resume from the last checkpoint with a smaller "
        "micro-batch or TRAIN.MEMORY_BUDGET, or set TRAIN.OVERLAP_REDUCTION: false "
        "(TrainerOptions::overlap_reduction) to reduce after the backward, where such a window can be replayed");
  }

  Sharding sharding_;
  bool overlap_;
  torch::Device device_;
  std::unique_ptr<Reduction> reduction_;  // overlap: started before the backward, finished after
  torch::Tensor grad_;
};

}  // namespace trainkit
