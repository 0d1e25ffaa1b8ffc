#pragma once
/// The definitions of trainkit/loss_loggers.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/loss_loggers.hpp>

namespace trainkit {

TRAINKIT_INLINE LossLoggers LossLoggers::from(const Config& config) {
  std::vector<Logger> loggers;
  for (const auto& entry : config.tree()["TRAIN"]["LOSS_LOGGERS"]) {
    const std::string text = entry.get<std::string>();  // "key,Name" (the schema checked the comma)
    const auto comma = text.find(',');
    loggers.push_back({text.substr(0, comma), text.substr(comma + 1)});
  }
  return LossLoggers(std::move(loggers));
}

TRAINKIT_INLINE const LossLoggers& LossLoggers::require(const std::vector<std::string>& outputs) const {
  for (std::size_t i = 0; i < loggers_.size(); ++i) {
    bool known = false;
    for (const auto& o : outputs) known |= o == loggers_[i].output;
    if (known) continue;
    std::string listed;
    for (const auto& o : outputs) listed += (listed.empty() ? "" : ", ") + o;
    throw ConfigError("TRAIN.LOSS_LOGGERS[" + std::to_string(i) + "]",
                      "no output '" + loggers_[i].output + "' to log; this task's outputs are: " + (listed.empty() ? "none" : listed));
  }
  return *this;
}

TRAINKIT_INLINE void LossLoggers::add(Metrics& metrics, const std::map<std::string, torch::Tensor>& outputs,
                                      double weight) const {
  for (const auto& l : loggers_) {
    const auto it = outputs.find(l.output);
    TORCH_CHECK(it != outputs.end(), "LossLoggers: the task gave no output '", l.output, "' (TRAIN.LOSS_LOGGERS)");
    metrics.add(l.name, it->second.detach(), weight);
  }
}

}  // namespace trainkit
