#pragma once
/// The definitions of trainkit/trainer/recompute.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/trainer/recompute.hpp>

namespace trainkit {
namespace detail {

TRAINKIT_INLINE std::vector<c10::Device> rng_devices(at::TensorList inputs) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  for (const auto& x : inputs)
    if (x.is_cuda() && std::find(devices.begin(), devices.end(), x.device()) == devices.end())
      devices.push_back(x.device());
  return devices;
}

TRAINKIT_INLINE RngReplay::RngReplay(const RngStates& recorded) {
  std::vector<c10::Device> devices;
  for (const auto& entry : recorded.states) devices.push_back(entry.first);
  current_ = RngStates::capture(devices);
  recorded.restore();
}

TRAINKIT_INLINE AutocastState AutocastState::capture(const std::vector<c10::DeviceType>& device_types) {
  AutocastState out;
  for (const auto type : device_types)
    out.entries.push_back({type, at::autocast::is_autocast_enabled(type), at::autocast::get_autocast_dtype(type)});
  out.cache_enabled = at::autocast::is_autocast_cache_enabled();
  return out;
}

TRAINKIT_INLINE bool AutocastState::any_enabled() const {
  return std::any_of(entries.begin(), entries.end(), [](const Entry& e) { return e.enabled; });
}

TRAINKIT_INLINE void AutocastState::apply() const {
  for (const auto& e : entries) {
    at::autocast::set_autocast_enabled(e.device_type, e.enabled);
    at::autocast::set_autocast_dtype(e.device_type, e.dtype);
  }
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

TRAINKIT_INLINE std::vector<c10::DeviceType> autocast_device_types(at::TensorList inputs) {
  std::vector<c10::DeviceType> types{c10::kCPU};
  for (const auto& x : inputs)
    if (std::find(types.begin(), types.end(), x.device().type()) == types.end()) types.push_back(x.device().type());
  return types;
}

TRAINKIT_INLINE AutocastReplay::AutocastReplay(const AutocastState& recorded)
    : nests_(recorded.any_enabled()) {
  std::vector<c10::DeviceType> types;
  for (const auto& e : recorded.entries) types.push_back(e.device_type);
  current_ = AutocastState::capture(types);
  recorded.apply();
  if (nests_) at::autocast::increment_nesting();
}

TRAINKIT_INLINE AutocastReplay::~AutocastReplay() {
  if (nests_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  current_.apply();
}

TRAINKIT_INLINE AutocastCacheOff::AutocastCacheOff()
    : was_enabled_(at::autocast::is_autocast_cache_enabled()) {
  at::autocast::set_autocast_cache_enabled(false);
}

TRAINKIT_INLINE torch::autograd::variable_list RecomputeFunction::forward(torch::autograd::AutogradContext* ctx,
                                                                          c10::intrusive_ptr<RecomputeState> state,
                                                                          const torch::Tensor& /*dummy*/,
                                                                          at::TensorList inputs) {
  // Apply() runs this under grad mode off: fn keeps no graph, hence no activations.
  state->rng = RngStates::capture(rng_devices(inputs));
  state->autocast = AutocastState::capture(autocast_device_types(inputs));
  state->units = active_unit_schedule();
  torch::autograd::variable_list outputs;
  {
    AutocastCacheOff no_cache;
    outputs = state->forward(inputs.vec());
  }
  ctx->save_for_backward(inputs.vec());
  ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
  return outputs;
}

TRAINKIT_INLINE torch::autograd::variable_list RecomputeFunction::backward(torch::autograd::AutogradContext* ctx,
                                                                           torch::autograd::variable_list grad_outputs) {
  // The reentrant design accumulates fn's parameter gradients into .grad by a backward of its
  // own; under grad() or backward(inputs) they would land in .grad instead of being returned.
  TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
              "tk::recompute: a recomputed forward can only be differentiated by backward() "
              "without `inputs`; torch::autograd::grad() and backward(..., inputs) are not "
              "supported (the parameters' gradients would go to .grad, not be returned)");
  // The engine runs backward with grad mode = create_graph.
  TORCH_CHECK(!torch::GradMode::is_enabled(),
              "tk::recompute: higher-order gradients (backward with create_graph=true) through a "
              "recomputed forward are not supported; call fn directly where they are needed");
  auto state = c10::static_intrusive_pointer_cast<RecomputeState>(ctx->saved_data["state"].toCapsule());

  // Leaves cut from the outer graph: the second forward's graph ends at them and at fn's
  // parameters, and their .grad are the gradients this node returns.
  torch::autograd::variable_list inputs;
  for (const auto& saved : ctx->get_saved_variables()) {
    auto leaf = saved.detach();
    leaf.requires_grad_(saved.requires_grad());
    inputs.push_back(std::move(leaf));
  }

  torch::autograd::variable_list outputs;
  {
    RngReplay rng(state->rng);
    AutocastReplay autocast(state->autocast);
    // (A tk::unit inside fn is gathered again for its recomputation, by the schedule of the
    // forward that recorded it: the backward runs on autograd's thread, where none is active.)
    UnitScheduleScope units(state->units);
    torch::AutoGradMode grad(true);
    outputs = state->forward(inputs);
  }
  TORCH_CHECK(outputs.size() == grad_outputs.size(), "tk::recompute: fn returned ", grad_outputs.size(),
              " tensor(s) at forward but ", outputs.size(),
              " when recomputed at backward; fn must do the same on both runs");

  torch::autograd::variable_list roots, root_grads;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].requires_grad() || !grad_outputs[i].defined()) continue;
    TORCH_CHECK(outputs[i].sizes() == grad_outputs[i].sizes(), "tk::recompute: output ", i, " of fn has shape ",
                grad_outputs[i].sizes(), " at forward but ", outputs[i].sizes(),
                " when recomputed at backward; fn must do the same on both runs");
    roots.push_back(outputs[i]);
    root_grads.push_back(grad_outputs[i]);
  }
  // Grad mode is off here (no create_graph), so AccumulateGrad adds into a defined .grad.
  if (!roots.empty()) torch::autograd::backward(roots, root_grads);

  torch::autograd::variable_list grads{torch::Tensor(), torch::Tensor()};  // state, dummy
  for (const auto& leaf : inputs) grads.push_back(leaf.requires_grad() ? leaf.grad() : torch::Tensor());
  return grads;
}

}  // namespace detail
}  // namespace trainkit
