#pragma once
/// The boundary of a unit of a model whose parameters are sharded (ZeRO stage 3): where its
/// parameters must be gathered before its forward and its backward, and may be released after
/// its forward. LibTorch's C++ modules have no forward hooks, so the model marks each unit's
/// call once, at the boundary, with a call helper:
///
///   x = tk::unit(layer, x);                                     // layer(x)
///   x = tk::unit(layer, [&](const torch::Tensor& x) { return layer->forward(x, mask); }, x);
///
/// Why a call helper and not a wrapper module: a wrapper would rename every parameter (its
/// checkpoints, TRAIN.NO_DECAY and LR_MULT patterns, weight files and PARTIAL_PRETRAIN
/// prefixes all use the names), and it needs the same one change at the call site anyway. The
/// units themselves are named by the trainer (by module path), so the model's code says where a
/// unit is called, never what it is.
///
/// Contract — `unit(module, inputs...)` calls `module(inputs...)`; `unit(module, fn,
/// inputs...)` calls `fn(inputs...)`, a callable that runs `module` (the forward it needs, with
/// other arguments captured). fn returns a torch::Tensor or a std::vector<torch::Tensor>:
///   without a schedule  (no trainer shards this model's parameters: stages 0-2, one process,
///                       evaluation by hand, or `module` is no unit of it) the call and nothing
///                       else: one thread-local read and, for a module, one lookup
///   forward             the schedule's before_forward(u) (the unit's parameters gathered), the
///                       call, after_forward(u) (released, or kept until the backward)
///   backward            a hook on each output that requires grad calls before_backward(u) when
///                       the gradient reaches it, before any of the unit's own backward runs
///                       (once per such output: the schedule gathers at the first); the unit's
///                       gradient is complete when its parameters' post-accumulate-grad hooks
///                       have fired, which the storage counts (detail::Readiness)
///   outside a step      a unit of a stage-3 trainer alive in the process, autograd off: in
///                       an evaluation by unit (AnyTrainer::evaluate_by_unit, the fit loop's
///                       validation) gathered for its call and released after, the ranks kept
///                       in step; while the trainer holds every unit gathered
///                       (AnyTrainer::hold_parameters) the call alone; refused otherwise
///                       (std::logic_error): a gather per call that no rank announced would
///                       pair with the other ranks' collectives as they come
/// A storage with Sharding::parameters (TRAIN.ZERO_STAGE: 3) over several ranks installs the
/// schedule (storage/unit_gathers.hpp, held by the mode storage/sharded_units.hpp); otherwise a
/// unit is its call.
/// Composes with tk::recompute, inside: `tk::unit(layer, [=](const torch::Tensor& x) { return
/// tk::recompute(layer, x); }, x)` recomputes the forward in the unit's backward, after
/// before_backward, with the parameters gathered.
#include <trainkit/detail/module_of.hpp>
#include <trainkit/storage/unit_schedule.hpp>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainkit {

namespace detail {

template <class R>
inline constexpr bool unit_result_v = std::is_same_v<R, torch::Tensor> || std::is_same_v<R, std::vector<torch::Tensor>>;

template <class M>
const torch::nn::Module& unit_module(const M& module) {
  if constexpr (is_module_holder<M>::value) return *module;
  else if constexpr (std::is_base_of_v<torch::nn::Module, M>) return module;
  else return *module;  // a std::shared_ptr<Module>
}

// The unit's call between its forward hooks; the backward's hook on each output.
template <class R, class Call>
R scheduled_call(const std::shared_ptr<UnitSchedule>& schedule, std::int64_t unit, Call&& call) {
  schedule->before_forward(unit);
  R out;
  try {
    out = call();
  } catch (...) {
    schedule->after_forward(unit);  // (released alike on every path)
    throw;
  }
  schedule->after_forward(unit);
  const auto hook = [&](torch::Tensor& t) {
    if (!t.defined() || !t.requires_grad()) return;
    t.register_hook([schedule, unit](const torch::Tensor&) { schedule->before_backward(unit); });
  };
  if constexpr (std::is_same_v<R, torch::Tensor>) hook(out);
  else
    for (auto& t : out) hook(t);
  return out;
}

// `call()` as unit `module` of the active schedule, or alone. Outside a step, a unit of a
// live stage-3 storage is gathered around its call (evaluation); a forward that records a
// graph there has no trainer to take its gradient, and is refused before its parameters could
// be read released.
template <class R, class M, class Call>
R unit_call(const M& module, Call&& call) {
  const auto& schedule = active_unit_schedule();
  if (schedule) {
    const std::int64_t u = schedule->unit_of(unit_module(module));
    if (u >= 0) return scheduled_call<R>(schedule, u, std::forward<Call>(call));
  }
  // (Not a unit of the active schedule: perhaps one of another stage-3 trainer's.)
  const auto [owner, u] = UnitRegistry::get().find(unit_module(module));
  if (!owner) return call();
  if (owner->held() && !torch::GradMode::is_enabled()) return call();
  if (owner->evaluating() && !torch::GradMode::is_enabled()) return scheduled_call<R>(owner, u, std::forward<Call>(call));
  if (owner->held() || owner->evaluating())
    throw std::logic_error("tk::unit: a unit whose parameters are sharded (ZeRO stage 3) was called with autograd on "
                           "outside the trainer's micro_step: no trainer would take that gradient; call it under "
                           "torch::NoGradGuard");
  throw std::logic_error("tk::unit: a unit whose parameters are sharded (ZeRO stage 3, TRAIN.ZERO_STAGE: 3) was "
                         "called outside the trainer's micro_step: its parameters exist only gathered for the "
                         "trainer's forward and backward. Outside them, under torch::NoGradGuard, open an evaluation "
                         "by unit on every rank (trainer.evaluate_by_unit(true) ... evaluate_by_unit(false), as the fit "
                         "loop's validation does), or gather every unit on every rank (trainer.hold_parameters(true) "
                         "... hold_parameters(false))");
}

}  // namespace detail

/// `module(inputs...)` as a unit of a sharded model (see the file comment).
template <class M, class... Tensors,
          class = std::enable_if_t<std::conjunction_v<std::is_same<std::decay_t<Tensors>, torch::Tensor>...>>>
auto unit(M& module, const Tensors&... inputs) {
  using R = std::decay_t<decltype(module(inputs...))>;
  static_assert(detail::unit_result_v<R>, "tk::unit(module, inputs...): module must return a torch::Tensor or a "
                                          "std::vector<torch::Tensor>; use tk::unit(module, fn, inputs...) otherwise");
  return detail::unit_call<R>(module, [&] { return R(module(inputs...)); });
}

/// `fn(inputs...)`, a callable that runs `module`, as a unit of a sharded model.
template <class M, class F, class... Tensors,
          class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, torch::Tensor> &&
                                   std::conjunction_v<std::is_same<std::decay_t<Tensors>, torch::Tensor>...>>>
auto unit(M& module, F&& fn, const Tensors&... inputs) {
  using R = std::decay_t<std::invoke_result_t<F&, const Tensors&...>>;
  static_assert(detail::unit_result_v<R>, "tk::unit(module, fn, inputs...): fn must return a torch::Tensor or a "
                                          "std::vector<torch::Tensor>");
  return detail::unit_call<R>(module, [&] { return R(fn(inputs...)); });
}

}  // namespace trainkit
