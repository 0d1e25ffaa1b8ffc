#pragma once
/// The registry: the Trainer types compiled for programs whose configuration is chosen at run
/// time (a YAML file), and make_trainer(), which builds the one a configuration asks for.
///
///   const tk::RunPlan plan = tk::RunPlan::from(config);
///   auto trainer = tk::make_trainer(plan, model);      // std::unique_ptr<tk::AnyTrainer> (plan.hpp)
///   tk::fit(*trainer, task, plan.fit);
///
/// or, without a configuration file (this header alone, light to include):
///
///   auto trainer = tk::make_trainer({tk::PrecisionKind::BF16, 4, tk::ClipKind::ClipNorm}, model.ptr(),
///                                   adamw_settings, tk::TrainerOptions().max_grad_norm(1.0));
///
/// The list is written once, below: TRAINKIT_REGISTRY_PRECISIONS x TRAINKIT_REGISTRY_CLIPS,
/// each as Trainer<PrecisionPolicy<P>, AccumulationPolicy<Dynamic>, ClipPolicy<C>>. From it come
/// make_trainer's dispatch, registered_trainers() (the names), tk::dispatch (dispatch.hpp) and
/// the explicit instantiations. A fixed accumulation count (AccumulationPolicy<4>) generates the
/// same step as AccumulationPolicy<Dynamic> with a run-time count (benchmarks/
/// accumulation_fixed_vs_dynamic measures the window time of both: equal within noise, see
/// benchmarks/RESULTS.md), so the registry compiles Dynamic only and takes the count from
/// TrainerOptions::accumulation_steps. Fixed counts stay for programs that name their type.
///
/// Compiled once, in shards: make_trainer picks the precision's detail::make_registered<P>,
/// declared here and defined per precision in translation units that CMake generates from
/// the list below (the target trainkit::registry, src/registry/shard.hpp; the precisions are
/// dealt into TRAINKIT_REGISTRY_UNITS units), so a program that includes this header compiles
/// no Trainer type at all.
///
/// Adding a type: add its precision tag to TRAINKIT_REGISTRY_PRECISIONS (its shard follows), or
/// its clip tag to TRAINKIT_REGISTRY_CLIPS. What a tag means (its kind, whether it scales the
/// loss...) is the tag's own constants (tags.hpp).
#include <trainkit/step/accumulation.hpp>
#include <trainkit/trainer/any_trainer.hpp>
#include <trainkit/step/clip.hpp>
#include <trainkit/config/error.hpp>
#include <trainkit/step/optimizer_settings.hpp>
#include <trainkit/step/optim.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/step/precision.hpp>
#include <trainkit/trainer/trainer_key.hpp>

#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

// The registry, the one list (see the file comment).
#define TRAINKIT_REGISTRY_PRECISIONS(X)                                                  \
  X(FP32) X(BF16) X(FP16Static) X(FP16Dynamic) X(MasterWeights<BF16>)                   \
  X(MasterWeights<FP16Static>) X(MasterWeights<FP16Dynamic>)
#define TRAINKIT_REGISTRY_CLIPS(X, P) X(P, NoClip) X(P, ClipNorm) X(P, ClipValue)

