#pragma once
/// Parameter storage: where a trainer's parameters, gradients and fp32 masters live. The
/// precision policy chooses it (`Precision::storage`, built with `Precision::storage_dtype`):
/// FlatStorage for FP32, BF16 and FP16, MasterStorage (master_storage.hpp) for
/// PrecisionPolicy<MasterWeights<T>>. Everything that
/// depends on where a parameter's gradient, master copy and update live is a storage's; the
/// trainer's step calls the same members whatever the storage is.
///
/// Contract — what the trainer calls, and when (every rank makes the same calls in the same order):
///   Storage(model, options, device, dtype)
///                                     at construction: the trainable parameters become views
///                                     into one flat fp32 buffer (parameters()), 64-byte aligned
///                                     and grouped by LR multiplier and weight decay (groups());
///                                     their .grad become views of the storage's gradient
///   attach(replicas)                  Trainer::set_replicas: every rank takes rank 0's values
///   backward_done(closes)             after each backward (micro-step phase 3); `closes`: the
///                                     optimizer phase follows before the next backward
///   reduce(replicas, window)          optimizer phase 5: the gradient summed over the ranks;
///                                     returns the factor that makes it the window's mean
///   norm()                            phases 6-7: the L2 norm of the still-scaled gradient (a
///                                     device scalar, no host sync)
///   update(f)                         phase 9: f(groups, gradient) once per chunk of the part of
///                                     the flat buffer this rank updates; after it, the model's
///                                     parameters hold the update
///   zero()                            phase 11 (and a dropped window)
///   check()                           once per window: the model's parameters and their .grad
///                                     are still the storage's views
///   save_window / load_window         the open window's gradient, for a checkpoint inside one
///   stored(name, param)               what a checkpoint holds for a parameter; after records
///                                     were read into those, parameters_loaded()
/// Guarantees: the gaps between parameters are zeros in every flat buffer (they change no norm
/// and no update); the gradient exists in fp32 (whole or chunk by chunk) inside the phase.
///
/// A third storage of the same interface shards the update: its groups() and update() cover
/// only this rank's contiguous slice of the flat buffer, reduce() reduce-scatters, norm() sums
/// the shards' squares with one small all-reduce, and update() all-gathers the parameters.
#include <trainkit/detail/flat_layout.hpp>
#include <trainkit/optim.hpp>
#include <trainkit/options.hpp>
#include <trainkit/precision.hpp>
#include <trainkit/replicas.hpp>

#include <c10/core/CachingDeviceAllocator.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

namespace detail {

/// A trainable parameter and where the storage puts it.
struct PlacedParameter {
  std::string name;
  torch::Tensor param;
  double lr_mult = 1.0;
  bool decay = true;
  std::int64_t offset = 0;  ///< in the flat buffers
};

/// The machinery both storages share: placing the parameters, the groups, the view check.
class FlatParameters {
 public:
  const torch::Tensor& parameters() const { return params_; }
  const FlatLayout& layout() const { return layout_; }
  const std::vector<ParamGroup>& groups() const { return groups_; }
  std::int64_t parameter_count() const { return layout_.packed(); }

  /// Once per window, a pointer compare per parameter.
  void check() const {
    for (const auto& v : views_)
      if (v.param.data_ptr() != v.param_data)
        throw std::logic_error(
            "Trainer: parameter '" + v.name + "' no longer lives in the trainer's storage: its data were replaced "
            "after the trainer was built (torch::load(model, file), param.set_data(...), model->to(...)), so the "
            "optimizer would update a copy the model does not read and the loss would never change. Load weights "
            "or move the model before building the trainer, or use trainer.load(path) or tk::load_weights(model, "
            "path), which copy into the parameters");
    for (const auto& v : views_)
      if (!v.param.grad().defined() || v.param.grad().data_ptr() != v.grad_data)
        throw std::logic_error(
            "Trainer: the .grad of parameter '" + v.name +
            "' was replaced or reset (model->zero_grad() or an optimizer's zero_grad()?); the "
            "trainer owns gradients and zeroes them itself after each optimizer step");
  }

