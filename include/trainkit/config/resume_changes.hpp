#pragma once
/// What changed between the configuration a checkpoint was written with and the one resuming
/// it, restricted to the keys that change the training trajectory (the fit loop refuses those
/// unless TRAIN.RESUME_CHANGES is allow).
///
/// Free to change on resume: how long (TRAIN.END_EPOCH, BEGIN_EPOCH), how often and where
/// (LOG_FREQUENT, VAL_FREQUENT, CHECKPOINT_FREQUENT, TRAIN.CHECKPOINT_KEEP, CHECKPOINT_BACKGROUND, OUTPUT_PATH), how
/// to resume (TRAIN.RESUME, AUTO_RESUME, RESUME_CHANGES), on which devices (GPUS, DIST_TIMEOUT,
/// DIST_HEARTBEAT, NUM_WORKERS_PER_GPU), how much memory (TRAIN.MEMORY_BUDGET, PIECE_ITEMS: pieces of a
/// micro-batch change rounding, not the step), evaluation (VAL.*, TEST.*), reporting (TRAIN.LOSS_LOGGERS,
/// NONFINITE_PATIENCE, FORWARD_PEAKS) and the initial weights (NETWORK.PARTIAL_PRETRAIN and its prefix
/// changes: a resume takes the weights from the checkpoint). Every other key, an application's
/// included, is taken to change the trajectory.
#include <trainkit/detail/inline.hpp>
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
bool changes_freely(const std::string& key);

namespace detail {
void flatten_config(const nlohmann::json& v, const std::string& path, std::map<std::string, std::string>& out);
}  // namespace detail

/// The keys that change the trajectory and differ between two resolved configurations (JSON
/// text, Config::dump), in key order. Text that does not parse counts as one change of "(config)".
std::vector<ConfigChange> resume_changes(const std::string& before_json, const std::string& after_json);

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/config/resume_changes-inl.hpp>
#endif
