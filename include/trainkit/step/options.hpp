#pragma once
/// Run-time numbers of a trainer: everything that is not a type. The policies choose *what*
/// happens in a step; these structs say *how much*. Fluent setters as in torch::optim
/// (`TrainerOptions().max_grad_norm(1.0).accumulation_steps(4)`); checked by `validate()`
/// before any work, with the option's name in the message.
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/loss_scale_defaults.hpp>
#include <torch/arg.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

/// End of epoch with a partial window (docs/design/optimizer-phase.md): `flush` steps on the k micro-batches it has
/// (mean over them), `span` carries the window into the next epoch, `drop` discards it.
enum class PartialWindow { flush, span, drop };
/// FP32/BF16 non-finite gradient: `skip` the step and count it, or `abort` with a diagnostic.
enum class NonFinite { skip, abort };
/// Master weights with data parallelism: the precision of the gradient all-reduce
/// (TrainerOptions::reduce_precision).
enum class ReducePrecision { automatic, fp32, half };
/// Data parallelism: what each rank keeps of the update (ZeRO's stages; TRAIN.ZERO_STAGE).
/// `none` (stage 0): every rank holds everything. `optimizer` (stage 1): the optimizer's state
/// and the fp32 master weights exist for this rank's slices of the parameters only; the
/// gradient is reduce-scattered into them and the updated parameters all-gathered.
/// `gradients` (stage 2): also the gradient, between windows (and the window's sum).
/// `parameters` (stage 3): also the parameters of the model's units (TrainerOptions::units):
/// each unit's are gathered before its forward and its backward and released after each
/// (trainer/unit.hpp; docs/design/data-parallel.md, "Sharding").
enum class Sharding { none, optimizer, gradients, parameters };

/// Loss-scale settings, defaults from detail/loss_scale_defaults.hpp (the configuration's FP16_*
/// keys take theirs from there too). Growth and backoff are torch.amp.GradScaler's. The floor
/// (min_scale 1) and the ceiling (max_scale 2^24) are trainkit's: a dynamic scale at its floor
/// whose gradient still overflows counts its skips towards FitOptions::nonfinite_patience, which
/// stops the run. With min_scale 0 and max_scale infinity (and hysteresis 1) the scale follows
/// GradScaler exactly; the clamps cost one clamp_ per window, hysteresis and the collapse check a
/// few more kernels.
struct LossScaleOptions {
  TORCH_ARG(double, init_scale) = detail::loss_scale_defaults::init_scale;          ///< FP16Dynamic initial scale
  TORCH_ARG(double, growth_factor) = detail::loss_scale_defaults::growth_factor;    ///< scale *= growth after growth_interval clean steps
  TORCH_ARG(double, backoff_factor) = detail::loss_scale_defaults::backoff_factor;  ///< scale *= backoff on overflow
  TORCH_ARG(std::int64_t, growth_interval) = detail::loss_scale_defaults::growth_interval;
  TORCH_ARG(std::int64_t, hysteresis) = detail::loss_scale_defaults::hysteresis;    ///< overflows in a row before the scale is cut
  TORCH_ARG(double, min_scale) = detail::loss_scale_defaults::min_scale;  ///< the floor (0: none)
  TORCH_ARG(double, max_scale) = detail::loss_scale_defaults::max_scale;  ///< the ceiling (infinity: none)
  /// > 0: throw when the scale sits at min_scale and overflows this many windows in a row.
  TORCH_ARG(std::int64_t, collapse_windows) = 0;
  TORCH_ARG(double, static_scale) = detail::loss_scale_defaults::static_scale;  ///< FP16Static's fixed scale
};

