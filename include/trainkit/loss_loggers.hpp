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
#include <trainkit/detail/inline.hpp>
#include <trainkit/config.hpp>
#include <trainkit/metrics.hpp>

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

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/loss_loggers-inl.hpp>
#endif
