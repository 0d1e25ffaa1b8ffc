#pragma once
/// Machinery of master weights (PrecisionPolicy<MasterWeights<T>>, see precision.hpp): which
/// parameters stay fp32, and the model-facing half storage that mirrors the trainer's flat
/// fp32 storage element for element.
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/released_storage.hpp>

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/normalization.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <unordered_set>
#include <vector>

namespace trainkit::detail {

/// LibTorch's normalisation layers (Apex O2 keeps these in fp32).
bool is_normalisation_layer(const torch::nn::Module& m);

/// The parameters of normalisation layers, by TensorImpl.
std::unordered_set<const c10::TensorImpl*> normalisation_parameters(torch::nn::Module& model);

/// Stores in `dtype` what the trainer does not flatten: parameters without requires_grad, and
/// the floating-point buffers of normalisation layers (their kernels want the running stats
/// in the parameters' dtype). Other buffers stay as the model made them. Skips normalisation
/// layers when `keep_norm_fp32`.
void store_untrained_in(torch::nn::Module& model, at::ScalarType dtype, bool keep_norm_fp32);

/// The model's half parameters and gradients: two flat buffers laid out exactly as the
/// trainer's fp32 master storage (same offsets). Parameters kept in fp32 leave their slices here
/// unused; they are views into the masters, and their gradients live in a small compact fp32
/// buffer (`kept`).
///
/// A window's gradients are summed in fp32 (docs/design/storage.md), not in the half .grad: after each
/// micro-batch but the window's last, accumulate() adds the half gradient into an fp32 buffer
/// and zeroes it; gather() adds the last one. Summing N half gradients in half precision would
/// round at every addition (bf16 keeps 8 significant bits: over 16 micro-batches the sum is off
/// by about 1%; trainkit's test measures it). With one micro-batch per window the fp32 gradient
/// exists only during the optimizer phase, so between windows the model costs 4 (master) + 2 +
/// 2 bytes per parameter plus the optimizer's state; with several, the fp32 sum stays: + 4.
/// With one micro-batch per window and one process, a model larger than
/// TrainerOptions::master_chunk runs its optimizer phase in chunks (norm_in_chunks,
/// gradient_chunk): the phase adds one chunk, not 4 bytes per parameter.
class HalfStorage {
 public:
  /// The half parameters, before the model's parameters are moved into them; the gradients
  /// come after (allocate_gradients), once the model's old storage is released.
  void allocate_parameters(std::int64_t numel, at::ScalarType dtype, torch::Device device);
  void allocate_gradients(std::int64_t kept_numel);
  torch::Tensor param_view(std::int64_t offset, std::int64_t n) const { return params_.narrow(0, offset, n); }
  torch::Tensor grad_view(std::int64_t offset, std::int64_t n) const { return grad_.narrow(0, offset, n); }
  /// The gradient slice of a parameter kept in fp32 at [offset, offset + n) of the masters.
  torch::Tensor add_kept(std::int64_t offset, std::int64_t n);
  /// After the last add_kept().
  void finish();

  /// After a micro-batch that does not close its window: the half gradient into the fp32 sum
  /// (a copy for the window's first, else an add), and the half gradient to 0. No host sync.
  void accumulate();
  /// The window's fp32 gradient, in master layout: the half gradient cast into a fresh fp32
  /// buffer (one micro-batch), or added to the fp32 sum (several; the sum is returned), plus one
  /// scatter of the kept parameters' fp32 gradients. The phase may change it in place.
  torch::Tensor gather();
  /// The chunked optimizer phase (one micro-batch in the window, so no fp32 sum): the window's
  /// fp32 gradient is never whole, only `chunk` elements at a time in a buffer of that size.
  /// norm_in_chunks: the L2 norm of the window's gradient (half and kept), each chunk cast
  /// into `buffer` (its norm in fp32, as the whole gradient's would be), then the norm of those
  /// norms. No host sync.
  torch::Tensor norm_in_chunks(torch::Tensor& buffer) const;
  /// Elements [begin, begin + n) of the window's fp32 gradient in master layout, into `out`
  /// (n elements): the half gradient cast, and the kept parameters' gradients in their places.
  void gradient_chunk(std::int64_t begin, std::int64_t n, torch::Tensor& out);

