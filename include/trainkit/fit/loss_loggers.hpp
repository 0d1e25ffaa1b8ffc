#pragma once
/// TRAIN.LOSS_LOGGERS: which of a model's named outputs the fit loop logs, and under what name.
/// VL-BERT's "output_key,DisplayName" pairs: the output `output_key` (a scalar tensor) is added
/// to the loop's metrics as DisplayName, so it is logged as Train-DisplayName at each log window
/// and averaged over the epoch (EpochEnd::train).
///
///   const auto loggers = tk::LossLoggers::from(config).require({"mlm_loss", "mvrc_loss"});
///   task.loss = [&](const Batch& b, tk::Metrics& m) {
///     auto out = model->forward(b);
///     loggers.add(m, {{"mlm_loss", out.mlm_loss}, {"mvrc_loss", out.mvrc_loss}});
///     return out.loss;
///   };
#include <trainkit/config/config.hpp>
#include <trainkit/fit/metrics.hpp>

#include <torch/types.h>

#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

class LossLoggers {
 public:
  struct Logger {
    std::string output;  ///< the task's output key
    std::string name;    ///< the metric's name (logged as Train-<name>)
  };

  LossLoggers() = default;
  explicit LossLoggers(std::vector<Logger> loggers) : loggers_(std::move(loggers)) {}
  /// tk::LossLoggers loggers{{"mlm_loss", "MLMLoss"}, {"mvrc_loss", "MVRCLoss"}};
  LossLoggers(std::initializer_list<Logger> loggers) : loggers_(loggers) {}

  /// TRAIN.LOSS_LOGGERS of a validated configuration.
  static LossLoggers from(const Config& config);

  /// Every logger's output must be one of `outputs` (what the task's model gives); else a
  /// ConfigError naming TRAIN.LOSS_LOGGERS, the key and the outputs there are.
  const LossLoggers& require(const std::vector<std::string>& outputs) const;

  /// Adds each logged output to `metrics` with `weight` (the micro-batch's items).
  void add(Metrics& metrics, const std::map<std::string, torch::Tensor>& outputs, double weight = 1.0) const;

  const std::vector<Logger>& loggers() const noexcept { return loggers_; }
  bool empty() const noexcept { return loggers_.empty(); }

 private:
  std::vector<Logger> loggers_;
};

inline LossLoggers LossLoggers::from(const Config& config) {
  std::vector<Logger> loggers;
  for (const auto& entry : config.tree()["TRAIN"]["LOSS_LOGGERS"]) {
    const std::string text = entry.get<std::string>();  // "key,Name" (the schema checked the comma)
    const auto comma = text.find(',');
    loggers.push_back({text.substr(0, comma), text.substr(comma + 1)});
  }
  return LossLoggers(std::move(loggers));
}

inline const LossLoggers& LossLoggers::require(const std::vector<std::string>& outputs) const {
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

inline void LossLoggers::add(Metrics& metrics, const std::map<std::string, torch::Tensor>& outputs,
                             double weight) const {
  for (const auto& l : loggers_) {
    const auto it = outputs.find(l.output);
    TORCH_CHECK(it != outputs.end(), "LossLoggers: the task gave no output '", l.output, "' (TRAIN.LOSS_LOGGERS)");
    metrics.add(l.name, it->second.detach(), weight);
  }
}

}  // namespace trainkit