namespace trainkit {

template <class Precision, class Accumulation, class Clip>
class Trainer;  // (trainer.hpp: the registry names the types; its shards define them)

/// The Trainer type of a key, as a type: TrainerOf<FP32, 4, ClipNorm>.
template <class PrecisionTag, int N, class ClipTag>
using TrainerOf = Trainer<PrecisionPolicy<PrecisionTag>, AccumulationPolicy<N>, ClipPolicy<ClipTag>>;

/// A type passed as a value: the visitor of dispatch() receives TypeTag<Trainer<...>>.
template <class T>
struct TypeTag {
  using type = T;
};

namespace detail {

template <class First, class... Rest>
struct DropFirst {
  using type = TypeList<Rest...>;
};

#define TRAINKIT_REGISTRY_TYPE_(P, C) , TrainerOf<P, Dynamic, C>
#define TRAINKIT_REGISTRY_TYPES_OF_(P) TRAINKIT_REGISTRY_CLIPS(TRAINKIT_REGISTRY_TYPE_, P)
/// Every registered Trainer type, in registry order.
using RegisteredTrainers = typename DropFirst<void TRAINKIT_REGISTRY_PRECISIONS(TRAINKIT_REGISTRY_TYPES_OF_)>::type;
#undef TRAINKIT_REGISTRY_TYPES_OF_
#undef TRAINKIT_REGISTRY_TYPE_

template <class PrecisionTag>
constexpr bool matches_precision(const TrainerKey& key) {
  return key.precision == PrecisionTag::kind && key.master_weights == PrecisionTag::master_weights;
}

/// The key of a registered type (from its arguments: the Trainer is not compiled here).
template <class T>
struct key_of;
template <class P, int N, class C>
struct key_of<Trainer<PrecisionPolicy<P>, AccumulationPolicy<N>, ClipPolicy<C>>> {
  static constexpr TrainerKey value() { return TrainerKey::of<P, N, C>(); }
};

template <class... T>
std::vector<std::string> names_of(TypeList<T...>) {
  return {key_of<T>::value().name()...};
}

/// A shard of the registry: builds TrainerOf<PrecisionTag, Dynamic, clip> over `model` with
/// `optimizer`. Declared only; defined in src/registry/shard.hpp and compiled once per
/// precision (trainkit::registry).
template <class PrecisionTag>
std::unique_ptr<AnyTrainer> make_registered(ClipKind clip, std::shared_ptr<torch::nn::Module> model,
                                            const OptimizerSettings& optimizer, TrainerOptions options);

/// The registry's names as one indented list, for errors.
inline std::string registry_list() {
  std::string names;
  for (const auto& n : names_of(RegisteredTrainers{})) names += "\n  " + n;
  return names;
}

/// The key the registry runs for `key` (accumulation as Dynamic), or a ConfigError naming the
/// key that has no registered type.
inline TrainerKey registered_key(const TrainerKey& key) {
  if (key.accumulation < 1)
    throw ConfigError("TRAIN.GRAD_ACCUMULATE_STEPS", "must be >= 1, got " + std::to_string(key.accumulation) +
                                                         "; the compiled trainers are (the count is a run-time "
                                                         "option of each):" + registry_list());
  if (key.master_weights && key.precision == PrecisionKind::FP32)
    throw ConfigError("TRAIN.MASTER_WEIGHTS", "needs FP16 or BF16; there is no MasterWeights<FP32> trainer");
  return key.dispatched();
}

}  // namespace detail

/// The names of every type in the registry, in registry order.
inline std::vector<std::string> registered_trainers() { return detail::names_of(detail::RegisteredTrainers{}); }

/// Builds the registered trainer of `key` over `model` with `optimizer` and `options` (the
/// window length is `key.accumulation`, set into options). The Trainer types themselves are
/// compiled in trainkit::registry's shards.
inline std::unique_ptr<AnyTrainer> make_trainer(const TrainerKey& key, std::shared_ptr<torch::nn::Module> model,
                                                const OptimizerSettings& optimizer, TrainerOptions options) {
  TORCH_CHECK(model != nullptr, "make_trainer: the model is null");
  const TrainerKey runs = detail::registered_key(key);
  options.accumulation_steps(key.accumulation);
#define TRAINKIT_MAKE_IF_(P) \
  if (detail::matches_precision<P>(runs)) return detail::make_registered<P>(runs.clip, std::move(model), optimizer, std::move(options));
  TRAINKIT_REGISTRY_PRECISIONS(TRAINKIT_MAKE_IF_)
#undef TRAINKIT_MAKE_IF_
  throw ConfigError("TRAIN", "no registered trainer for " + key.name() + "; the registry has:" + detail::registry_list());
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

// Explicit instantiations of the registry, generated from its list: the shards of
// trainkit::registry define them; TRAINKIT_EXTERN_TRAINERS declares them in a program.
#define TRAINKIT_REGISTRY_INSTANTIATE_(P, C) \
  template class Trainer<PrecisionPolicy<P>, AccumulationPolicy<Dynamic>, ClipPolicy<C>>;
#define TRAINKIT_REGISTRY_EXTERN_(P, C) \
  extern template class Trainer<PrecisionPolicy<P>, AccumulationPolicy<Dynamic>, ClipPolicy<C>>;
#define TRAINKIT_REGISTRY_EXTERN_OF_(P) TRAINKIT_REGISTRY_CLIPS(TRAINKIT_REGISTRY_EXTERN_, P)

}  // namespace trainkit
