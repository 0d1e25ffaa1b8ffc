#pragma once
/// The definitions of trainkit/config/resume_changes.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/config/resume_changes.hpp>

namespace trainkit {

TRAINKIT_INLINE bool changes_freely(const std::string& key) {
  static const std::set<std::string> free = {
      "TRAIN.END_EPOCH", "TRAIN.BEGIN_EPOCH", "TRAIN.RESUME", "TRAIN.AUTO_RESUME", "TRAIN.RESUME_CHANGES",
      "TRAIN.CHECKPOINT_KEEP", "TRAIN.CHECKPOINT_BACKGROUND", "TRAIN.CHECKPOINT_FORMAT", "TRAIN.MEMORY_BUDGET", "TRAIN.PIECE_ITEMS", "TRAIN.ZERO_STAGE", "TRAIN.UNITS", "TRAIN.UNIT_PREFETCH", "TRAIN.RESHARD_AFTER_FORWARD", "TRAIN.OVERLAP_REDUCTION", "TRAIN.NONFINITE_PATIENCE", "TRAIN.FORWARD_PEAKS", "TRAIN.LOSS_LOGGERS", "OUTPUT_PATH", "LOG_FREQUENT",
      "VAL_FREQUENT", "CHECKPOINT_FREQUENT", "GPUS", "DIST_TIMEOUT", "DIST_HEARTBEAT", "NUM_WORKERS_PER_GPU",
      "NETWORK.PARTIAL_PRETRAIN", "NETWORK.PARTIAL_PRETRAIN_PREFIX_CHANGES"};
  if (free.count(key)) return true;
  for (const char* section : {"VAL.", "TEST."})
    if (key.rfind(section, 0) == 0) return true;
  return false;
}

}  // namespace trainkit
namespace trainkit {
namespace detail {

TRAINKIT_INLINE void flatten_config(const nlohmann::json& v, const std::string& path,
                                    std::map<std::string, std::string>& out) {
  if (v.is_object() && !v.empty()) {
    for (const auto& [k, x] : v.items()) flatten_config(x, path.empty() ? k : path + "." + k, out);
    return;
  }
  out[path] = v.dump();
}

}  // namespace detail
}  // namespace trainkit
namespace trainkit {

TRAINKIT_INLINE std::vector<ConfigChange> resume_changes(const std::string& before_json,
                                                         const std::string& after_json) {
  std::map<std::string, std::string> before, after;
  try {
    detail::flatten_config(nlohmann::json::parse(before_json), "", before);
    detail::flatten_config(nlohmann::json::parse(after_json), "", after);
  } catch (const nlohmann::json::exception&) {
    return {{"(config)", "(unreadable)", "(unreadable)"}};
  }
  std::set<std::string> keys;
  for (const auto& [k, v] : before) keys.insert(k);
  for (const auto& [k, v] : after) keys.insert(k);
  std::vector<ConfigChange> changes;
  for (const auto& k : keys) {
    const auto b = before.find(k), a = after.find(k);
    const std::string bv = b == before.end() ? "(absent)" : b->second, av = a == after.end() ? "(absent)" : a->second;
    if (bv != av && !changes_freely(k)) changes.push_back({k, bv, av});
  }
  return changes;
}

}  // namespace trainkit
