#pragma once
/// A sharding mode: where, over the ranks, a storage's fp32 values, its reduced gradient and the
/// optimizer's state live, and what crosses between the ranks to keep them so. A storage holds
/// one mode, chosen once when the replicas are attached (StorageBase::attach: the only place
/// that reads TrainerOptions::sharding), and every call of the trainer's step goes to it:
///
///   Replicated        (replicated.hpp) every rank holds everything; phase 5 all-reduces the
///                     gradient (stage 0, and every stage in one process)
///   ShardedUpdate     (sharded_update.hpp) every rank holds the model; the gradient is
///                     reduce-scattered into this rank's slices, which alone it updates (and
///                     holds the optimizer's state and fp32 masters for), then all-gathers
///                     (stage 1); ShardedGradients, the same with each micro-batch's gradient
///                     reduce-scattered at its end and released (stage 2)
///   ShardedUnits      (sharded_units.hpp) no rank holds the model whole: each unit's parameters
///                     are all-gathered where it is used (unit_gathers.hpp), each unit's
///                     gradient reduce-scattered as the backward leaves it (stage 3)
///
/// The three sharded ones share ShardedSlices (sharded_slices.hpp): this rank's slices of the
/// reduced gradient, the norm over every rank's slices, the update slice by slice and the
/// records written and read slice by slice.
///
/// Contract — the mode implements the storage contract's calls (storage.hpp) for both
/// storages, calling its storage (StorageCore, storage_core.hpp) for what depends on the precision: how the
/// model's gradient is held and made fp32, the phase on whole buffers, and the records of the
/// values. A mode crosses no call per element or per parameter of a step: its calls are made
/// per backward, per window and per unit.
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/partition.hpp>
#include <trainkit/step/optim.hpp>
#include <trainkit/step/replicas.hpp>
#include <trainkit/storage/placement.hpp>
#include <trainkit/storage/readiness.hpp>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace trainkit::detail {

class StorageCore;
class UnitGathers;
class UnitSchedule;

/// What the trainer tells its storage before and after each backward.
struct BackwardDone {
  bool closes = false;           ///< the optimizer phase follows before the next backward
  /// False for a micro-batch's pieces but the last (micro_step_pieces), whose gradients join the
  /// next piece's before any reduction (ZeRO stage 3 reduces every backward's regardless).
  bool micro_batch_ends = true;
  WindowWeights window;          ///< the window's weights so far
};

/// Phase 9's update of one part of the flat buffer: f(groups, gradient), called once per part
/// (the whole buffer, a chunk of it, or one of this rank's slices).
using UpdatePart = std::function<void(const std::vector<ParamGroup>&, torch::Tensor&)>;

/// A parameter's part of this rank's slices (the whole parameter when replicated): `at` in this
/// rank's local buffers, `from` in the parameter (flattened), `length` elements.
struct ParameterSlice {
  std::int64_t at = 0, from = 0, length = 0;
};

class ShardingMode {
 public:
  virtual ~ShardingMode() = default;
  ShardingMode(const ShardingMode&) = delete;
  ShardingMode& operator=(const ShardingMode&) = delete;

  /// How the flat buffers are cut for the ranks.
  const Partition& partition() const { return partition_; }
  /// The replicas (null before the storage is attached).
  Replicas* replicas() const { return replicas_; }

  /// Once, when the storage attaches its replicas: its buffers laid out for the mode (through
  /// the storage's lay_out) and the post-accumulate-grad hooks installed.
  virtual void attach(torch::nn::Module& model) = 0;
  /// Before the storage is attached again: throws where this mode cannot be left (`masters`:
  /// MasterStorage's).
  virtual void check_attach_again(bool masters) const { (void)masters; }

  // --- the step (storage.hpp's contract) ------------------------------------------------------
  virtual void backward_begins(const BackwardDone& done);
  virtual void backward_done(const BackwardDone& done) = 0;
  virtual GradientFactor reduce(Replicas& replicas, const WindowWeights& window) = 0;
  virtual torch::Tensor norm() = 0;
  virtual void update(const UpdatePart& f) = 0;
  virtual void zero() = 0;
  /// The gradient norm() sees, parameter by parameter (the overflow diagnosis).
  virtual void gradient_parts(std::vector<torch::Tensor>& parts, std::vector<std::int64_t>& owners) const = 0;
  virtual bool reduces_each_micro_batch() const { return false; }
  virtual void discard_micro_batch();
  virtual void allocate_gradient();

