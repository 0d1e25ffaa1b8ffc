#pragma once
/// From a validated Config to a running Trainer: which compiled type (dispatch), with which
/// run-time numbers (trainer_options) and which optimizer (with_optimizer).
///
///   tk::dispatch(config, [&](auto tag) {
///     using Trainer = typename decltype(tag)::type;  // e.g. Trainer<FP16Dynamic, Accumulate<4>, ClipNorm>
///     return tk::with_optimizer(config.derived().optimizer, [&](auto optimizer) {
///       Trainer trainer(model, optimizer, tk::trainer_options(config));
///       trainer.set_schedule(config.make_schedule(loader_length));
///       return fit(trainer);
///     });
///   });
///
/// The registry is fixed: {FP32, BF16, FP16Static, FP16Dynamic} x {AccumulationPolicy<1, 2,
/// 4, 8>, AccumulationPolicy<Dynamic>} x {NoClip, ClipNorm, ClipValue}, 60 types, plus master
/// weights (TRAIN.MASTER_WEIGHTS) narrowed to AccumulationPolicy<Dynamic>:
/// MasterWeights<BF16 | FP16Static | FP16Dynamic> x {NoClip, ClipNorm, ClipValue}, 9 types (the
/// full product would add 45, about 75% to every dispatching unit's compile time). Any other
/// accumulation count (any count, with master weights) runs on AccumulationPolicy<Dynamic>
/// (same results: the window length is then TrainerOptions::accumulation_steps) and dispatch
/// says so on std::clog.
///
/// Cost: the visitor is compiled once per registered type, so a program that dispatches pays
/// for 69 instantiations of whatever its visitor does with the trainer. To pay for the
/// trainers' own members once, define TRAINKIT_EXTERN_TRAINERS everywhere and
/// TRAINKIT_INSTANTIATE_TRAINERS in exactly one translation unit before including this header.
/// Measured (g++ 12 -O2, 2 cores, a visitor that builds each trainer and runs micro_step and
/// flush): one trainer type without dispatch 59 s / 0.23 MB of code; dispatch over the
/// registry 154 s / 1.78 MB; with TRAINKIT_EXTERN_TRAINERS the visiting unit takes 73 s /
/// 0.42 MB and the one instantiating unit 133 s / 2.0 MB, compiled once.
#include <trainkit/config.hpp>
#include <trainkit/optim.hpp>
#include <trainkit/options.hpp>
#include <trainkit/trainer.hpp>

#include <iostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainkit {

/// A type passed as a value: the visitor of dispatch() receives TypeTag<Trainer<...>>.
template <class T>
struct TypeTag {
  using type = T;
};

namespace detail {

template <class F>
decltype(auto) with_precision(PrecisionKind p, F&& f) {
  switch (p) {
    case PrecisionKind::BF16: return f(TypeTag<BF16>{});
    case PrecisionKind::FP16Static: return f(TypeTag<FP16Static>{});
    case PrecisionKind::FP16Dynamic: return f(TypeTag<FP16Dynamic>{});
    case PrecisionKind::FP32: break;
  }
  return f(TypeTag<FP32>{});
}

// The master-weight half of the registry: Accumulate<Dynamic> only (see the file comment).
template <class F>
decltype(auto) with_master_weights(PrecisionKind p, ClipKind c, F&& f) {
  if (p == PrecisionKind::FP32)
    throw ConfigError("TRAIN.MASTER_WEIGHTS", "needs FP16 or BF16; there is no MasterWeights<FP32> trainer");
  auto with_clip_of = [&](auto precision) -> decltype(auto) {
    using M = MasterWeights<typename decltype(precision)::type>;
    switch (c) {
      case ClipKind::ClipNorm: return f(TypeTag<Trainer<PrecisionPolicy<M>, AccumulationPolicy<Dynamic>, ClipPolicy<ClipNorm>>>{});
      case ClipKind::ClipValue: return f(TypeTag<Trainer<PrecisionPolicy<M>, AccumulationPolicy<Dynamic>, ClipPolicy<ClipValue>>>{});
      case ClipKind::NoClip: break;
    }
    return f(TypeTag<Trainer<PrecisionPolicy<M>, AccumulationPolicy<Dynamic>, ClipPolicy<NoClip>>>{});
  };
  switch (p) {
    case PrecisionKind::BF16: return with_clip_of(TypeTag<BF16>{});
    case PrecisionKind::FP16Static: return with_clip_of(TypeTag<FP16Static>{});
    default: break;
  }
  return with_clip_of(TypeTag<FP16Dynamic>{});
}

// The compiled counts of TrainerKey::compiled_accumulation, and Dynamic for every other.
template <class F>
decltype(auto) with_accumulation(int n, F&& f) {
  static_assert(TrainerKey::compiled_accumulation[0] == 1 && TrainerKey::compiled_accumulation[1] == 2 &&
                    TrainerKey::compiled_accumulation[2] == 4 && TrainerKey::compiled_accumulation[3] == 8,
                "keep with_accumulation in step with TrainerKey::compiled_accumulation");
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: break;
  }
  return f(std::integral_constant<int, Dynamic>{});
}

