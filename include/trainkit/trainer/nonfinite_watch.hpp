#pragma once
/// Where a gradient stops being finite: the overflow diagnosis. Off, it costs nothing (no ATen
/// call, no hook). On (AnyTrainer::watch_nonfinite; the fit loop's RunLog turns it on after a
/// log window that reported skipped steps, and off after a clean one), each optimizer phase
/// counts, per trainable parameter, the windows whose gradient (as phases 6-7's norm sees it:
/// reduced over the ranks, still scaled) is not finite there, on the device: a view per
/// parameter's part of the gradient, `_foreach_norm` over them in fp32, `isfinite` and an
/// `index_add_` (about ten ATen calls besides the views; no host read). A hook on each
/// trainable parameter records, once, the order in which the backward produces their gradients.
///
/// The origin: an overflow in a layer's backward makes every gradient computed after it
/// non-finite too (it flows on to the layers before it), so of the modules whose gradient was
/// not finite, the one the backward reached first is nearest to where it began: the overflow
/// is in its own backward (its weight's gradient) or in the backward of the module the
/// backward reached just before it (the gradient it passes on). NonfiniteCounts::origin names
/// both. The order is the backward's as measured, not guessed from the model's structure (a
/// weight used in two places is reached at its use nearest the input: a tied output embedding
/// counts as the input's).
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

/// What the overflow diagnosis counted since it was last read, on the host.
struct NonfiniteCounts {
  std::vector<std::string> names;            ///< the trainable parameters, in the model's order
  std::vector<std::int64_t> windows;         ///< per parameter: windows with a non-finite gradient there
  std::vector<std::int64_t> backward_order;  ///< parameter indices, in the order the backward reached them

  bool any() const { return std::any_of(windows.begin(), windows.end(), [](std::int64_t w) { return w > 0; }); }

  /// The module that holds parameter `name` ("encoder.layer.3.attention.query.weight" ->
  /// "encoder.layer.3.attention.query"; a parameter of the root module: itself).
  static std::string module_of(const std::string& name) {
    const auto dot = name.rfind('.');
    return dot == std::string::npos ? name : name.substr(0, dot);
  }

  /// The modules in the order the backward reached their parameters (nearest the loss first;
  /// parameters it never reached last), each once.
  std::vector<std::string> module_order() const {
    std::vector<std::int64_t> order = backward_order;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(names.size()); ++i)
      if (std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
    std::vector<std::string> out;
    for (const auto i : order) {
      auto module = module_of(names.at(static_cast<size_t>(i)));
      if (std::find(out.begin(), out.end(), module) == out.end()) out.push_back(std::move(module));
    }
    return out;
  }

  /// The modules with a count, in module_order(), each with the most windows any of its
  /// parameters counted.
  std::vector<std::pair<std::string, std::int64_t>> modules() const {
    std::map<std::string, std::int64_t> most;
    for (size_t i = 0; i < names.size(); ++i)
      if (windows.at(i) > 0) most[module_of(names[i])] = std::max(most[module_of(names[i])], windows[i]);
    std::vector<std::pair<std::string, std::int64_t>> out;
    for (const auto& m : module_order())
      if (most.count(m)) out.emplace_back(m, most[m]);
    return out;
  }

  /// Where it begins: the first module with a count that the backward reached, and the module
  /// it reached just before (empty when none). An overflow in a module's backward shows first
  /// in the gradient of the module that backward feeds (or in the module's own, when its weight
  /// gradient overflows): the origin is one of the two.
  std::pair<std::string, std::string> origin() const {
    const auto order = module_order();
    const auto flagged = modules();
    if (flagged.empty()) return {};
    const auto at = std::find(order.begin(), order.end(), flagged.front().first);
    return {*at, at == order.begin() ? std::string() : *(at - 1)};
  }

  /// "non-finite gradients in 3 modules (windows, nearest the loss first): encoder.layer.2.output
  /// (12), ...; first seen at encoder.layer.2.output (nearest the loss): the overflow is in
  /// encoder.layer.2.output's own weight gradient or in the backward of encoder.layer.3.attention,
  /// which computes the gradient flowing into encoder.layer.2.output"; empty when none. At most
  /// `shown` modules are named.
  std::string text(std::size_t shown = 6) const {
    const auto m = modules();
    if (m.empty()) return {};
    std::string s = "non-finite gradients in " + std::to_string(m.size()) + (m.size() == 1 ? " module" : " modules") +
                    " (windows, nearest the loss first): ";
    for (std::size_t k = 0; k < m.size() && k < shown; ++k)
      s += (k ? ", " : "") + m[k].first + " (" + std::to_string(m[k].second) + ")";
    if (m.size() > shown) s += ", and " + std::to_string(m.size() - shown) + " more";
    const auto [first, before] = origin();
    s += "; first seen at " + first + " (nearest the loss): the overflow is in " + first + "'s own weight gradient";
    s += before.empty() ? std::string(" or in the loss's gradient")
                        : " or in the backward of " + before + ", which computes the gradient flowing into " + first;
    return s;
  }
};

