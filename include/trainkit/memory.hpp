#pragma once
/// Memory: how much one forward+backward needs, what a budget allows, and which errors mean
/// "out of memory". The fit loop uses these for TRAIN.MEMORY_BUDGET (a planned micro-batch)
/// and for replaying a window after an out-of-memory error (fit.hpp, "Memory").
///
///   tk::PeakMemory peak(device);        // CUDA: the caching allocator's peak allocated bytes;
///   peak.reset(); run(); peak.bytes();  // CPU: the process's peak resident set (VmHWM)
///   tk::device_memory_bytes(device)     // what a budget's fraction is of
///   tk::memory_budget_bytes(0.8, dev)   // a fraction, or bytes
///   tk::plan_pieces(items, measured, budget)  // the largest piece of a micro-batch that fits
///
/// Planning (plan_pieces) is a pure function of its measurements, so it is tested without a
/// device: the peak of one forward+backward is taken to grow linearly with the piece's items
/// (activations), over a base (the model, its gradient and optimizer state, the runtime). The
/// line is fitted to the measured points by least squares; the plan is the largest piece whose
/// predicted peak, and every measured peak at or below its size, stays within the budget less a
/// margin (10%: the optimizer phase's temporaries, the allocator's fragmentation, batches with
/// more items than the measured one).
#include <trainkit/config/error.hpp>

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <new>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

namespace trainkit {

namespace detail {

/// Whether `e` says that memory ran out: CUDA's c10::OutOfMemoryError, the CPU allocator's
/// "can't allocate memory", std::bad_alloc.
inline bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) || dynamic_cast<const std::bad_alloc*>(&e)) return true;
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e))
    return c10_error->msg().find("can't allocate memory") != std::string::npos;
  return false;
}

// A "Name:   12345 kB" line of /proc/self/status, in bytes (-1 when absent).
inline double proc_status_bytes(const char* name) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(name) + ":";
  while (std::getline(status, line))
    if (line.rfind(prefix, 0) == 0) return std::stod(line.substr(prefix.size())) * 1024.0;
  return -1;
}

/// "1 item", "8 items".
inline std::string items_text(std::int64_t n) { return std::to_string(n) + (n == 1 ? " item" : " items"); }

inline std::string mib_text(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f MiB", bytes / (1024.0 * 1024.0));
  return buf;
}

}  // namespace detail

/// The peak memory since reset() on one device. CUDA: the caching allocator's peak allocated
/// bytes (what tensors held; the CUDA context and the allocator's cache are not counted).
/// CPU: the whole process's peak resident set, VmHWM, which Linux resets through
/// /proc/self/clear_refs; available() is false where that file cannot be written.
class PeakMemory {
 public:
  explicit PeakMemory(torch::Device device) : device_(device) {}

  bool available() const {
    if (!device_.is_cpu()) return true;
    return static_cast<bool>(std::ofstream("/proc/self/clear_refs"));
  }
  void reset() const {
    if (device_.is_cpu()) {
      std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM := VmRSS
    } else {
      c10::getDeviceAllocator(device_.type())->resetPeakStats(index());
    }
  }
  /// Bytes at the peak since reset().
  double bytes() const {
    if (device_.is_cpu()) return detail::proc_status_bytes("VmHWM");
    const auto stats = c10::getDeviceAllocator(device_.type())->getDeviceStats(index());
    return static_cast<double>(
        stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak);
  }

 private:
  c10::DeviceIndex index() const { return device_.has_index() ? device_.index() : 0; }
  torch::Device device_;
};

/// The memory of `device` that a budget's fraction is of: a GPU's total memory; on the CPU the
/// machine's physical memory, or the cgroup's limit (containers) when that is lower.
inline double device_memory_bytes(torch::Device device) {
  if (!device.is_cpu())
    return static_cast<double>(c10::getDeviceAllocator(device.type())->getMemoryInfo(device.has_index() ? device.index() : 0).second);
  double bytes = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  std::ifstream limit("/sys/fs/cgroup/memory.max");  // cgroup v2; "max" when unlimited
  std::string text;
  if (limit >> text && text != "max") {
    try {
      bytes = std::min(bytes, std::stod(text));
    } catch (const std::exception&) {
    }
  }
  return bytes;
}

/// TRAIN.MEMORY_BUDGET to bytes: a value in (0, 1] is a fraction of device_memory_bytes, a
/// larger one is bytes. 0: no budget.
inline double memory_budget_bytes(double budget, torch::Device device) {
  if (budget < 0) throw ConfigError("TRAIN.MEMORY_BUDGET", "must be >= 0, got " + std::to_string(budget));
  if (budget == 0) return 0;
  return budget <= 1 ? budget * device_memory_bytes(device) : budget;
}

