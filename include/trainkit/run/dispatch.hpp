#pragma once
/// The registry as types: tk::dispatch calls a generic visitor with the registered Trainer type
/// of a configuration, for code that wants the concrete type (it compiles the visitor once per
/// registered type). Most programs want make_trainer (registry.hpp) instead: an AnyTrainer,
/// with nothing compiled per type in the program itself.
///
///   const tk::RunPlan plan = tk::RunPlan::from(config);
///   tk::dispatch(plan, [&](auto tag) {
///     using Trainer = typename decltype(tag)::type;  // Trainer<FP16Dynamic, Accumulate<Dynamic>, ClipNorm>
///     return tk::with_optimizer(plan.optimizer, [&](auto optimizer) {
///       Trainer trainer(model, optimizer, plan.trainer_options);
///       return run(trainer);
///     });
///   });
///
/// The registry and why it holds AccumulationPolicy<Dynamic> only: registry.hpp. A program that
/// links trainkit::registry, whose shards hold the registered types' explicit instantiations,
/// gets TRAINKIT_EXTERN_TRAINERS from it: this header then declares them, and the trainers'
/// own members are compiled once, in the library, not in each file that dispatches or names one
/// (with the macro defined by hand, link trainkit::registry).
#include <trainkit/step/optim.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/run/plan.hpp>
#include <trainkit/run/registry.hpp>
#include <trainkit/trainer/trainer.hpp>

#include <string>
#include <type_traits>
#include <utility>

namespace trainkit {

namespace detail {

// The registered type of `runs` among T, Rest... (`runs` is known to be registered).
template <class Visitor, class T, class... Rest>
decltype(auto) visit_registered(const TrainerKey& runs, Visitor& visitor, TypeList<T, Rest...>) {
  if constexpr (sizeof...(Rest) == 0) {
    return visitor(TypeTag<T>{});
  } else {
    if (key_of<T>::value() == runs) return visitor(TypeTag<T>{});
    return visit_registered(runs, visitor, TypeList<Rest...>{});
  }
}

}  // namespace detail

/// Calls `visitor(TypeTag<Trainer<...>>{})` with the registered trainer type of `key` and
/// returns what it returns (every instantiation must return the same type). Every accumulation
/// count >= 1 runs on AccumulationPolicy<Dynamic> (set TrainerOptions::accumulation_steps, as
/// RunPlan's trainer_options do); a count below 1 is a ConfigError listing the registry.
template <class Visitor>
decltype(auto) dispatch(const TrainerKey& key, Visitor&& visitor) {
  const TrainerKey runs = detail::registered_key(key);
  return detail::visit_registered(runs, visitor, detail::RegisteredTrainers{});
}

/// dispatch() on the plan's trainer key.
template <class Visitor>
decltype(auto) dispatch(const RunPlan& plan, Visitor&& visitor) {
  return dispatch(plan.trainer, std::forward<Visitor>(visitor));
}

// (with_optimizer, and the registry's instantiation macros: registry.hpp.)
#if defined(TRAINKIT_EXTERN_TRAINERS)
TRAINKIT_REGISTRY_PRECISIONS(TRAINKIT_REGISTRY_EXTERN_OF_)
#endif

}  // namespace trainkit
