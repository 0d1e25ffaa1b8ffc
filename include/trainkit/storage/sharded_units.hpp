#pragma once
/// ZeRO stage 3's schedule (Sharding::parameters, TRAIN.ZERO_STAGE: 3): where each unit's
/// parameters exist whole. FlatStorage builds it when it shards a model over several ranks.
///
/// A unit (TrainerOptions::units) is one bucket of the partition: its parameters lie back to
/// back in the flat layout, and each rank holds one slice of it in its local buffer (the fp32
/// values the update writes). The model's parameters of the unit are views of the unit's own
/// buffer, whose memory exists only while gathered:
///   before_forward(u)   one all-gather of the unit's bucket into its buffer (tk::unit calls it)
///   after_forward(u)    the buffer released (its views stay; FSDP2's reshard_after_forward):
///                       the graph's saved parameters are those views, and see the values again
///                       once the backward gathers them
///   before_backward(u)  gathered again, when the gradient reaches one of the unit's outputs
///   ready(i)            parameter i's gradient accumulated (its post-accumulate-grad hook):
///                       the unit's buffer released after its last parameter's
///   release_all()       after the backward: the units whose parameters got no gradient too
///   hold()              every unit gathered until release_held() (the fit loop's validation,
///                       whose forwards the ranks may run in different numbers)
/// What no unit holds (the root unit: embeddings' neighbours, heads, norms at the top) is one
/// unit that is never released: it is gathered after every update and every load.
/// Every rank gathers in the order of its forward and backward, which the same model and
/// graph make the same on every rank (a unit called on some ranks only would hang them).
#include <trainkit/detail/partition.hpp>
#include <trainkit/detail/released_storage.hpp>
#include <trainkit/detail/unit_schedule.hpp>
#include <trainkit/step/replicas.hpp>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace trainkit::detail {

class ShardedUnits final : public UnitSchedule {
 public:
  struct Unit {
    std::string name;                             ///< its module path ("" for the root unit)
    const torch::nn::Module* module = nullptr;    ///< null for the root unit
    std::int64_t bucket = 0;                      ///< its bucket of the partition
    torch::Tensor buffer;                         ///< the bucket's elements, whole when gathered
    std::int64_t members = 0;                     ///< trainable parameters in it
    bool whole = false;                           ///< the root unit: never released
  };

  /// `units`: their buffers hold their values (gathered); `member_of[i]`: the unit of the
  /// storage's parameter i; `local`: this rank's slices (its buffer lives as long as the storage).
  ShardedUnits(std::vector<Unit> units, std::vector<std::int64_t> member_of, Replicas& replicas, Partition partition,
               torch::Tensor local)
      : units_(std::move(units)), member_of_(std::move(member_of)), replicas_(&replicas),
        partition_(std::move(partition)), local_(std::move(local)), gathered_(units_.size(), true),
        waiting_(units_.size(), 0) {
    for (size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].module) modules_[units_[u].module] = static_cast<std::int64_t>(u);
      if (!units_[u].whole) now_ += units_[u].buffer.numel();
    }
    peak_ = now_;
  }

  std::int64_t unit_of(const torch::nn::Module& module) const override {
    const auto it = modules_.find(&module);
    return it == modules_.end() ? -1 : it->second;
  }
  void before_forward(std::int64_t u) override { gather(u); }
  void after_forward(std::int64_t u) override { release(u); }
  void before_backward(std::int64_t u) override { gather(u); }

  /// A backward starts: every unit's parameters' gradients are to come.
  void arm() {
    for (size_t u = 0; u < units_.size(); ++u) waiting_[u] = units_[u].members;
    fired_.assign(member_of_.size(), false);
  }
  /// Parameter i's gradient is accumulated (the autograd engine's thread).
  void ready(size_t i) {
    if (fired_.size() != member_of_.size() || fired_[i]) return;  // (not armed; a second accumulation)
    fired_[i] = true;
    const auto u = member_of_[i];
    if (--waiting_[static_cast<size_t>(u)] == 0) release(u);
  }
  /// After a backward, or before the update: only the root unit stays gathered.
  void release_all() {
    fired_.clear();
    for (size_t u = 0; u < units_.size(); ++u) release(static_cast<std::int64_t>(u));
  }
  /// The root unit gathered again from every rank's slices (after an update or a load); the
  /// others released.
  void refresh() {
    release_all();
    for (size_t u = 0; u < units_.size(); ++u)
      if (units_[u].whole) {
        gathered_[u] = false;
        gather(static_cast<std::int64_t>(u));
      }
  }
  /// Every unit gathered (one all-gather each, in unit order: every rank calls it) and kept so
  /// until release_held(): a region whose forwards differ in number between the ranks
  /// (validation over uneven shards) then makes no collective.
  void hold() {
    for (size_t u = 0; u < units_.size(); ++u) gather(static_cast<std::int64_t>(u));
    held_ = true;
  }
  void release_held() {
    held_ = false;
    release_all();
  }
  bool held() const { return held_; }
  /// The storage is gone: later calls (a graph outliving it) throw.
  void close() { replicas_ = nullptr; }

  const std::vector<Unit>& units() const { return units_; }
  /// All-gathers of units since construction.
  std::int64_t gathers() const { return gathers_; }
  /// The most elements gathered at once outside the root unit, since construction.
  std::int64_t peak_gathered() const { return peak_; }

 private:
  void gather(std::int64_t u) {
    auto& unit = units_[static_cast<size_t>(u)];
    if (gathered_[static_cast<size_t>(u)]) return;
    if (!replicas_)
      throw std::logic_error("tk::unit: unit '" + unit.name + "' belongs to a trainer that is gone; its parameters "
                             "were sharded (ZeRO stage 3) and exist no more in this process");
    allocate_released(unit.buffer, /*zero=*/false);
    const auto b = unit.bucket;
    const auto n = partition_.bucket(b).length / partition_.world_size();
    replicas_->gather_bucket(local_.narrow(0, partition_.local(b), n), unit.buffer,
                             "all-gather of unit " + (unit.name.empty() ? std::string("(root)") : "'" + unit.name + "'") +
                                 " (" + std::to_string(b + 1) + "/" + std::to_string(partition_.buckets()) + ")");
    gathered_[static_cast<size_t>(u)] = true;
    ++gathers_;
    if (!unit.whole) {
      now_ += unit.buffer.numel();
      peak_ = std::max(peak_, now_);
    }
  }
  void release(std::int64_t u) {
    const auto& unit = units_[static_cast<size_t>(u)];
    if (unit.whole || held_ || !gathered_[static_cast<size_t>(u)]) return;
    release_storage(unit.buffer);
    gathered_[static_cast<size_t>(u)] = false;
    now_ -= unit.buffer.numel();
  }

  std::vector<Unit> units_;
  std::vector<std::int64_t> member_of_;
  Replicas* replicas_;
  Partition partition_;
  torch::Tensor local_;
  std::unordered_map<const torch::nn::Module*, std::int64_t> modules_;
  std::vector<bool> gathered_;
  std::vector<std::int64_t> waiting_;
  std::vector<bool> fired_;
  std::int64_t gathers_ = 0, now_ = 0, peak_ = 0;
  bool held_ = false;
};

}  // namespace trainkit::detail
