#pragma once
/// What changed between the configuration a checkpoint was written with and the one resuming
/// it, restricted to the keys that change the training trajectory (the fit loop refuses those
/// unless TRAIN.RESUME_CHANGES is allow).
///
/// Free to change on resume: how long (TRAIN.END_EPOCH, BEGIN_EPOCH), how often and where
/// (LOG_FREQUENT, VAL_FREQUENT, CHECKPOINT_FREQUENT, TRAIN.CHECKPOINT_KEEP, OUTPUT_PATH), how
/// to resume (TRAIN.RESUME, AUTO_RESUME, RESUME_CHANGES), on which devices (GPUS, DIST_TIMEOUT,
/// DIST_HEARTBEAT, NUM_WORKERS_PER_GPU), how much memory (TRAIN.MEMORY_BUDGET: pieces of a
/// micro-batch change rounding, not the step), evaluation (VAL.*, TEST.*), reporting (TRAIN.LOSS_LOGGERS,
/// NONFINITE_PATIENCE) and the initial weights (NETWORK.PARTIAL_PRETRAIN and its prefix
/// changes: a resume takes the weights from the checkpoint). Every other key, an application's
/// included, is taken to change the trajectory.
#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <string>
#include <vector>

namespace trainkit {

/// One key that differs: its dotted path and the values as JSON text ("(absent)" when missing).
struct ConfigChange {
  std::string key, before, after;
};

/// Whether `key` (a dotted path) may change between a run and its resume.
inline bool changes_freely(const std::string& key) {
  static const std::set<std::string> free = {
      "TRAIN.END_EPOCH", "TRAIN.BEGIN_EPOCH", "TRAIN.RESUME", "TRAIN.AUTO_RESUME", "TRAIN.RESUME_CHANGES",
      "TRAIN.CHECKPOINT_KEEP", "TRAIN.MEMORY_BUDGET", "TRAIN.ZERO_STAGE", "TRAIN.OVERLAP_REDUCTION", "TRAIN.NONFINITE_PATIENCE", "TRAIN.LOSS_LOGGERS", "OUTPUT_PATH", "LOG_FREQUENT",
      "VAL_FREQUENT", "CHECKPOINT_FREQUENT", "GPUS", "DIST_TIMEOUT", "DIST_HEARTBEAT", "NUM_WORKERS_PER_GPU",
      "NETWORK.PARTIAL_PRETRAIN", "NETWORK.PARTIAL_PRETRAIN_PREFIX_CHANGES"};
  if (free.count(key)) return true;
  for (const char* section : {"VAL.", "TEST."})
    if (key.rfind(section, 0) == 0) return true;
  return false;
}

namespace detail {
inline void flatten_config(const nlohmann::json& v, const std::string& path, std::map<std::string, std::string>& out) {
  if (v.is_object() && !v.empty()) {
    for (const auto& [k, x] : v.items()) flatten_config(x, path.empty() ? k : path + "." + k, out);
    return;
  }
  out[path] = v.dump();
}
}  // namespace detail

/// The keys that change the trajectory and differ between two resolved configurations (JSON
/// text, Config::dump), in key order. Text that does not parse counts as one change of "(config)".
inline std::vector<ConfigChange> resume_changes(const std::string& before_json, const std::string& after_json) {
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