 protected:
  /// The trainable parameters of `model` on `device`, grouped by (LR multiplier, decay) in
  /// order of first appearance (the model's order inside each group), placed in layout_ with
  /// each parameter 64-byte aligned for elements of `element_size` bytes.
  std::vector<PlacedParameter> place(torch::nn::Module& model, const TrainerOptions& options, torch::Device device,
                                     std::int64_t element_size, bool any_floating_point) {
    std::vector<bool> no_decay_used(options.no_decay().size(), false);
    std::vector<PlacedParameter> placed;
    for (const auto& p : model.named_parameters(true)) {
      if (!p.value().requires_grad()) continue;
      const auto& t = p.value();
      TORCH_CHECK(t.device() == device, "Trainer: parameter '", p.key(), "' is on ", t.device(),
                  ", the others on ", device, "; move the whole model to one device first");
      if (any_floating_point) {
        TORCH_CHECK(t.is_floating_point(), "Trainer: parameter '", p.key(), "' is ", t.scalar_type(),
                    "; master weights need floating-point parameters");
      } else {
        TORCH_CHECK(t.scalar_type() == torch::kFloat, "Trainer: parameter '", p.key(), "' is ", t.scalar_type(),
                    "; trainkit keeps parameters in fp32 (mixed precision comes from the precision policy)");
      }
      PlacedParameter e{p.key(), t};
      for (const auto& [substring, m] : options.lr_mult())
        if (p.key().find(substring) != std::string::npos) {
          e.lr_mult = m;
          break;
        }
      for (size_t k = 0; k < options.no_decay().size(); ++k)
        if (p.key().find(options.no_decay()[k]) != std::string::npos) e.decay = false, no_decay_used[k] = true;
      placed.push_back(std::move(e));
    }
    for (size_t k = 0; k < no_decay_used.size(); ++k)
      TORCH_CHECK(no_decay_used[k], "Trainer: no_decay (TRAIN.NO_DECAY) '", options.no_decay()[k],
                  "' is in no trainable parameter's name (they look like '",
                  placed.empty() ? std::string() : placed.front().name, "')");
    using Key = std::pair<double, bool>;
    std::vector<Key> order;
    for (const auto& e : placed)
      if (std::find(order.begin(), order.end(), Key{e.lr_mult, e.decay}) == order.end()) order.push_back({e.lr_mult, e.decay});
    const auto rank = [&](const PlacedParameter& e) { return std::find(order.begin(), order.end(), Key{e.lr_mult, e.decay}); };
    std::stable_sort(placed.begin(), placed.end(),
                     [&](const PlacedParameter& a, const PlacedParameter& b) { return rank(a) < rank(b); });
    layout_ = FlatLayout(aligned_elements(element_size));
    for (auto& e : placed) e.offset = layout_.add(e.param.numel());
    return placed;
  }

  /// The flat fp32 buffer, its gaps zero (before the parameters are copied in).
  void allocate_parameters(torch::Device device) {
    params_ = torch::empty({layout_.padded()}, torch::dtype(torch::kFloat).device(device));
    layout_.zero_gaps(params_);
  }

  /// The view of `e` in params_, its values copied in.
  torch::Tensor copy_in(const PlacedParameter& e) {
    torch::NoGradGuard no_grad;
    auto view = params_.narrow(0, e.offset, e.param.numel()).view(e.param.sizes());
    view.copy_(e.param);
    return view;
  }

  /// The parameters' old blocks back to the device before the gradients are allocated (CUDA's
  /// caching allocator would keep them, and a model's worth of small blocks cannot serve one
  /// flat gradient): the construction peak stays at twice the model, not three times.
  static void release_cached(torch::Device device) {
    if (!device.is_cpu()) c10::getDeviceAllocator(device.type())->emptyCache();
  }

  /// One group per run of parameters with the same (LR multiplier, decay): slices of params_
  /// and of `grads` (undefined: bound in each optimizer phase).
  void make_groups(const std::vector<PlacedParameter>& placed, const torch::Tensor& grads) {
    std::int64_t begin = 0;
    for (size_t i = 0; i < placed.size(); ++i) {
      const auto& e = placed[i];
      if (i == 0 || placed[i - 1].lr_mult != e.lr_mult || placed[i - 1].decay != e.decay) begin = e.offset;
      const bool ends = i + 1 == placed.size() || placed[i + 1].lr_mult != e.lr_mult || placed[i + 1].decay != e.decay;
      if (!ends) continue;
      const auto end = e.offset + e.param.numel();
      groups_.push_back({params_.narrow(0, begin, end - begin),
                         grads.defined() ? grads.narrow(0, begin, end - begin) : torch::Tensor(), e.lr_mult, e.decay,
                         layout_.slice(begin, end)});
    }
  }

  /// Records the views check() compares against (after each parameter's data and .grad are set).
  void record_view(const PlacedParameter& e) {
    views_.push_back({e.param, e.param.grad().data_ptr(), e.param.data_ptr(), e.name});
  }