template <class F>
decltype(auto) with_clip(ClipKind c, F&& f) {
  switch (c) {
    case ClipKind::ClipNorm: return f(TypeTag<ClipNorm>{});
    case ClipKind::ClipValue: return f(TypeTag<ClipValue>{});
    case ClipKind::NoClip: break;
  }
  return f(TypeTag<NoClip>{});
}

}  // namespace detail

/// The Trainer type of a key, as a type: TrainerOf<FP32, 4, ClipNorm>.
template <class PrecisionTag, int N, class ClipTag>
using TrainerOf = Trainer<PrecisionPolicy<PrecisionTag>, AccumulationPolicy<N>, ClipPolicy<ClipTag>>;

/// The names of every type in dispatch()'s registry, in registry order.
inline std::vector<std::string> registered_trainers() {
  std::vector<std::string> names;
  for (PrecisionKind p : {PrecisionKind::FP32, PrecisionKind::BF16, PrecisionKind::FP16Static, PrecisionKind::FP16Dynamic})
    for (int n : {1, 2, 4, 8, TrainerKey::dynamic})
      for (ClipKind c : {ClipKind::NoClip, ClipKind::ClipNorm, ClipKind::ClipValue})
        names.push_back(TrainerKey{p, n, c}.name());
  for (PrecisionKind p : {PrecisionKind::BF16, PrecisionKind::FP16Static, PrecisionKind::FP16Dynamic})
    for (ClipKind c : {ClipKind::NoClip, ClipKind::ClipNorm, ClipKind::ClipValue})
      names.push_back(TrainerKey{p, TrainerKey::dynamic, c, /*master_weights=*/true}.name());
  return names;
}

/// Calls `visitor(TypeTag<Trainer<...>>{})` with the registered trainer type of `key` and
/// returns what it returns (every instantiation must return the same type). An accumulation
/// count outside {1, 2, 4, 8} runs on AccumulationPolicy<Dynamic>, said once per call on
/// std::clog; a count below 1 is a ConfigError listing the registry.
template <class Visitor>
decltype(auto) dispatch(const TrainerKey& key, Visitor&& visitor) {
  if (key.accumulation < 1) {
    std::string names;
    for (const auto& n : registered_trainers()) names += "\n  " + n;
    throw ConfigError("TRAIN.GRAD_ACCUMULATE_STEPS",
                      "must be >= 1, got " + std::to_string(key.accumulation) +
                          "; the compiled trainers are (any other count >= 1 runs on Accumulate<Dynamic>):" + names);
  }
  const TrainerKey runs = key.dispatched();
  if (runs.accumulation != key.accumulation)
    std::clog << "trainkit: " << key.dynamic_reason() << "; running " << runs.name()
              << " (same results; set TrainerOptions::accumulation_steps, which trainer_options() does)\n";
  if (runs.master_weights) return detail::with_master_weights(runs.precision, runs.clip, visitor);
  return detail::with_precision(runs.precision, [&](auto precision) -> decltype(auto) {
    return detail::with_accumulation(runs.accumulation, [&](auto n) -> decltype(auto) {
      return detail::with_clip(runs.clip, [&](auto clip) -> decltype(auto) {
        using T = TrainerOf<typename decltype(precision)::type, decltype(n)::value, typename decltype(clip)::type>;
        return visitor(TypeTag<T>{});
      });
    });
  });
}

/// dispatch() on the configuration's trainer key.
template <class Visitor>
decltype(auto) dispatch(const Config& config, Visitor&& visitor) {
  return dispatch(config.trainer_key(), std::forward<Visitor>(visitor));
}

/// The run-time numbers of a configuration: loss scale knobs, clip thresholds, the window
/// length (for AccumulationPolicy<Dynamic>), the partial-window rule, the non-finite rule,
/// the LR_MULT groups, and the resolved configuration as JSON for checkpoints.
inline TrainerOptions trainer_options(const Config& config) {
  const nlohmann::json& t = config.tree()["TRAIN"];
  LossScaleOptions scale;
  scale.init_scale(t["FP16_INIT_SCALE"].get<double>())
      .growth_factor(t["FP16_GROWTH_FACTOR"].get<double>())
      .backoff_factor(t["FP16_BACKOFF_FACTOR"].get<double>())
      .growth_interval(t["FP16_GROWTH_INTERVAL"].get<std::int64_t>())
      .hysteresis(t["FP16_HYSTERESIS"].get<std::int64_t>())
      .min_scale(t["FP16_MIN_LOSS_SCALE"].get<double>())
      .max_scale(t["FP16_MAX_LOSS_SCALE"].get<double>());
  if (t["FP16_LOSS_SCALE"].is_number()) scale.static_scale(t["FP16_LOSS_SCALE"].get<double>());

  TrainerOptions o;
  o.loss_scale(scale);
  // Off (<= 0) leaves the option at its default: the policy type says whether it is used.
  if (t["CLIP_GRAD_NORM"].get<double>() > 0) o.max_grad_norm(t["CLIP_GRAD_NORM"].get<double>());
  if (t["CLIP_GRAD_VALUE"].get<double>() > 0) o.clip_value(t["CLIP_GRAD_VALUE"].get<double>());
  o.accumulation_steps(t["GRAD_ACCUMULATE_STEPS"].get<std::int64_t>());
  const std::string partial = t["PARTIAL_WINDOW"].get<std::string>();
  o.partial_window(partial == "span" ? PartialWindow::span : partial == "drop" ? PartialWindow::drop : PartialWindow::flush);
  o.nonfinite(t["NONFINITE"].get<std::string>() == "abort" ? NonFinite::abort : NonFinite::skip);
  std::vector<std::pair<std::string, double>> groups;  // TrainerOptions::lr_mult
  for (const auto& pair : t["LR_MULT"]) groups.emplace_back(pair[0].get<std::string>(), pair[1].get<double>());
  o.lr_mult(std::move(groups));
  // keep_norm_fp32 keeps its default (on, as Apex O2's keep_batchnorm_fp32).
  o.config_json(config.dump(-1));
  return o;
}

