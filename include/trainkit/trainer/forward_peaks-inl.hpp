#pragma once
/// The definitions of trainkit/trainer/forward_peaks.hpp (header-only: included by it; compiled
/// mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/trainer/forward_peaks.hpp>
#include <trainkit/archive/checkpoint_io.hpp>

#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <stdexcept>
#include <utility>

namespace trainkit {

TRAINKIT_INLINE double ForwardPeakTable::range(int kind) {
  switch (kind) {
    case half: return static_cast<double>(std::numeric_limits<c10::Half>::max());
    case bfloat16: return static_cast<double>(std::numeric_limits<c10::BFloat16>::max());
    default: return static_cast<double>(std::numeric_limits<float>::max());
  }
}

TRAINKIT_INLINE const char* ForwardPeakTable::kind_name(int kind) {
  return kind == half ? "fp16" : kind == bfloat16 ? "bf16" : "fp32";
}

TRAINKIT_INLINE bool ForwardPeakTable::any() const {
  return std::any_of(peaks.begin(), peaks.end(), [](double p) { return p >= 0; });
}

TRAINKIT_INLINE std::vector<ForwardPeakTable::Row> ForwardPeakTable::rows() const {
  std::vector<std::int64_t> order = forward_order;  // (then the modules only another rank reached)
  for (std::int64_t m = 0; m < static_cast<std::int64_t>(modules.size()); ++m)
    if (std::find(order.begin(), order.end(), m) == order.end()) order.push_back(m);
  std::vector<Row> out;
  for (const auto m : order) {
    Row row;
    row.fraction = -1;
    for (int k = 0; k < kinds; ++k) {
      const double p = peak(static_cast<size_t>(m), k);
      if (p < 0) continue;
      const double f = p / range(k);
      if (f > row.fraction) row.peak = p, row.kind = k, row.fraction = f;
    }
    if (row.fraction < 0) continue;
    row.module = modules.at(static_cast<size_t>(m));
    out.push_back(std::move(row));
  }
  std::stable_sort(out.begin(), out.end(), [](const Row& a, const Row& b) { return a.fraction > b.fraction; });
  return out;
}

TRAINKIT_INLINE std::string ForwardPeakTable::first_nonfinite() const {
  if (origin >= 0) return modules.at(static_cast<size_t>(origin));
  for (const auto m : forward_order)  // (not finite on another rank only: this rank's order)
    for (int k = 0; k < kinds; ++k)
      if (std::isinf(peak(static_cast<size_t>(m), k))) return modules.at(static_cast<size_t>(m));
  for (size_t m = 0; m < modules.size(); ++m)  // (reached on another rank only)
    for (int k = 0; k < kinds; ++k)
      if (std::isinf(peak(m, k))) return modules[m];
  return {};
}

TRAINKIT_INLINE std::string ForwardPeakTable::text(size_t top) const {
  std::string out;
  const std::string origin = first_nonfinite();
  if (!origin.empty())
    out = "the forward's output is first not finite in " + origin + " (every module after it receives it); ";
  out += "largest |output| per module, nearest its dtype's range first: ";
  const auto all = rows();
  for (size_t i = 0; i < all.size() && i < top; ++i) {
    const Row& r = all[i];
    if (i > 0) out += "; ";
    out += r.module + " ";
    if (std::isinf(r.peak)) {
      out += std::string("not finite (") + kind_name(r.kind) + ")";
      continue;
    }
    char buffer[64];
    std::snprintf(buffer, sizeof buffer, "%.3g (%s, %.3g%% of %.6g)", r.peak, kind_name(r.kind), 100 * r.fraction,
                  range(r.kind));
    out += buffer;
  }
  if (all.empty()) out += "none recorded";
  if (missed > 0)
    out += " (" + std::to_string(missed) + " output(s) not measured on this rank: " + error + ")";
  return out;
}

namespace detail {

struct ForwardPeaksState {
  std::vector<std::string> modules;                                  // slots; 0 is the model
  std::vector<std::int64_t> parent;                                  // slot -> its parent's slot
  std::vector<torch::Tensor> parameters;                             // (kept alive: their impls are keys)
  std::unordered_map<const c10::TensorImpl*, std::int64_t> slot_of;  // parameter -> its module's slot
  // Since take(): per counted output its max |x| (fp32, 0-dim, on its device) and its
  // slot * kinds + kind; the slots in the order first reached.
  std::vector<torch::Tensor> values;
  std::vector<std::int64_t> keys;
  std::vector<std::int64_t> forward_order;
  std::vector<char> reached;
  std::int64_t missed = 0;  // outputs not measured: the reduction failed (out of memory...)
  std::string error;        // the first such failure
  // While recording: the last module whose parameters an operator used; the operators' nesting.
  std::int64_t last = 0, depth = 0;
  bool recording = false;
};

// The state whose Recording this thread runs (the observer is a plain function pointer).
TRAINKIT_INLINE ForwardPeaksState*& recording_forward_peaks() {
  thread_local ForwardPeaksState* state = nullptr;
  return state;
}

struct ForwardOpContext : at::ObserverContext {
  std::int64_t slot = -1;  // -1: an operator inside another (not counted)
  std::vector<const c10::StorageImpl*> inputs;  // its tensor inputs' storages (a view of one is not counted)
};

TRAINKIT_INLINE void add_storages(const c10::IValue& v, std::vector<const c10::StorageImpl*>& out) {
  const auto add = [&](const at::Tensor& t) {
    if (t.defined() && t.has_storage()) out.push_back(t.storage().unsafeGetStorageImpl());
  };
  if (v.isTensor()) add(v.toTensor());
  else if (v.isTensorList())
    for (const auto& t : v.toTensorVector()) add(t);
}

TRAINKIT_INLINE std::int64_t forward_slot(ForwardPeaksState& s, const c10::IValue& v) {
  const auto of = [&](const at::Tensor& t) -> std::int64_t {
    if (!t.defined()) return -1;
    const auto it = s.slot_of.find(t.unsafeGetTensorImpl());
    return it == s.slot_of.end() ? -1 : it->second;
  };
  if (v.isTensor()) return of(v.toTensor());
  if (v.isTensorList())
    for (const auto& t : v.toTensorVector())
      if (const auto slot = of(t); slot >= 0) return slot;
  return -1;
}

TRAINKIT_INLINE std::unique_ptr<at::ObserverContext> forward_op_starts(const at::RecordFunction& fn) {
  auto context = std::make_unique<ForwardOpContext>();
  ForwardPeaksState* s = recording_forward_peaks();
  if (s == nullptr || s->depth++ > 0) return context;
  std::int64_t slot = -1;
  for (const auto& input : fn.inputs()) {
    if (slot < 0) slot = forward_slot(*s, input);
    add_storages(input, context->inputs);
  }
  if (slot >= 0) s->last = slot;
  context->slot = slot >= 0 ? slot : s->parent.at(static_cast<size_t>(s->last));
  return context;
}

TRAINKIT_INLINE int forward_kind(at::ScalarType t) {
  return t == at::kHalf ? ForwardPeakTable::half : t == at::kBFloat16 ? ForwardPeakTable::bfloat16 : ForwardPeakTable::wider;
}

TRAINKIT_INLINE void forward_op_ends(const at::RecordFunction& fn, at::ObserverContext* context) {
  ForwardPeaksState* s = recording_forward_peaks();
  if (s == nullptr) return;
  --s->depth;
  const auto* op = static_cast<ForwardOpContext*>(context);
  const auto slot = op ? op->slot : -1;
  if (slot < 0) return;
  try {
    // The reduction is not the forward's: not observed, not differentiated, not autocast.
    at::DisableRecordFunctionGuard unobserved;
    torch::NoGradGuard no_grad;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto count = [&](const at::Tensor& t) {
      if (!t.defined() || !t.is_floating_point() || t.layout() != at::kStrided || t.is_meta() || t.numel() == 0)
        return;
      // A view of an input holds the input's values (an operator's own result returned as a
      // view, as linear's on 3-D input, is counted).
      if (t.is_view() && std::find(op->inputs.begin(), op->inputs.end(), t.storage().unsafeGetStorageImpl()) !=
                             op->inputs.end())
        return;
      const double inf = std::numeric_limits<double>::infinity();
      s->values.push_back(t.scalar_type() == at::kDouble
                              ? at::linalg_vector_norm(t, inf)  // (fp32 would narrow it)
                              : at::linalg_vector_norm(t, inf, std::nullopt, false, at::kFloat));
      s->keys.push_back(slot * ForwardPeakTable::kinds + forward_kind(t.scalar_type()));
      if (!s->reached[static_cast<size_t>(slot)]) {
        s->reached[static_cast<size_t>(slot)] = 1;
        s->forward_order.push_back(slot);
      }
    };
    for (const auto& out : fn.outputs()) {
      if (out.isTensor()) count(out.toTensor());
      else if (out.isTensorList())
        for (const auto& t : out.toTensorVector()) count(t);
    }
  } catch (const std::exception& e) {  // (out of memory among them: the forward goes on, its replay too)
    ++s->missed;
    if (s->error.empty()) s->error = std::string("after ") + fn.name() + ": " + first_line_of(e);
  }
}

}  // namespace detail

TRAINKIT_INLINE ForwardPeaks::ForwardPeaks(const torch::nn::Module& model)
    : state_(std::make_unique<detail::ForwardPeaksState>()) {
  auto& s = *state_;
  std::map<std::string, std::int64_t> slot_of_module{{"", 0}};
  s.modules.push_back("(model)");
  s.parent.push_back(0);
  // A module's slot, made (with its parents') at its first parameter.
  const std::function<std::int64_t(const std::string&)> slot = [&](const std::string& path) -> std::int64_t {
    if (const auto it = slot_of_module.find(path); it != slot_of_module.end()) return it->second;
    const auto dot = path.rfind('.');
    const std::int64_t parent = slot(dot == std::string::npos ? std::string() : path.substr(0, dot));
    const auto made = static_cast<std::int64_t>(s.modules.size());
    s.modules.push_back(path);
    s.parent.push_back(parent);
    slot_of_module[path] = made;
    return made;
  };
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const auto dot = item.key().rfind('.');
    const std::int64_t module = slot(dot == std::string::npos ? std::string() : item.key().substr(0, dot));
    s.parameters.push_back(item.value());
    s.slot_of.emplace(item.value().unsafeGetTensorImpl(), module);  // (a tied weight: its first module)
  }
  s.reached.assign(s.modules.size(), 0);
}