  /// Data parallel in half precision: `reduce(half_gradient)` on the whole window's gradient.
  /// The kept parameters' fp32 gradients join it in their (otherwise unused, zero) slices,
  /// rounded to the half dtype as every other gradient, and come back after.
  template <class Reduce>
  auto reduce_in_half(Reduce&& reduce) {
    if (kept_index_.defined()) grad_.index_copy_(0, kept_index_, kept_grad_.to(grad_.scalar_type()));
    auto result = reduce(grad_);
    if (kept_index_.defined()) {
      kept_grad_.copy_(grad_.index_select(0, kept_index_));
      grad_.index_fill_(0, kept_index_, 0);
    }
    return result;
  }

  /// Appends its buffers to `out` (MasterStorage::held_tensors).
  void held_tensors(std::vector<torch::Tensor>& out) const {
    out.insert(out.end(), {params_, grad_, kept_grad_, kept_index_, sum_});
  }

  /// The fp32 sum of the window's micro-batches before the current half gradient; undefined
  /// when there is none (at a window's start, or one micro-batch per window). Checkpoints.
  torch::Tensor summed() const { return summed_ ? sum_ : torch::Tensor(); }
  void drop_sum() { summed_ = false; }
  /// A checkpoint's fp32 sum, to be read into (allocated on first use).
  torch::Tensor& summed_for_load();
  /// The model's parameters from the masters: one copy (a cast, rounding to nearest).
  void write_back(const torch::Tensor& masters);
  /// The gradients to zero (`release`: the half gradient's memory freed instead, its views
  /// kept, until allocate_if_released(); Sharding::gradients between windows).
  void zero_grad(bool release = false);
  /// Before a backward: the half gradient's memory back (zeros) if it was released.
  void allocate_if_released();
  /// The half buffers at `numel` elements (the sharded partition's padding, zeros); the
  /// caller points the model's parameters and .grad at the new ones.
  void extend(std::int64_t numel);
  /// Sharded, a half reduction: the kept parameters' fp32 gradients into their (otherwise
  /// unused, zero) slots of the half gradient, rounded to the half dtype as every other
  /// gradient, before the gradient is reduce-scattered.
  void put_kept_in_half();

  const torch::Tensor& params() const { return params_; }
  const torch::Tensor& grad() const { return grad_; }
  /// The gradients of the parameters kept in fp32 (undefined when there are none).
  const torch::Tensor& kept_grad() const { return kept_grad_; }

 private:
  // sum_ += grad_ (fp32 += half). On the CPU, ATen casts a half input to fp32 as a whole
  // temporary first (4 bytes per parameter: measured, +191 MiB for 50 M elements); slices of
  // 1 Mi elements keep that temporary at 4 MiB (larger ones, 16 MiB, stayed in glibc's heap).
  // CUDA kernels cast as they read: one call.
  torch::Tensor& add_into_sum();
  void ensure_sum() {  // (zeros: the flat layout's gaps must stay 0)
    if (!sum_.defined()) sum_ = torch::zeros({grad_.numel()}, grad_.options().dtype(torch::kFloat));
  }

  torch::Tensor params_, grad_, kept_grad_, kept_index_;
  torch::Tensor kept_index_host_;  // kept_index_ on the host (chunk bounds, no device read)
  torch::Tensor sum_;    // fp32 sum of the window's earlier micro-batches (accumulate())
  bool summed_ = false;  // sum_ holds this window's micro-batches
  std::int64_t kept_used_ = 0;
  std::vector<torch::Tensor> kept_positions_;
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/master_weights-inl.hpp>
#endif