/// Everything a Trainer needs at run time besides the model and the optimizer.
struct TrainerOptions {
  TORCH_ARG(LossScaleOptions, loss_scale) = {};
  TORCH_ARG(double, max_grad_norm) = 1.0;            ///< ClipNorm's max norm
  TORCH_ARG(double, clip_value) = 1.0;               ///< ClipValue's bound
  TORCH_ARG(std::int64_t, accumulation_steps) = 1;   ///< AccumulationPolicy<Dynamic>'s N
  TORCH_ARG(PartialWindow, partial_window) = PartialWindow::flush;
  TORCH_ARG(NonFinite, nonfinite) = NonFinite::skip;
  /// Master weights (PrecisionPolicy<MasterWeights<T>>): keep the parameters and buffers of
  /// LayerNorm, GroupNorm, BatchNorm and InstanceNorm layers in fp32 (Apex O2's
  /// keep_batchnorm_fp32, on by default as there); false stores them in half as well.
  TORCH_ARG(bool, keep_norm_fp32) = true;
  /// Master weights: with one micro-batch per window in one process, a model with more
  /// parameters than this runs its optimizer phase in chunks of this many elements (rounded up
  /// to 64): the fp32 gradient exists one chunk at a time, not whole (4 bytes per parameter).
  /// Smaller models cast their gradient whole, in one pass.
  TORCH_ARG(std::int64_t, master_chunk) = std::int64_t{1} << 24;
  /// Master weights with data parallelism (tk::DataParallel): what a window of one
  /// micro-batch all-reduces. `half`: the model's half gradient as it is (half the bytes of
  /// fp32; each rank's part weighted to the mean first, so loss-scaled sums do not overflow),
  /// and the optimizer phase then runs in chunks as in one process. `fp32`: the gradient cast
  /// to fp32 whole first (4 more bytes per parameter at the phase's peak). `automatic`: half
  /// with FP16, whose half sum errs by about one more fp16 rounding, fp32 with BF16, whose
  /// would err several times more (measured: docs/guide/memory.md). A window of several
  /// micro-batches holds an fp32 sum, which is all-reduced in fp32 whatever this says.
  /// Without master weights the gradient is fp32 and only `automatic` or `fp32` are accepted.
  TORCH_ARG(ReducePrecision, reduce_precision) = ReducePrecision::automatic;
  /// Data parallelism with more than one rank: shard the update (Sharding; docs/guide/
  /// data-parallel.md). One process holds everything whatever this says. Needs trainkit's
  /// fused optimizers.
  TORCH_ARG(Sharding, sharding) = Sharding::none;
  /// Data parallelism: start reducing the gradient during the backward that closes a window
  /// (with Sharding::gradients during every backward), bucket by bucket as the parameters'
  /// gradients become ready, as DDP does; false reduces it after the backward. A rank that runs
  /// out of memory in such a backward after a bucket has left cannot replay its window alone:
  /// the run then stops with an error that says so. Master weights reduce after the backward.
  TORCH_ARG(bool, overlap_reduction) = true;
  /// Sharding::parameters: the model's units, by module path as named_modules() names them
  /// ("encoder.layer.3"); a path ending in ".*" names each child of that module
  /// ("encoder.layer.*"). Each unit's parameters are gathered for its forward and backward
  /// only, where the model calls it through tk::unit (trainer/unit.hpp); what no unit holds is
  /// kept whole on every rank. A path that names no module, or a unit inside another, is an
  /// error at construction. Ignored by the other shardings.
  using Units = std::vector<std::string>;
  TORCH_ARG(Units, units) = {};
  /// Sharding::parameters: how many units' all-gathers are launched ahead, while the units
  /// before them compute (the forward's next units in the forward, the backward's next in the
  /// backward, in the order of the step before); 0 gathers each unit when it is called. Each
  /// costs one more unit gathered at once. FSDP2's prefetch.
  TORCH_ARG(std::int64_t, unit_prefetch) = 1;
  /// Sharding::parameters: release a unit's parameters after its forward and gather them again
  /// for its backward (true: ZeRO-3's memory), or keep them from its forward to its backward
  /// (false: one all-gather per unit and micro-batch fewer, and every unit's parameters whole at
  /// the forward's end, as stage 2 holds them). FSDP2's reshard_after_forward.
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// Parameter groups: the first name-substring that matches a parameter's name sets its LR
  /// multiplier (VL-BERT's LR_MULT); unmatched parameters have multiplier 1.
  using LrMult = std::vector<std::pair<std::string, double>>;
  TORCH_ARG(LrMult, lr_mult) = {};
  /// Parameters without weight decay: those whose name contains one of these substrings (BERT's
  /// rule is {"bias", "LayerNorm.weight"}; TRAIN.NO_DECAY). They form parameter groups of their
  /// own with decay 0 and the same LR multipliers. A substring that matches no parameter is an
  /// error at construction (a misspelt name would otherwise decay what it meant to spare).
  using NoDecay = std::vector<std::string>;
  TORCH_ARG(NoDecay, no_decay) = {};
  /// Human-readable configuration of the run (the resolved config as JSON), stored in checkpoints.
  TORCH_ARG(std::string, config_json) = {};

 public:

  /// Throws std::invalid_argument naming the first option out of range.
  void validate() const;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/step/options-inl.hpp>
#endif
