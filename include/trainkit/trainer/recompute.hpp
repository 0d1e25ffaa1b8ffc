#pragma once
/// Activation recomputation (gradient checkpointing) for LibTorch modules: what
/// torch.utils.checkpoint is to Python, for the C++ frontend, which has none.
///
///   x = tk::recompute(block, x);                       // inside a Module's forward
///   x = tk::recompute([b = block](const torch::Tensor& x, const torch::Tensor& mask) mutable {
///     return b->forward(x, mask); }, x, mask);          // several inputs: a callable
///
/// Contract — `recompute(fn, inputs...)` with fn a ModuleHolder (`Linear`, `Sequential`, a TORCH_MODULE type)
/// or any callable taking the tensors and returning a torch::Tensor or a std::vector of them:
///   forward    fn runs once under NoGradGuard; of its activations only `inputs` are kept
///              (saved as autograd saves them: modifying one in place afterwards is an error
///              at backward). With grad mode off (evaluation) fn is simply called.
///   backward   fn runs again with grad enabled, on the same inputs, with the random generators
///              (CPU, and the CUDA generator of every CUDA device an input is on) set to their
///              states at forward and the autocast state of forward (enabled flag and dtype for
///              the CPU and the inputs' device type, cache flag), so dropout draws the same
///              masks and autocast casts the same way although trainkit's backward runs outside
///              its autocast region. The generators' current states are put back afterwards.
///              Then it backpropagates through that second forward: fn's parameters receive
///              their gradients through autograd's AccumulateGrad, added in place into a
///              defined .grad (never replaced; trainkit's .grad are views into a flat buffer).
///   gradients  equal those of calling fn directly (the same kernels on the same values: the
///              test finds them bit-identical, with dropout and under BF16 autocast).
///   grad mode  the output requires grad whenever fn may have trainable parameters, also when
///              no input requires grad (the pitfall of PyTorch's reentrant checkpoint); for a
///              ModuleHolder with no trainable parameter and no input requiring grad, fn is
///              simply called.
/// Costs: one extra forward of fn per backward; memory: fn's inputs (plus a few KiB of
/// generator state) instead of all its activations, and at backward one fn's activations.
/// Requirements (the reentrant design's, as in torch.utils.checkpoint(use_reentrant=True)):
///   - every tensor fn reads that depends on differentiable computation outside fn must be one
///     of `inputs` (a captured one would be differentiated by the inner backward, outside the
///     outer one: wrong gradients or an error);
///   - fn is stored until backward: capture by value what may not live that long;
///   - fn must do the same thing on both runs (same output count and shapes; checked);
///   - the loss is differentiated with backward(); torch::autograd::grad(), backward() with
///     `inputs`, and create_graph (higher-order gradients) are refused with an error.
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/module_of.hpp>
#include <trainkit/detail/rng_state.hpp>
#include <trainkit/storage/unit_schedule.hpp>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainkit {

namespace detail {

/// The CPU and every CUDA device an input is on, each once.
std::vector<c10::Device> rng_devices(at::TensorList inputs);

/// RAII: the generators set to `recorded` for the region, their current states put back after.
class RngReplay {
 public:
  explicit RngReplay(const RngStates& recorded);
  ~RngReplay() { current_.restore(); }
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  RngStates current_;
};

/// The autocast state of some device types (enabled flag and dtype each) and the cache flag.
struct AutocastState {
  struct Entry {
    c10::DeviceType device_type;
    bool enabled;
    at::ScalarType dtype;
  };
  std::vector<Entry> entries;
  bool cache_enabled = true;

  static AutocastState capture(const std::vector<c10::DeviceType>& device_types);
  bool any_enabled() const;
  void apply() const;
};

/// The CPU and the device type of every input, each once.
std::vector<c10::DeviceType> autocast_device_types(at::TensorList inputs);

/// RAII: autocast as `recorded` for the region, the current state put back after. Counts as an
/// autocast region (nesting) when it enables autocast, so that the weight casts cached during
/// the recomputation are dropped when it closes outside any other region, as AutocastRegion
/// does: a cache left filled would serve pre-update casts to the next step's forward.
class AutocastReplay {
 public:
  explicit AutocastReplay(const AutocastState& recorded);
  ~AutocastReplay();
  AutocastReplay(const AutocastReplay&) = delete;
  AutocastReplay& operator=(const AutocastReplay&) = delete;

 private:
  bool nests_;
  AutocastState current_;
};

/// RAII: autocast's weight-cast cache off for the region. Before pytorch/pytorch#165068
/// (merged December 2025; LibTorch 2.11 has it) the cache ignored grad mode: a cast made in the
/// no-grad forward (no grad_fn) was served to a later use of the same weight with grad enabled
/// in the same region (a tied weight, a backward run inside the region), which then received
/// no gradient. Without the cache a weight is cast at each use inside fn: same values, one cast
/// more per repeated use.
class AutocastCacheOff {
 public:
  AutocastCacheOff();
  ~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(was_enabled_); }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool was_enabled_;
};

