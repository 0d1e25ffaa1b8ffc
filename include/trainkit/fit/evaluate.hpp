#pragma once
/// An evaluation-only run (VL-BERT's test.py): the model's weights from a file, then the task's
/// validation on them, without a trainer, an optimizer or an output directory.
///
///   tk::Task<Batch> task = make_task();            // the same task as training's
///   auto metrics = tk::evaluate(*model, task, "output/model-0009.ckpt");
///   std::printf("Acc %.4f\n", metrics.at("Acc"));
#include <trainkit/fit/task.hpp>
#include <trainkit/io/weights.hpp>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

namespace trainkit {

/// Loads every weight of `model` from `weights` (a trainkit checkpoint, .safetensors or a
/// PyTorch state_dict: tk::load_weights), strictly (a weight missing from the file, or one the
/// model has no place for, is an error naming them, before anything is evaluated), puts the
/// model in eval mode and returns task.validate(epoch). The model stays where it is (move it to
/// its device before or after: the weights are copied into its tensors). One process: a
/// data-parallel task's validate sums over ranks itself.
template <class Batch>
std::map<std::string, double> evaluate(torch::nn::Module& model, Task<Batch>& task, const std::string& weights,
                                       std::int64_t epoch = 0) {
  if (!task.validate) throw std::invalid_argument("evaluate: the task has no validate function");
  load_weights(model, weights).require_complete(weights);
  model.eval();
  return task.validate(epoch);
}

}  // namespace trainkit