TRAINKIT_INLINE ForwardPeaks::~ForwardPeaks() = default;

TRAINKIT_INLINE ForwardPeaks::Recording::Recording(detail::ForwardPeaksState* state) : state_(state) {
  auto& active = detail::recording_forward_peaks();
  TORCH_CHECK(!state->recording && active == nullptr,
              "ForwardPeaks::record: a recording is already running on this thread; one at a time");
  state->recording = true;
  state->depth = 0;
  state->last = 0;
  active = state;
  handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(detail::forward_op_starts, detail::forward_op_ends)
                                           .needsInputs(true)
                                           .needsOutputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
}

TRAINKIT_INLINE ForwardPeaks::Recording::Recording(Recording&& other) noexcept
    : state_(std::exchange(other.state_, nullptr)), handle_(std::exchange(other.handle_, 0)) {}

TRAINKIT_INLINE ForwardPeaks::Recording& ForwardPeaks::Recording::operator=(Recording&& other) noexcept {
  if (this != &other) {
    stop();
    state_ = std::exchange(other.state_, nullptr);
    handle_ = std::exchange(other.handle_, 0);
  }
  return *this;
}

TRAINKIT_INLINE void ForwardPeaks::Recording::stop() noexcept {
  if (state_ == nullptr) return;
  at::removeCallback(handle_);
  detail::recording_forward_peaks() = nullptr;
  state_->recording = false;
  state_ = nullptr;
}

