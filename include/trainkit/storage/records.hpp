#pragma once
/// A storage's checkpoint records, one per parameter name: `model.param.<name>` (the fp32 values
/// the update writes: the parameters, or the masters) and `optim.<kind>.<name>` (the rule's flat
/// state), each with the parameter's shape, whatever the layout, the grouping or the world size
/// (docs/design/storage.md). What the modes and both storages share: records from a buffer in
/// the flat layout, the frozen parameters (those the trainer does not hold), the shape check
/// before anything is read. A mode writes and reads its own local buffers through these
/// (ShardingMode::write_local, read_local).
#include <trainkit/archive/checkpoint_io.hpp>
#include <trainkit/storage/placement.hpp>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace trainkit::detail {

/// `global` (a buffer in the flat layout, on any device) as one record per parameter: `prefix`
/// + name, with the parameter's shape.
inline void write_by_name(torch::serialize::OutputArchive& archive, const std::vector<PlacedParameter>& placed,
                          const std::string& prefix, const torch::Tensor& global) {
  for (const auto& e : placed)
    write_tensor(archive, prefix + e.name, global.narrow(0, e.offset, e.param.numel()).view(e.param.sizes()));
}

/// Throws naming the first record `prefix` + name that is missing or whose shape is not its
/// parameter's.
inline void check_records(torch::serialize::InputArchive& archive, const std::vector<PlacedParameter>& placed,
                          const std::string& prefix) {
  for (const auto& e : placed) {
    const auto shape = tensor_shape(archive, prefix + e.name);
    if (!shape) throw missing_record(prefix + e.name);
    if (c10::IntArrayRef(*shape) != e.param.sizes())
      throw std::runtime_error("checkpoint record '" + prefix + e.name + "' has shape " + shape_string(*shape) +
                               ", this run needs " + shape_string(e.param.sizes()));
  }
}

/// Every parameter of `module` as it is, in the module's order (model.param.<name>).
inline void write_module_parameters(torch::serialize::OutputArchive& archive, torch::nn::Module& module) {
  for (const auto& p : module.named_parameters(true)) write_tensor(archive, "model.param." + p.key(), p.value());
}
inline void read_module_parameters(torch::serialize::InputArchive& archive, torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (const auto& p : module.named_parameters(true)) read_into(archive, "model.param." + p.key(), p.value());
}

/// The parameters the trainer does not hold (frozen: no requires_grad), as they are.
inline void write_frozen(torch::serialize::OutputArchive& archive, torch::nn::Module& module) {
  for (const auto& p : module.named_parameters(true))
    if (!p.value().requires_grad()) write_tensor(archive, "model.param." + p.key(), p.value());
}
inline void read_frozen(torch::serialize::InputArchive& archive, torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (const auto& p : module.named_parameters(true))
    if (!p.value().requires_grad()) read_into(archive, "model.param." + p.key(), p.value());
}

/// Whether a checkpoint inside a window holds the reduced sum of its micro-batches
/// (window.gradient_reduced.<name>: written with the gradients sharded, stages 2 and 3) rather
/// than a storage's own window records.
inline bool holds_reduced_window(torch::serialize::InputArchive& archive, const std::vector<PlacedParameter>& placed) {
  return !placed.empty() && tensor_shape(archive, "window.gradient_reduced." + placed.front().name);
}

/// Throws unless the window records of `archive` are of the kind this run writes (`reduced`:
/// the reduced sum, stages 2 and 3).
inline void check_window_kind(torch::serialize::InputArchive& archive, const std::vector<PlacedParameter>& placed,
                              bool reduced) {
  const bool held = holds_reduced_window(archive, placed);
  if (held != reduced)
    throw std::runtime_error(std::string("it was written inside a window (PARTIAL_WINDOW: span) ") +
                             (held ? "with gradients sharded (TRAIN.ZERO_STAGE: 2), and this run does not shard them"
                                   : "without sharded gradients, and this run shards them (TRAIN.ZERO_STAGE: 2)") +
                             "; resume with the checkpoint's TRAIN.ZERO_STAGE, or from a checkpoint at a window's end");
}

}  // namespace trainkit::detail