namespace detail {

/// The trainer's side of the diagnosis (see the file comment).
class NonfiniteWatch {
 public:
  NonfiniteWatch() = default;
  NonfiniteWatch(const NonfiniteWatch&) = delete;
  NonfiniteWatch& operator=(const NonfiniteWatch&) = delete;
  ~NonfiniteWatch() { set(false, {}, torch::kCPU); }  // (the model keeps no hook of it)
  bool on() const { return on_; }

  /// On: hooks on `params` (the model's trainable parameters, in its order) that record the
  /// backward's order once; off: the hooks removed, the counts dropped.
  void set(bool on, const std::vector<torch::Tensor>& params, torch::Device device) {
    if (on == on_) return;
    on_ = on;
    if (!on) {
      for (size_t i = 0; i < hooks_.size(); ++i) params_[i].remove_hook(hooks_[i]);
      hooks_.clear();
      params_.clear();
      counts_ = owners_ = owners_host_ = torch::Tensor();
      return;
    }
    params_ = params;
    order_ = std::make_shared<Order>();
    order_->seen.assign(params.size(), false);
    for (size_t i = 0; i < params_.size(); ++i)
      hooks_.push_back(params_[i].register_hook([order = order_, i](const torch::Tensor&) {
        if (!order->seen[i]) order->seen[i] = true, order->indices.push_back(static_cast<std::int64_t>(i));
      }));
    counts_ = torch::zeros({static_cast<std::int64_t>(params.size())}, torch::TensorOptions().dtype(torch::kLong).device(device));
  }

  /// Phases 6-7 with the diagnosis on: the windows count of each parameter whose part of the
  /// phase's gradient is not finite grows by one (a parameter cut into several slices counts
  /// once). `Storage`: FlatStorage or MasterStorage (gradient_parts).
  template <class Storage>
  void count(const Storage& storage) {
    std::vector<torch::Tensor> parts;
    std::vector<std::int64_t> owners;
    storage.gradient_parts(parts, owners);
    if (parts.empty()) return;
    if (!owners_.defined() || owners_.numel() != static_cast<std::int64_t>(owners.size())) {
      // Once per turn-on (the parts do not change). On CUDA from pinned memory without a wait,
      // as the LR table is: a pageable copy would wait for the stream.
      owners_host_ = torch::tensor(owners, torch::kLong);
      if (counts_.device().is_cuda()) owners_host_ = owners_host_.pin_memory();
      owners_ = owners_host_.to(counts_.device(), /*non_blocking=*/true);
    }
    const auto norms = at::stack(at::_foreach_norm(parts, 2, at::kFloat));
    const auto bad = at::isfinite(norms).logical_not();
    const auto per_parameter = torch::zeros_like(counts_).index_add_(0, owners_, bad.to(torch::kLong));
    counts_.add_(per_parameter.clamp_max(1));
  }

  /// The counts since the last call (one host read), with the backward's order; zero after.
  NonfiniteCounts take(std::vector<std::string> names) {
    NonfiniteCounts c;
    c.names = std::move(names);
    c.windows.assign(c.names.size(), 0);
    if (!on_) return c;
    const auto host = counts_.cpu();
    for (std::int64_t i = 0; i < host.numel() && i < static_cast<std::int64_t>(c.windows.size()); ++i)
      c.windows[static_cast<size_t>(i)] = host.data_ptr<std::int64_t>()[i];
    c.backward_order = order_->indices;
    counts_.zero_();
    return c;
  }

 private:
  struct Order {
    std::vector<bool> seen;
    std::vector<std::int64_t> indices;
  };
  bool on_ = false;
  std::vector<torch::Tensor> params_;
  std::vector<unsigned> hooks_;
  std::shared_ptr<Order> order_;
  torch::Tensor counts_, owners_, owners_host_;  // owners_host_: the copy's source, kept while it may run
};

}  // namespace detail
}  // namespace trainkit
