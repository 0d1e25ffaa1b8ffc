#pragma once
/// The mode ShardedUnits (mode.hpp; ZeRO stage 3, Sharding::parameters over several ranks): no
/// rank holds the model whole. Each unit (TrainerOptions::units) is one bucket of the partition,
/// cut in a slice per rank; this rank holds its slices of the values (the update's, and in the
/// units' dtype the gathers' input: the values themselves in fp32, a half copy of the fp32
/// masters with master weights) and the gathers (unit_gathers.hpp) make each unit's parameters
/// whole where it is used. Each unit's gradient is reduce-scattered into this rank's slices as
/// the backward leaves the unit (overlap) or after the backward, at every backward: no rank
/// holds every unit's gradient from one backward to the next. What no unit holds (the root
/// unit) is kept gathered and gathered again after every update and load.
///
/// The units' gathers are registered in the process (UnitRegistry) while the mode lives, so that
/// a unit called outside a step finds them (tk::unit, trainer/unit.hpp).
#include <trainkit/storage/sharded_slices.hpp>
#include <trainkit/storage/unit_gathers.hpp>

#include <functional>

namespace trainkit::detail {

class ShardedUnits final : public ShardedSlices {
 public:
  ShardedUnits(StorageCore& storage, Replicas& replicas) : ShardedSlices(storage, replicas, Partition()) {}
  /// The gathers leave the process's registry, and a graph that outlives the storage finds
  /// them closed (a gather still in flight waited for first).
  ~ShardedUnits() override;

  void attach(torch::nn::Module& model) override;
  /// The storage's lay_out: the layout laid out again in units (each one bucket of the
  /// partition), each unit's parameters made views of its own buffer of `unit_dtype` (the root
  /// unit's gathered, the others released), this rank's slices of the fp32 values kept as the
  /// storage's values and, in `unit_dtype`, as the gathers' input (the values themselves when
  /// fp32), and the gathers made and registered. `values(i)`: placed parameter i's fp32 values,
  /// flat (read before any parameter moves); `skip[i]` (empty: none): the parameter stays where
  /// it is (master weights' fp32-kept norms), its gradient still its unit's. One unit's fp32
  /// buffer exists at a time beside the caller's.
  void shard(at::ScalarType unit_dtype, const std::function<torch::Tensor(size_t)>& values,
             const std::vector<bool>& skip);
  void check_attach_again(bool masters) const override;

  void backward_begins(const BackwardDone& done) override;
  void backward_done(const BackwardDone& done) override;
  GradientFactor reduce(Replicas& replicas, const WindowWeights& window) override;
  void zero() override;
  bool reduces_each_micro_batch() const override { return true; }
  void discard_micro_batch() override { drop_backward(); }
  void allocate_gradient() override {}  // (one per unit, as needed)

  void save(torch::serialize::OutputArchive& archive, torch::nn::Module& module, const UpdateRule& rule) const override;
  void load(torch::serialize::InputArchive& archive, torch::nn::Module& module, UpdateRule& rule) override;
  void snapshot(torch::serialize::OutputArchive& archive) const override;
  void before_restore() override { gathers_->settle_all(); }  // (the slices are a gather's input)
  void restore(torch::serialize::InputArchive& archive) override;
  void save_window(torch::serialize::OutputArchive& archive, bool snapshot) const override {
    save_reduced_window(archive, snapshot);
  }
  void load_window(torch::serialize::InputArchive& archive, bool snapshot) override {
    load_reduced_window(archive, snapshot);
  }
  void after_load() override { gathers_->refresh(); }
  /// The root unit's gathered buffer (every rank holds it alike; empty without a root unit).
  const torch::Tensor& replicated_state() const override;

  std::shared_ptr<UnitSchedule> begin_forward() override;
  bool shards_parameters() const override { return true; }
  void hold_parameters(bool hold) override;
  void evaluate_by_unit(bool on) override;
  void check_loadable(const std::string& source) const override;
  const UnitGathers* unit_gathers() const override { return gathers_.get(); }
  std::int64_t overlapped_buckets() const override { return gathers_->overlapped(); }
  void held_tensors(std::vector<torch::Tensor>& out) const override;

 protected:
  GradientFactor reduce_now(const WindowWeights& window, bool closes) override;
  bool values_local() const override { return true; }
  void before_update() override { gathers_->settle_all(); }  // (this rank's slices are a gather's input)
  void after_update() override;
  void disarmed() override { gathers_->disarm(); }  // (finish() launches the units the backward did not)
  std::int64_t launched() const override { return gathers_->launched(); }

 private:
  // Every unit released and every unit's gradient dropped, with the reduction the backward
  // started (a failed micro-batch, a dropped window, zero()).
  void drop_backward();
  // Each unit's gradient buffer for a reduction (UnitGathers::gradient), released as its
  // collective completes.
  GradientBuckets unit_gradients() const;
  // The gathers' input from the values, where it is their copy in the units' dtype.
  void refresh_slices();

  std::shared_ptr<UnitGathers> gathers_;
  torch::Tensor unit_slices_;  // this rank's slices in the units' dtype (the gathers' input)
  bool slices_copy_ = false;   // unit_slices_ is a copy of the values (not fp32 units)
  torch::Tensor no_state_ = torch::zeros({0});  // without a root unit: nothing replicated
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/sharded_units-inl.hpp>
#endif
