#pragma once
/// What the fit loop (fit.hpp) tells callbacks and asks of them: BatchEnd after each micro-batch,
/// EpochEnd after each epoch, and Callbacks, the set tk::fit takes. Callbacks of trainkit's own
/// (early stopping) are in callbacks.hpp.
#include <trainkit/fit/checkpoint.hpp>
#include <trainkit/step/step_report.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace trainkit {

/// After each micro-batch. A callback may ask for a checkpoint (written at the next window
/// boundary) or a stop (a checkpoint, then fit returns).
struct BatchEnd {
  std::int64_t epoch = 0, index = 0, batches = 0;  ///< micro-batch `index` of `batches` just ran
  const MicroStepResult* step = nullptr;           ///< its result (a report when a window closed)
  bool request_checkpoint = false;
  bool request_stop = false;
};
/// After each epoch (after validation, before its checkpoint).
struct EpochEnd {
  std::int64_t epoch = 0;
  std::map<std::string, double> train;       ///< the epoch's means: "Loss" and the task's metrics
  std::map<std::string, double> validation;  ///< empty when this epoch did not validate
  bool request_checkpoint = false;
  bool request_stop = false;   ///< stop now, continue when run again (as a signal does)
  /// Training is done (early stopping): the checkpoint is marked finished, and a run of the
  /// same command in this directory trains no further. finish_reason says why (it is printed).
  bool request_finish = false;
  std::string finish_reason;
};
struct Callbacks {
  std::function<void(BatchEnd&)> batch_end;
  std::function<void(EpochEnd&)> epoch_end;
  /// Every scalar the loop logs, as it logs it (besides the files): tag, value, step.
  std::function<void(const std::string& tag, double value, std::int64_t step)> scalar;
  std::vector<CallbackState> state;
};

}  // namespace trainkit
