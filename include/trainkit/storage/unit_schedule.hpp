#pragma once
/// What a stage-3 storage does at its units' boundaries (tk::unit, trainer/unit.hpp, calls it):
/// the interface, the schedule active on a thread (the trainer's step sets it), and the
/// schedules alive in the process, through which a unit called outside any step finds whether
/// its parameters are there (held gathered) or refuses.
#include <torch/nn/module.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace trainkit::detail {

/// See the file comment. The hooks of the backward hold it by shared_ptr: it outlives the graph
/// that calls them.
class UnitSchedule {
 public:
  virtual ~UnitSchedule() = default;
  /// The unit `module` is (an index), or -1 when it is none.
  virtual std::int64_t unit_of(const torch::nn::Module& module) const = 0;
  virtual void before_forward(std::int64_t unit) = 0;
  virtual void after_forward(std::int64_t unit) = 0;
  virtual void before_backward(std::int64_t unit) = 0;
  /// Whether every unit is held gathered (a call outside a step may then run).
  virtual bool held() const { return false; }
  /// Whether an evaluation by unit is open (a call outside a step then gathers its unit, with
  /// before_forward and after_forward).
  virtual bool evaluating() const { return false; }
};

/// The schedule of the forward running on this thread (null: none).
inline std::shared_ptr<UnitSchedule>& active_unit_schedule() {
  thread_local std::shared_ptr<UnitSchedule> schedule;
  return schedule;
}

/// RAII: `schedule` active on this thread for the region, the previous one after.
class UnitScheduleScope {
 public:
  explicit UnitScheduleScope(std::shared_ptr<UnitSchedule> schedule)
      : previous_(std::exchange(active_unit_schedule(), std::move(schedule))) {}
  ~UnitScheduleScope() { active_unit_schedule() = std::move(previous_); }
  UnitScheduleScope(const UnitScheduleScope&) = delete;
  UnitScheduleScope& operator=(const UnitScheduleScope&) = delete;

 private:
  std::shared_ptr<UnitSchedule> previous_;
};

/// The stage-3 schedules alive in this process (a storage registers its own while it shards
/// parameters). `count` is read on every tk::unit call outside a step: zero in a process that
/// shards nothing, so the call then costs one atomic load.
struct UnitRegistry {
  std::atomic<int> count{0};
  std::mutex mutex;
  std::vector<std::weak_ptr<UnitSchedule>> schedules;

  static UnitRegistry& get() {
    static UnitRegistry registry;
    return registry;
  }
  void add(const std::shared_ptr<UnitSchedule>& s) {
    const std::lock_guard<std::mutex> lock(mutex);
    schedules.push_back(s);
    count = static_cast<int>(schedules.size());
  }
  void remove(const UnitSchedule* s) {
    const std::lock_guard<std::mutex> lock(mutex);
    std::vector<std::weak_ptr<UnitSchedule>> kept;
    for (auto& w : schedules) {
      const auto p = w.lock();
      if (p && p.get() != s) kept.push_back(std::move(w));
    }
    schedules = std::move(kept);
    count = static_cast<int>(schedules.size());
  }
  /// The schedule whose unit `module` is, and the unit; {null, -1} when none.
  std::pair<std::shared_ptr<UnitSchedule>, std::int64_t> find(const torch::nn::Module& module) {
    if (count.load(std::memory_order_relaxed) == 0) return {nullptr, -1};
    const std::lock_guard<std::mutex> lock(mutex);
    for (const auto& w : schedules)
      if (auto p = w.lock())
        if (const auto u = p->unit_of(module); u >= 0) return {std::move(p), u};
    return {nullptr, -1};
  }
};

}  // namespace trainkit::detail