/// Calls `f` with the optimizer of `settings`: tk::SGD{lr, momentum, wd}, tk::Adam{lr, wd}, or
/// tk::AdamW{lr, wd} with VL-BERT's betas and eps. Every call of `f` must return the same type.
template <class F>
decltype(auto) with_optimizer(const OptimizerSettings& settings, F&& f) {
  if (settings.name == "AdamW")
    return f(AdamW{settings.lr, settings.weight_decay}.betas(settings.beta1, settings.beta2).eps(settings.eps));
  if (settings.name == "Adam")
    return f(Adam{settings.lr, settings.weight_decay}.betas(settings.beta1, settings.beta2).eps(settings.eps));
  if (settings.name != "SGD")
    throw ConfigError("TRAIN.OPTIMIZER", "expected one of SGD, Adam, AdamW, got \"" + settings.name + "\"");
  return f(SGD{settings.lr, settings.momentum, settings.weight_decay});
}

// Explicit instantiation of the registry (see the file comment).
#define TRAINKIT_FOR_EACH_REGISTERED_TRAINER_CLIP(X, P, N) \
  X(Trainer<PrecisionPolicy<P>, AccumulationPolicy<N>, ClipPolicy<NoClip>>)                 \
  X(Trainer<PrecisionPolicy<P>, AccumulationPolicy<N>, ClipPolicy<ClipNorm>>)               \
  X(Trainer<PrecisionPolicy<P>, AccumulationPolicy<N>, ClipPolicy<ClipValue>>)
#define TRAINKIT_FOR_EACH_REGISTERED_TRAINER_ACC(X, P)                                          \
  TRAINKIT_FOR_EACH_REGISTERED_TRAINER_CLIP(X, P, 1) TRAINKIT_FOR_EACH_REGISTERED_TRAINER_CLIP(X, P, 2) \
  TRAINKIT_FOR_EACH_REGISTERED_TRAINER_CLIP(X, P, 4) TRAINKIT_FOR_EACH_REGISTERED_TRAINER_CLIP(X, P, 8) \
  TRAINKIT_FOR_EACH_REGISTERED_TRAINER_CLIP(X, P, Dynamic)
#define TRAINKIT_FOR_EACH_REGISTERED_TRAINER(X)                                                        \
  TRAINKIT_FOR_EACH_REGISTERED_TRAINER_ACC(X, FP32) TRAINKIT_FOR_EACH_REGISTERED_TRAINER_ACC(X, BF16) \
  TRAINKIT_FOR_EACH_REGISTERED_TRAINER_ACC(X, FP16Static) TRAINKIT_FOR_EACH_REGISTERED_TRAINER_ACC(X, FP16Dynamic) \
  TRAINKIT_FOR_EACH_REGISTERED_TRAINER_CLIP(X, MasterWeights<BF16>, Dynamic)                    \
  TRAINKIT_FOR_EACH_REGISTERED_TRAINER_CLIP(X, MasterWeights<FP16Static>, Dynamic)              \
  TRAINKIT_FOR_EACH_REGISTERED_TRAINER_CLIP(X, MasterWeights<FP16Dynamic>, Dynamic)

#if defined(TRAINKIT_INSTANTIATE_TRAINERS)
#define TRAINKIT_INSTANTIATE_ONE(...) template class __VA_ARGS__;
TRAINKIT_FOR_EACH_REGISTERED_TRAINER(TRAINKIT_INSTANTIATE_ONE)
#undef TRAINKIT_INSTANTIATE_ONE
#elif defined(TRAINKIT_EXTERN_TRAINERS)
#define TRAINKIT_EXTERN_ONE(...) extern template class __VA_ARGS__;
TRAINKIT_FOR_EACH_REGISTERED_TRAINER(TRAINKIT_EXTERN_ONE)
#undef TRAINKIT_EXTERN_ONE
#endif

}  // namespace trainkit
