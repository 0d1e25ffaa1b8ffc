#pragma once
/// The bytes one rank holds between optimizer steps, predicted from the model's size before
/// anything is allocated: its parameters, gradients, fp32 masters and optimizer state, by ZeRO
/// stage and world size. No LibTorch: trainkit-config prints it from a count alone.
///
///   tk::ModelSize model{.trained = 110'000'000};
///   tk::StorageShape shape;  // FP32; optimizer_values = StorageShape::optimizer_values_of(settings)
///   const tk::HeldBytes held = tk::predict_held(model, shape, 2, 4);
///   held.total();   // bytes on each of 4 ranks at ZeRO stage 2
///
/// A trainer predicts its own (Trainer::predicted_held, from its layout and units) and measures
/// what it holds (Trainer::held_bytes); tests hold the two equal. What the prediction leaves out
/// on purpose: the padding of buckets and units (at most 64 bytes per rank and bucket), the
/// norms that master weights keep in fp32 (2 bytes more each), and what exists only inside a
/// step (a sharded gradient's slices, buckets in flight, stage 3's gathered units: `gathered`
/// gives the largest one; autocast's half copies of stage 3's units: `autocast`).
#include <trainkit/detail/inline.hpp>
#include <trainkit/step/optimizer_settings.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace trainkit {

/// What the prediction needs of a model, in parameters (elements).
struct ModelSize {
  std::int64_t trained = 0;       ///< the parameters the trainer updates
  std::int64_t root = 0;          ///< of them, those in no unit of stage 3 (kept whole on every rank)
  std::int64_t largest_unit = 0;  ///< the most parameters one unit of stage 3 holds (gathered one at a time)
  std::int64_t frozen = 0;        ///< the parameters it does not update (the model keeps them whole)
  /// Whether the units are known (named and resolved): stage 3 can be predicted.
  bool units_known() const { return largest_unit > 0; }
};

/// How a trainer stores its parameters: the precision's element size and the optimizer's state.
struct StorageShape {
  bool master_weights = false;        ///< half parameters and gradients (2 bytes), fp32 masters (4)
  std::int64_t optimizer_values = 2;  ///< fp32 values of optimizer state per parameter (-1: not known,
                                      ///< a torch::optim optimizer's own state; counted as none)
  bool accumulates = false;           ///< several micro-batches per window
  std::int64_t unit_prefetch = 1;     ///< stage 3: units gathered ahead (TrainerOptions::unit_prefetch)
  bool reshard_after_forward = true;  ///< stage 3: units released after their forward
  bool autocast_copies = false;       ///< the forward autocasts fp32 weights to a half type (FP16 or
                                      ///< BF16 without master weights): autocast keeps each weight's
                                      ///< half copy from its forward to its backward
  bool overlap_reduction = true;      ///< stage 3: each unit's gradient reduced as the backward leaves
                                      ///< it (TrainerOptions::overlap_reduction); false: after it

  /// The fp32 values per parameter of the optimizer `settings` name: Adam and AdamW 2 (their
  /// moments), SGD 1 with momentum, 0 without.
  static std::int64_t optimizer_values_of(const OptimizerSettings& settings) {
    if (settings.name == "SGD") return settings.momentum != 0 ? 1 : 0;
    return 2;
  }
};

/// Bytes one rank holds between optimizer steps, by kind.
struct HeldBytes {
  double parameters = 0;  ///< the model's parameters, and with stage 3 this rank's slices of them
  double gradients = 0;   ///< the gradient (none kept between steps at stages 2 and 3)
  double masters = 0;     ///< master weights' fp32 copy (this rank's slices at stages 1-3)
  double optimizer = 0;   ///< the optimizer's state (this rank's slices at stages 1-3)
  double gathered = 0;    ///< stage 3, on top inside a step: the units gathered at once (the
                          ///< largest, and as many ahead as prefetched; every unit when kept)
  double autocast = 0;    ///< stage 3 with autocast's copies, on top inside a step: every unit's
                          ///< half copy, from its forward to its backward (2 bytes a parameter:
                          ///< the units' whole model again, which master weights avoid)
  double unit_gradients = 0;  ///< stage 3, on top inside a backward: the units' fp32 gradients until
                              ///< each is reduce-scattered (the unit the backward fills and two in
                              ///< flight, DataParallel's limit; every unit's without the overlap)
  double total() const { return parameters + gradients + masters + optimizer; }
};

/// What `model` stored as `shape` holds per rank at ZeRO `stage` (0-3) over `world` ranks.
/// `stage` is what the run shards: one rank shards nothing (pass 0), unless its replicas cut a
/// world of one as several (DataParallel::shard_at_world_size_one); Trainer::predicted_held
/// passes what its replicas do. Stage 3 needs the units (model.units_known()).
TRAINKIT_INLINE HeldBytes predict_held(const ModelSize& model, const StorageShape& shape, int stage, std::int64_t world);

/// Whether stage 3 can be predicted (and run) for `model` stored as `shape`: its units are
/// known (every storage shape: master weights' half units too).
inline bool predicts_stage3(const ModelSize& model, const StorageShape& shape) {
  (void)shape;  // (every storage shape: master weights too)
  return model.units_known();
}

/// The prediction for stages 0-3 over 1, 2, 4, 8 and `world` ranks as lines of text, one per
/// world size, for a log: "  4 ranks: stage 0 1.61 GiB, 1 ..., 2 ..., 3 ... (+ 12.0 MiB gathered)"
/// (stage 3 only where predicts_stage3).
TRAINKIT_INLINE std::vector<std::string> held_table(const ModelSize& model, const StorageShape& shape, std::int64_t world);

/// One line for a run's log: what each rank will hold at `stage` (as predict_held takes it) over
/// `world` ranks, by kind, and what the other stages would hold there.
TRAINKIT_INLINE std::string held_summary(const ModelSize& model, const StorageShape& shape, int stage, std::int64_t world);

/// `bytes` as "512.0 MiB" / "1.61 GiB" / "800 B".
TRAINKIT_INLINE std::string format_bytes(double bytes);

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/held_bytes-inl.hpp>
#endif
