#pragma once
/// The definitions of trainkit/storage/held_bytes.hpp (header-only: included by it; compiled
/// mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/held_bytes.hpp>

#include <algorithm>
#include <cstdio>
#include <stdexcept>

namespace trainkit {

TRAINKIT_INLINE HeldBytes predict_held(const ModelSize& model, const StorageShape& shape, int stage, std::int64_t world) {
  if (stage < 0 || stage > 3) throw std::invalid_argument("predict_held: stage must be 0-3, got " + std::to_string(stage));
  if (world < 1) throw std::invalid_argument("predict_held: world must be >= 1, got " + std::to_string(world));
  if (stage == 3 && !predicts_stage3(model, shape))
    throw std::invalid_argument("predict_held: stage 3 needs the model's units (ModelSize::largest_unit)");
  const double w = static_cast<double>(world), trained = static_cast<double>(model.trained);
  const double element = shape.master_weights ? 2 : 4;  // the model's parameters and gradients
  // What stage s shards is divided by the world size; the rest every rank holds whole
  // (docs/design/data-parallel.md, "Memory per rank").
  const double sharded_state = stage >= 1 ? trained / w : trained;
  HeldBytes held;
  held.parameters = element * (static_cast<double>(model.frozen) +
                               (stage == 3 ? trained / w + static_cast<double>(model.root) : trained));
  held.gradients = stage >= 2 ? 0 : element * trained;
  // Master weights sum a window's micro-batches in fp32 where the window is reduced once.
  if (shape.master_weights && shape.accumulates && stage < 2) held.gradients += 4 * trained;
  held.masters = shape.master_weights ? 4 * sharded_state : 0;
  held.optimizer = 4 * static_cast<double>(std::max<std::int64_t>(shape.optimizer_values, 0)) * sharded_state;
  if (stage == 3)
    held.gathered = element * (shape.reshard_after_forward
                                   ? static_cast<double>(model.largest_unit) * static_cast<double>(1 + shape.unit_prefetch)
                                   : trained - static_cast<double>(model.root));
  // Autocast casts each fp32 weight to half for its matmul and saves the cast for the backward:
  // at stage 3 every unit's copy lives from its forward to its backward, though its fp32 unit
  // was released (docs/design/data-parallel.md, "Memory per rank").
  if (stage == 3 && shape.autocast_copies && !shape.master_weights)
    held.autocast = 2 * (trained - static_cast<double>(model.root));
  // A unit's gradient is summed in fp32 (master weights' too) from its first parameter's
  // gradient until its reduce-scatter completes (storage/unit_gathers.hpp).
  if (stage == 3) {
    const double units = trained - static_cast<double>(model.root);
    held.unit_gradients =
        4 * (shape.overlap_reduction ? std::min(units, 3 * static_cast<double>(model.largest_unit)) : units);
  }
  return held;
}

TRAINKIT_INLINE std::string format_bytes(double bytes) {
  char buf[32];
  if (bytes >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024 * 1024));
  else if (bytes >= 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1024.0 * 1024));
  else if (bytes >= 1024.0) std::snprintf(buf, sizeof buf, "%.1f KiB", bytes / 1024.0);
  else std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  return buf;
}

TRAINKIT_INLINE std::string held_summary(const ModelSize& model, const StorageShape& shape, int stage, std::int64_t world) {
  const HeldBytes held = predict_held(model, shape, stage, world);
  char millions[32];
  std::snprintf(millions, sizeof millions, "%.2f M", static_cast<double>(model.trained) / 1e6);
  std::string line = "each rank will hold " + format_bytes(held.total()) + " between optimizer steps (" + millions +
                     " trained parameters";
  line += world > 1 ? ", ZeRO stage " + std::to_string(stage) + " over " + std::to_string(world) + " ranks" : "";
  line += ": parameters " + format_bytes(held.parameters) + ", gradients " + format_bytes(held.gradients);
  if (shape.master_weights) line += ", fp32 masters " + format_bytes(held.masters);
  line += ", optimizer state " +
          (shape.optimizer_values < 0 ? std::string("not counted (a torch::optim optimizer's own)")
                                      : format_bytes(held.optimizer)) +
          ")";
  if (held.gathered > 0) line += ", and " + format_bytes(held.gathered) + " more for the units gathered inside a step";
  if (held.unit_gradients > 0)
    line += ", and " + format_bytes(held.unit_gradients) + " more for the units' fp32 gradients inside a backward, " +
            (shape.overlap_reduction ? "until each is reduce-scattered" : "every unit's until the backward ends");
  if (held.autocast > 0)
    line += ", and " + format_bytes(held.autocast) + " more for autocast's half copies of every unit's weights, which "
            "live from each unit's forward to its backward (the units' whole model again, at 2 bytes a parameter: "
            "with tk::MasterWeights the units are gathered as half copies and autocast keeps none)";
  if (world > 1) {
    line += "; at stage";
    for (int other = 0, said = 0; other <= 3; ++other)
      if (other != stage && (other < 3 || predicts_stage3(model, shape)))
        line += (said++ ? ", " : " ") + std::to_string(other) + " " + format_bytes(predict_held(model, shape, other, world).total());
    if (stage != 3 && !predicts_stage3(model, shape))
      line += " (3: name the units to see it)";
  }
  return line;
}

TRAINKIT_INLINE std::vector<std::string> held_table(const ModelSize& model, const StorageShape& shape, std::int64_t world) {
  std::vector<std::int64_t> worlds = {1, 2, 4, 8, world};
  std::sort(worlds.begin(), worlds.end());
  worlds.erase(std::unique(worlds.begin(), worlds.end()), worlds.end());
  std::vector<std::string> lines;
  for (const auto w : worlds) {
    std::string line = (w < 10 ? "  " : " ") + std::to_string(w) + (w == 1 ? " rank:  " : " ranks: ");
    if (w == 1) {
      line += "every stage " + format_bytes(predict_held(model, shape, 0, 1).total());
    } else {
      for (int stage = 0; stage <= 2; ++stage)
        line += (stage == 0 ? "stage 0 " : ", " + std::to_string(stage) + " ") +
                format_bytes(predict_held(model, shape, stage, w).total());
      if (predicts_stage3(model, shape)) {
        const HeldBytes three = predict_held(model, shape, 3, w);
        line += ", 3 " + format_bytes(three.total()) + " (+ " + format_bytes(three.gathered) + " gathered, + " +
                format_bytes(three.unit_gradients) + " gradients" +
                (three.autocast > 0 ? ", + " + format_bytes(three.autocast) + " autocast's copies" : "") + ")";
      } else {
        line += ", 3 needs the units";
      }
    }
    lines.push_back(line);
  }
  return lines;
}

}  // namespace trainkit