TRAINKIT_INLINE ForwardPeaks::Recording ForwardPeaks::record() { return Recording(state_.get()); }

TRAINKIT_INLINE std::int64_t ForwardPeaks::outputs_recorded() const {
  return static_cast<std::int64_t>(state_->values.size());
}

TRAINKIT_INLINE ForwardPeaks::Mark ForwardPeaks::mark() const {
  return {state_->values.size(), state_->forward_order.size()};
}

TRAINKIT_INLINE void ForwardPeaks::discard_since(const Mark& m) {
  auto& s = *state_;
  if (m.outputs < s.values.size()) {
    s.values.resize(m.outputs);
    s.keys.resize(m.outputs);
  }
  while (s.forward_order.size() > m.reached) {
    s.reached[static_cast<size_t>(s.forward_order.back())] = 0;
    s.forward_order.pop_back();
  }
}

TRAINKIT_INLINE ForwardPeakTable ForwardPeaks::take() {
  auto& s = *state_;
  ForwardPeakTable table;
  table.missed = std::exchange(s.missed, 0);
  table.error = std::exchange(s.error, std::string());
  table.modules = s.modules;
  table.peaks.assign(s.modules.size() * ForwardPeakTable::kinds, -1.0);
  table.forward_order = std::move(s.forward_order);
  // One read per device: the values grouped by device, stacked, copied to the host.
  std::map<std::string, std::vector<size_t>> by_device;
  for (size_t i = 0; i < s.values.size(); ++i) by_device[s.values[i].device().str()].push_back(i);
  std::vector<double> value(s.values.size());
  for (const auto& [device, indices] : by_device) {
    std::vector<torch::Tensor> group;
    for (const auto i : indices) group.push_back(s.values[i]);
    const auto host = torch::stack(group).to(at::kDouble).cpu();  // (fp32, and fp64 outputs' own)
    const double* v = host.data_ptr<double>();
    for (size_t j = 0; j < indices.size(); ++j)
      value[indices[j]] = std::isfinite(v[j]) ? v[j] : std::numeric_limits<double>::infinity();
  }
  for (size_t i = 0; i < value.size(); ++i) {  // (in the forward's order)
    double& peak = table.peaks.at(static_cast<size_t>(s.keys[i]));
    peak = std::max(peak, value[i]);
    if (table.origin < 0 && std::isinf(value[i])) table.origin = s.keys[i] / ForwardPeakTable::kinds;
  }
  s.values.clear();
  s.keys.clear();
  s.forward_order.clear();
  std::fill(s.reached.begin(), s.reached.end(), 0);
  return table;
}

}  // namespace trainkit
