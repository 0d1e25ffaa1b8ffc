#pragma once
/// What both storages are (storage.hpp states their contract): StorageCore (the placed
/// parameters, the values, what a mode asks of a precision) and the sharding mode (mode.hpp)
/// that every call of the trainer's step goes to. FlatStorage and MasterStorage derive from it.
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/partition.hpp>
#include <trainkit/step/optim.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/step/replicas.hpp>
#include <trainkit/storage/held_bytes.hpp>
#include <trainkit/storage/mode.hpp>
#include <trainkit/storage/replicated.hpp>
#include <trainkit/storage/sharded_update.hpp>
#include <trainkit/storage/sharded_units.hpp>
#include <trainkit/storage/storage_core.hpp>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace trainkit::detail {

class StorageBase : public StorageCore {
 public:
  ~StorageBase() override;

  /// The flat fp32 buffer the update writes: the model's parameters, or with master weights
  /// the masters (sharded master weights and stage 3: this rank's slices only).
  const torch::Tensor& parameters() const { return params_; }
  const FlatLayout& layout() const { return placement_.layout(); }
  const std::vector<ParamGroup>& groups() const { return placement_.groups(); }
  std::int64_t parameter_count() const { return placement_.layout().packed(); }
  /// The model as predict_held (held_bytes.hpp) sees it.
  ModelSize model_size(torch::nn::Module& model) const { return placement_.model_size(model); }
  /// The mode the storage is in (Replicated until the replicas are attached).
  const ShardingMode& mode() const { return *mode_; }
  /// How the buffers are cut for the replicas (one bucket, replicated, in one process).
  const Partition& partition() const;
  /// Elements of the optimizer's flat state: the flat buffer, or this rank's slices.
  std::int64_t state_numel() const;
  /// Whether the update is sharded (this rank updates, and saves, its slices alone).
  bool sharded() const;
  /// Sharded: this rank's slices of the reduced gradient (the window's sum over the ranks, in
  /// the phase; with the gradients sharded also the sum of the window's earlier micro-batches).
  const torch::Tensor& local_gradients() const;
  /// Gradient buckets whose reduction started during a backward, before its last gradient
  /// (TrainerOptions::overlap_reduction), since the replicas were attached.
  std::int64_t overlapped_buckets() const;
  /// The mean share of a backward's gradient still to come when its buckets were launched.
  double backward_left_at_launch() const;
  /// Stage 3's gathers (their counts and units), or null in the other modes.
  const UnitGathers* unit_gathers() const;

  // --- the storage contract (storage.hpp) ------------------------------------------------------
  /// Trainer::set_replicas: the mode chosen for the replicas (TrainerOptions::sharding, with
  /// more than one rank) and the buffers laid out for it; true when the update is sharded.
  bool attach(Replicas& replicas, torch::nn::Module& model);
  void backward_begins(const BackwardDone& done);
  void backward_done(const BackwardDone& done);
  GradientFactor reduce(Replicas& replicas, const WindowWeights& window);
  torch::Tensor norm();
  void update(const UpdatePart& f);
  void zero();
  void check() const { views_.check(); }
  /// The gradient norm() sees, parameter by parameter (the overflow diagnosis).
  void gradient_parts(std::vector<torch::Tensor>& parts, std::vector<std::int64_t>& owners) const;
  /// Whether each micro-batch's gradient is reduce-scattered into this rank's slices of the
  /// window's sum at its end (stages 2 and 3 with several ranks).
  bool reduces_each_micro_batch() const;
  /// With reduces_each_micro_batch(): the gradient of a micro-batch that failed before its
  /// reduction dropped; the window's earlier micro-batches, already summed on every rank,
  /// stay. Throws when the failed backward had sent buckets (overlap): the other ranks have them.
  void discard_micro_batch();
  /// The gradient's memory, where it is released between windows, allocated (zeros): for a
  /// backward outside the step (the memory plan's measurement), which zero() releases again.
  void allocate_gradient();
  /// The parameters by name (model.param.<name>: the fp32 masters with master weights; the
  /// frozen ones from `module`) and the rule's flat state; sharded, a collective.
  void save(torch::serialize::OutputArchive& archive, torch::nn::Module& module, const UpdateRule& rule) const;
  void load(torch::serialize::InputArchive& archive, torch::nn::Module& module, UpdateRule& rule);
  /// This rank's buffers as they are, no collective (the rollback of a failed load).
  void snapshot(torch::serialize::OutputArchive& archive, torch::nn::Module& module, const UpdateRule& rule) const;
  void restore(torch::serialize::InputArchive& archive, torch::nn::Module& module, UpdateRule& rule);
  /// The open window's gradient (a checkpoint inside a window, PARTIAL_WINDOW: span): this
  /// rank's as it is, or with the gradients sharded the reduced sum of the window's micro-batches
  /// so far, gathered by parameter name (a collective), which any world size can resume.
  void save_window(torch::serialize::OutputArchive& archive, bool snapshot = false) const;
  void load_window(torch::serialize::InputArchive& archive, bool snapshot = false);
  /// After a load that every rank completed (Trainer::load, once they agreed): stage 3 gathers
  /// its root unit from the slices just read (a collective); otherwise nothing.
  void after_load();
  /// What every rank must hold alike after a load (compared across the ranks).
  const torch::Tensor& replicated_state() const;

  // --- the units of stage 3 (the other modes: nothing) ---------------------------------------
  /// The trainer's forward starts: the schedule to make active for it (null: none).
  std::shared_ptr<UnitSchedule> begin_forward();
  bool shards_parameters() const;
  void hold_parameters(bool hold);
  void evaluate_by_unit(bool on);
  void check_loadable(const std::string& source) const;

 protected:
  /// The trainable parameters of `model` placed for elements of `element_size` bytes, in
  /// the mode Replicated until attach().
  StorageBase(torch::nn::Module& model, const TrainerOptions& options, torch::Device device, std::int64_t element_size,
              bool any_floating_point);
  /// The base's buffers (the values, the mode's), for Trainer::held_bytes; the storages add theirs.
  void held_tensors(std::vector<torch::Tensor>& out) const;
  /// The partition of the layout for `replicas`: one bucket in one process; buckets of the
  /// replicas' bucket_bytes with several, each cut in a slice per rank when `sharded`.
  Partition buckets(const Replicas& replicas, bool sharded) const;

  std::unique_ptr<ShardingMode> mode_;
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/storage_base-inl.hpp>
#endif