/// What the backward needs besides the saved inputs. Held by the autograd node through a
/// capsule IValue (AutogradContext::saved_data stores IValues only; a capsule is the one that
/// holds an arbitrary C++ object without registering a TorchScript class).
struct RecomputeState : torch::CustomClassHolder {
  std::function<torch::autograd::variable_list(const torch::autograd::variable_list&)> forward;
  RngStates rng;
  AutocastState autocast;
  std::shared_ptr<UnitSchedule> units;  // the forward's stage-3 schedule: the recomputation's too
};

/// The autograd Function. Inputs: the state (not a tensor), a dummy tensor that requires grad
/// when no input does (so that the output requires grad for fn's parameters), the inputs.
struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<RecomputeState> state,
                                                const torch::Tensor& /*dummy*/, at::TensorList inputs);

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

template <class R>
inline constexpr bool is_tensor_or_tensors =
    std::is_same_v<R, torch::Tensor> || std::is_same_v<R, std::vector<torch::Tensor>>;

template <class F, std::size_t... I>
torch::autograd::variable_list call_unpacked(F& fn, const torch::autograd::variable_list& inputs,
                                             std::index_sequence<I...>) {
  auto out = fn(inputs[I]...);
  if constexpr (std::is_same_v<decltype(out), torch::Tensor>) return {std::move(out)};
  else return out;
}

}  // namespace detail

namespace detail {
template <class F, class... Tensors>
auto recompute_call(F&& fn, const Tensors&... inputs);
}  // namespace detail

/// Runs `fn(inputs...)` keeping only `inputs` for backward, where fn runs again (see the
/// contract above). fn: a ModuleHolder (torch::nn::Sequential included) or a callable, stored
/// (a copy) until backward; returns a torch::Tensor or a std::vector<torch::Tensor>, and
/// recompute returns the same.
template <class F, class... Tensors>
auto recompute(F&& fn, const Tensors&... inputs) {
  if constexpr (std::is_same_v<std::decay_t<F>, torch::nn::Sequential>) {
    // Sequential's operator() cannot name its return type (its forward is a template whose
    // default result is a Tensor): call forward.
    return detail::recompute_call(
        [s = torch::nn::Sequential(fn)](const Tensors&... xs) mutable { return s->forward(xs...); }, inputs...);
  } else {
    return detail::recompute_call(std::forward<F>(fn), inputs...);
  }
}

namespace detail {
template <class F, class... Tensors>
auto recompute_call(F&& fn, const Tensors&... inputs) {
  static_assert(sizeof...(Tensors) > 0, "tk::recompute(fn, inputs...): give at least one input tensor");
  static_assert(std::conjunction_v<std::is_same<Tensors, torch::Tensor>...>,
                "tk::recompute(fn, inputs...): every input must be a torch::Tensor; pass other "
                "arguments by capturing them (by value) in fn");
  using Fn = std::decay_t<F>;
  static_assert(std::is_invocable_v<Fn&, const Tensors&...>,
                "tk::recompute(fn, inputs...): fn must be callable with the inputs (a ModuleHolder "
                "such as a TORCH_MODULE type, or a lambda)");
  using Result = std::decay_t<std::invoke_result_t<Fn&, const Tensors&...>>;
  static_assert(detail::is_tensor_or_tensors<Result>,
                "tk::recompute(fn, inputs...): fn must return a torch::Tensor or a "
                "std::vector<torch::Tensor>");

  std::size_t index = 0;
  const auto check_defined = [&index](const torch::Tensor& x) {
    TORCH_CHECK(x.defined(), "tk::recompute: input ", index,
                " is an undefined tensor; capture optional tensors in fn instead of passing them");
    ++index;
  };
  (check_defined(inputs), ...);

  Fn call(std::forward<F>(fn));
  const bool input_requires_grad = (inputs.requires_grad() || ...);
  bool may_train = true;  // a callable's parameters are unknown: assume it has trainable ones
  if constexpr (detail::is_module_holder<Fn>::value) {
    if (!input_requires_grad) {
      const auto params = call->parameters();
      may_train = std::any_of(params.begin(), params.end(), [](const torch::Tensor& p) { return p.requires_grad(); });
    }
  }
  if (!torch::GradMode::is_enabled() || !may_train) return Result(call(inputs...));

  auto state = c10::make_intrusive<detail::RecomputeState>();
  state->forward = [call = std::move(call)](const torch::autograd::variable_list& xs) mutable {
    return detail::call_unpacked(call, xs, std::index_sequence_for<Tensors...>{});
  };
  const torch::Tensor& first = std::get<0>(std::forward_as_tuple(inputs...));
  // Requires grad only when no input does: then it alone makes the output require grad, so
  // that backward reaches fn's parameters.
  const auto dummy =
      torch::empty({0}, torch::TensorOptions().device(first.device()).requires_grad(!input_requires_grad));
  const std::vector<torch::Tensor> list{inputs...};
  auto outputs = detail::RecomputeFunction::apply(std::move(state), dummy, at::TensorList(list));
  if constexpr (std::is_same_v<Result, torch::Tensor>) return Result(outputs.at(0));
  else return Result(std::move(outputs));
}
}  // namespace detail

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/trainer/recompute-inl.hpp>
#endif