  /// The groups' gradients as slices of `grads` (the whole flat gradient), or none.
  void bind_gradients(const torch::Tensor& grads) {
    for (auto& g : groups_)
      g.grads = grads.defined() ? grads.narrow(0, g.params.storage_offset(), g.params.numel()) : torch::Tensor();
  }

  /// The groups restricted to flat elements [begin, begin + part.numel()), their gradients in
  /// `part` (a chunk); a group outside the range has undefined params.
  std::vector<ParamGroup> groups_in(std::int64_t begin, const torch::Tensor& part) const {
    const auto end = begin + part.numel();
    std::vector<ParamGroup> out(groups_.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      const auto first = groups_[g].params.storage_offset(), last = first + groups_[g].params.numel();
      const auto lo = std::max(begin, first), hi = std::min(end, last);
      if (lo >= hi) continue;
      out[g].params = params_.narrow(0, lo, hi - lo);
      out[g].grads = part.narrow(0, lo - begin, hi - lo);
      out[g].lr_mult = groups_[g].lr_mult;
      out[g].decay = groups_[g].decay;
      out[g].state_offset = lo - first;
    }
    return out;
  }

  FlatLayout layout_;
  torch::Tensor params_;  // the flat fp32 parameters (the masters, with master weights)
  std::vector<ParamGroup> groups_;

 private:
  struct View {
    torch::Tensor param;
    const void* grad_data;   // the .grad's storage
    const void* param_data;  // the parameter's
    std::string name;
  };
  std::vector<View> views_;
};

}  // namespace detail

/// FP32, BF16 and FP16: the parameters are views into one flat fp32 buffer and their .grad
/// into a flat fp32 gradient that autograd accumulates into in place, across the window's
/// micro-batches. The optimizer phase reads the gradient as one tensor.
class FlatStorage : public detail::FlatParameters {
 public:
  /// Whether a torch::optim::Optimizer may update the parameters (it sees the model's own).
  static constexpr bool accepts_torch_optimizer = true;
  static void validate(const TrainerOptions& options, const std::string& trainer) {
    if (options.reduce_precision() == ReducePrecision::half)
      throw std::invalid_argument(
          "trainkit::TrainerOptions: reduce_precision half needs master weights (PrecisionPolicy<MasterWeights<T>>): "
          "without them the gradient is fp32, and " + trainer + " all-reduces it as it is");
  }

  /// `dtype`: the precision's storage_dtype, fp32 (the model's parameters are the flat buffer).
  FlatStorage(torch::nn::Module& model, const TrainerOptions& options, torch::Device device,
              at::ScalarType dtype = at::kFloat) {
    TORCH_CHECK(dtype == at::kFloat, "FlatStorage holds fp32 parameters, not ", dtype);
    auto placed = place(model, options, device, /*element_size=*/4, /*any_floating_point=*/false);
    allocate_parameters(device);
    for (auto& e : placed) e.param.set_data(copy_in(e));  // (releases the parameter's old storage)
    release_cached(device);
    grad_ = torch::zeros({layout_.padded()}, params_.options());
    for (auto& e : placed) {
      e.param.mutable_grad() = grad_.narrow(0, e.offset, e.param.numel()).view(e.param.sizes());
      record_view(e);
    }
    make_groups(placed, grad_);
  }

  /// The flat gradient (every trainable parameter's .grad is a view into it).
  const torch::Tensor& gradients() const { return grad_; }

  void attach(Replicas& replicas, torch::nn::Module& model) { replicas.attach(model, params_); }
  void backward_done(bool /*closes*/) {}
  GradientFactor reduce(Replicas& replicas, const WindowWeights& window) {
    return replicas.reduce_gradients(grad_, window);
  }
  torch::Tensor norm() const { return at::linalg_vector_norm(grad_, 2); }
  template <class Update>
  void update(Update&& f) {
    f(groups_, grad_);
  }
  void zero() { grad_.zero_(); }

  void save_window(torch::serialize::OutputArchive& archive) const { layout_.write(archive, "window.gradient", grad_); }
  void load_window(torch::serialize::InputArchive& archive) { layout_.read_into(archive, "window.gradient", grad_); }
  const torch::Tensor& stored(const std::string& /*name*/, const torch::Tensor& param) const { return param; }
  void parameters_loaded() {}

 private:
  torch::Tensor grad_;
};

}  // namespace trainkit