/// The share of a memory budget that plans keep free.
inline constexpr double kMemoryMargin = 0.1;

/// A plan: the largest piece of a micro-batch (in items) whose forward+backward fits the budget.
struct MemoryPlan {
  double budget_bytes = 0;         ///< the budget
  double margin = kMemoryMargin;   ///< the share of the budget kept free
  std::vector<std::pair<std::int64_t, double>> measured;  ///< (items of a piece, peak bytes), ascending
  double base_bytes = 0;     ///< the fitted line: peak ~ base_bytes + bytes_per_item x items
  double bytes_per_item = 0;
  std::int64_t batch_items = 0;  ///< the measured micro-batch's items
  std::int64_t piece_items = 0;  ///< the largest piece that fits; batch_items: no split
  double seconds = 0;            ///< what measuring cost

  /// Pieces a micro-batch of `items` items is split into.
  std::int64_t pieces_for(std::int64_t items) const {
    return piece_items <= 0 ? 1 : std::max<std::int64_t>(1, (items + piece_items - 1) / piece_items);
  }
  /// The line the fit loop prints and logs.
  std::string text() const {
    std::ostringstream s;
    s << "memory plan: budget " << detail::mib_text(budget_bytes) << " (TRAIN.MEMORY_BUDGET; "
      << static_cast<int>(std::lround(margin * 100)) << "% kept free); forward+backward measured at";
    for (const auto& [items, bytes] : measured) s << " " << detail::items_text(items) << ": " << detail::mib_text(bytes) << ";";
    char per_item[32];
    std::snprintf(per_item, sizeof per_item, "%.2f", bytes_per_item / (1024.0 * 1024.0));
    s << " about " << per_item << " MiB per item over " << detail::mib_text(base_bytes) << ". Micro-batches of "
      << batch_items << " items run as " << pieces_for(batch_items) << " piece(s) of at most " << detail::items_text(piece_items)
      << " (the optimizer step is the whole micro-batch's); measuring took " << std::lround(seconds * 1000) << " ms";
    return s.str();
  }
};

/// The plan from measurements of one forward+backward at several piece sizes (`measured`,
/// any order; at least one). Throws ConfigError(TRAIN.MEMORY_BUDGET) when not even one item
/// fits, naming the budget and the measured need.
inline MemoryPlan plan_pieces(std::int64_t batch_items, std::vector<std::pair<std::int64_t, double>> measured,
                              double budget_bytes, double margin = kMemoryMargin) {
  TORCH_CHECK(batch_items >= 1, "plan_pieces: the micro-batch needs at least one item, got ", batch_items);
  TORCH_CHECK(!measured.empty(), "plan_pieces: no measurement");
  std::sort(measured.begin(), measured.end());
  MemoryPlan plan;
  plan.budget_bytes = budget_bytes;
  plan.margin = margin;
  plan.measured = measured;
  plan.batch_items = batch_items;
  const double usable = budget_bytes * (1 - margin);
  // Least squares through the points; one point (or a flat or falling line, noise): the
  // conservative line through the origin and the largest point's bytes per item.
  const double n = static_cast<double>(measured.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [x, y] : measured) {
    sx += static_cast<double>(x), sy += y, sxx += static_cast<double>(x) * static_cast<double>(x);
    sxy += static_cast<double>(x) * y;
  }
  const double det = n * sxx - sx * sx;
  double slope = det > 0 ? (n * sxy - sx * sy) / det : 0;
  double base = det > 0 ? (sy - slope * sx) / n : 0;
  if (!(slope > 0)) {
    slope = measured.back().second / static_cast<double>(measured.back().first);
    base = 0;
  }
  plan.base_bytes = base;
  plan.bytes_per_item = slope;
  std::int64_t fits = static_cast<std::int64_t>(std::floor((usable - base) / slope));
  fits = std::min(fits, batch_items);
  for (const auto& [items, bytes] : measured)  // a measured peak over the budget caps the plan
    if (bytes > usable) fits = std::min(fits, items - 1);
  if (fits < 1) {
    const double need = measured.front().first == 1 ? measured.front().second : base + slope;
    throw ConfigError("TRAIN.MEMORY_BUDGET",
                      "the budget of " + detail::mib_text(budget_bytes) + " (" + detail::mib_text(usable) +
                          " after the " + std::to_string(std::lround(margin * 100)) +
                          "% margin) cannot hold the forward+backward of one item: it measured " +
                          detail::mib_text(need) + ". Raise TRAIN.MEMORY_BUDGET, recompute activations "
                          "(tk::recompute), or use half precision");
  }
  plan.piece_items = fits;
  return plan;
}

}  // namespace trainkit
