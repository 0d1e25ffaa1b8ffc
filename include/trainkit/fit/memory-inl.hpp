#pragma once
/// The definitions of trainkit/fit/memory.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/fit/memory.hpp>

namespace trainkit {
namespace detail {

TRAINKIT_INLINE double proc_status_bytes(const char* name) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(name) + ":";
  while (std::getline(status, line))
    if (line.rfind(prefix, 0) == 0) return std::stod(line.substr(prefix.size())) * 1024.0;
  return -1;
}

TRAINKIT_INLINE std::string mib_text(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f MiB", bytes / (1024.0 * 1024.0));
  return buf;
}

}  // namespace detail
}  // namespace trainkit
namespace trainkit {

TRAINKIT_INLINE bool PeakMemory::available() const {
  if (!device_.is_cpu()) return true;
  return static_cast<bool>(std::ofstream("/proc/self/clear_refs"));
}

TRAINKIT_INLINE void PeakMemory::reset() const {
  if (device_.is_cpu()) {
    std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM := VmRSS
  } else {
    c10::getDeviceAllocator(device_.type())->resetPeakStats(index());
  }
}

TRAINKIT_INLINE double PeakMemory::bytes() const {
  if (device_.is_cpu()) return detail::proc_status_bytes("VmHWM");
  const auto stats = c10::getDeviceAllocator(device_.type())->getDeviceStats(index());
  return static_cast<double>(
      stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak);
}

TRAINKIT_INLINE double device_memory_bytes(torch::Device device) {
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

TRAINKIT_INLINE double memory_budget_bytes(double budget, torch::Device device) {
  if (budget < 0) throw ConfigError("TRAIN.MEMORY_BUDGET", "must be >= 0, got " + std::to_string(budget));
  if (budget == 0) return 0;
  return budget <= 1 ? budget * device_memory_bytes(device) : budget;
}

TRAINKIT_INLINE std::int64_t MemoryPlan::pieces_for(std::int64_t items) const {
  return piece_items <= 0 ? 1 : std::max<std::int64_t>(1, (items + piece_items - 1) / piece_items);
}

TRAINKIT_INLINE std::string MemoryPlan::text() const {
  std::ostringstream s;
  s << "memory plan: budget " << detail::mib_text(budget_bytes) << " (TRAIN.MEMORY_BUDGET; "
    << static_cast<int>(std::lround(margin * 100)) << "% kept free); forward+backward measured at";
  for (const auto& [items, bytes] : measured) s << " " << detail::items_text(items) << ": " << detail::mib_text(bytes) << ";";
  char per_item[32];
  std::snprintf(per_item, sizeof per_item, "%.2f", bytes_per_item / (1024.0 * 1024.0));
  s << " about " << per_item << " MiB per item over " << detail::mib_text(base_bytes) << ". Micro-batches of "
    << batch_items << " items run as " << pieces_for(batch_items) << " piece(s) of at most " << detail::items_text(piece_items)
    << " (the optimizer step is the whole micro-batch's); measuring took " << std::lround(seconds * 1000) << " ms";
  if (!optimizer_state_counted)
    s << ". Not counted: the torch::optim optimizer's state, which it makes at its first step (trainkit's own "
         "optimizers, tk::AdamW and the others, are measured with theirs)";
  return s.str();
}

TRAINKIT_INLINE MemoryPlan plan_pieces(std::int64_t batch_items, std::vector<std::pair<std::int64_t, double>> measured,
                                       double budget_bytes, double margin) {
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