  // --- records --------------------------------------------------------------------------------
  virtual void save(torch::serialize::OutputArchive& archive, torch::nn::Module& module, const UpdateRule& rule) const = 0;
  virtual void load(torch::serialize::InputArchive& archive, torch::nn::Module& module, UpdateRule& rule) = 0;
  /// This mode's own buffers as they are (no collective), for the rollback of a failed load.
  virtual void snapshot(torch::serialize::OutputArchive&) const {}
  virtual void before_restore() {}
  virtual void restore(torch::serialize::InputArchive&) {}
  virtual void save_window(torch::serialize::OutputArchive& archive, bool snapshot) const = 0;
  virtual void load_window(torch::serialize::InputArchive& archive, bool snapshot) = 0;
  /// After a load every rank completed.
  virtual void after_load() {}
  /// What every rank must hold alike after a load (compared across the ranks).
  virtual const torch::Tensor& replicated_state() const = 0;
  /// `local` (this rank's layout: the flat buffer, or its slices) as one record per parameter
  /// name, `prefix` + name (sharded: gathered to the main rank, a collective; inside a
  /// ShardedWrites scope this rank's pieces alone).
  virtual void write_local(torch::serialize::OutputArchive& archive, const std::string& prefix,
                           const torch::Tensor& local) const = 0;
  /// The records `prefix` + name into `local` (from a set, only this rank's byte ranges).
  /// Throws naming the first record that is missing or misshapen, before anything is copied.
  void read_local(torch::serialize::InputArchive& archive, const std::string& prefix, const torch::Tensor& local) const;
  /// The parts of placed parameter `e` this rank holds in its local layout (its slices).
  virtual std::vector<ParameterSlice> slices_of(const PlacedParameter& e) const = 0;

  // --- the units (ZeRO stage 3); the other modes have none ------------------------------------
  /// The trainer's forward starts: the schedule its tk::unit calls use, or null.
  virtual std::shared_ptr<UnitSchedule> begin_forward() { return nullptr; }
  virtual bool shards_parameters() const { return false; }
  virtual void hold_parameters(bool) {}
  virtual void evaluate_by_unit(bool) {}
  /// Throws where a load now would leave the state stale (`source` names the checkpoint).
  virtual void check_loadable(const std::string& source) const { (void)source; }
  virtual const UnitGathers* unit_gathers() const { return nullptr; }

  // --- what it holds and did ------------------------------------------------------------------
  /// This rank's slices of the reduced gradient (undefined where the mode holds none).
  virtual const torch::Tensor& local_gradients() const;
  /// Appends the mode's own buffers, for Trainer::held_bytes.
  virtual void held_tensors(std::vector<torch::Tensor>&) const {}
  /// Gradient buckets whose reduction started during a backward, before its last gradient.
  virtual std::int64_t overlapped_buckets() const { return readiness_ ? readiness_->overlapped() : 0; }
  /// The mean share of a backward's gradient still to come when its buckets were launched.
  double backward_left_at_launch() const { return readiness_ ? readiness_->backward_left() : 0.0; }

 protected:
  ShardingMode(StorageCore& storage, Replicas* replicas, Partition partition)
      : storage_(storage), replicas_(replicas), partition_(std::move(partition)) {}

  /// Whether a reduction follows the backward `done` describes (the window's last: replicated
  /// and stage 1; every micro-batch's end: stage 2).
  virtual bool reduces_after(const BackwardDone& done) const { return done.closes; }
  /// Where a reduction's result goes: the gradient itself (undefined: summed in place), or this
  /// rank's slices.
  virtual torch::Tensor reduction_target() { return {}; }
  /// The overlap's hooks on every trainable parameter (TrainerOptions::overlap_reduction), when
  /// the storage's gradient is reduced in place as the backward produces it.
  void install_readiness();
  /// Every trainable parameter's post-accumulate-grad hook told to `listener`.
  void install_hooks(const std::shared_ptr<GradientListener>& listener);
  /// The reduction started before the backward (overlap), finished: the buckets the backward
  /// did not complete launched, every one waited for.
  GradientFactor finish_started();
  /// The reduction started before a backward dropped (a window replayed after an out-of-memory
  /// error). Buckets already sent cannot be taken back from the other ranks: throws then.
  void drop_reduction();
  /// The reduction started at a backward's beginning was left (finish_started, drop_reduction).
  virtual void disarmed() {}
  /// Buckets the dropped reduction had launched.
  virtual std::int64_t launched() const { return readiness_ ? readiness_->launched() : 0; }
  /// The storage's records written for this mode (write_frozen and the rule's state).
  void save_state(torch::serialize::OutputArchive& archive, const UpdateRule& rule) const;
  void load_state(torch::serialize::InputArchive& archive, UpdateRule& rule) const;
  /// One record of the rule's state into `flat` (Replicated also reads the packed records of
  /// trainkit 0.1).
  virtual void read_state(torch::serialize::InputArchive& archive, const std::string& prefix,
                          const torch::Tensor& flat) const {
    read_local(archive, prefix, flat);
  }

  StorageCore& storage_;
  Replicas* replicas_;
  Partition partition_;
  std::shared_ptr<Readiness> readiness_;  // overlap: defined when the hooks are installed
  std::unique_ptr<Reduction> reduction_;  // overlap: started before the backward, finished after
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/mode-inl.hpp>
#endif
