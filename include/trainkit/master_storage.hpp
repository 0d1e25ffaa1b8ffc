#pragma once
/// The storage of master weights (PrecisionPolicy<MasterWeights<T>>; the contract is
/// storage.hpp's). The flat fp32 buffer holds the masters; the model's parameters are views
/// into a flat half buffer of the same layout and their .grad views into a flat half gradient
/// (detail::HalfStorage), except normalisation layers with TrainerOptions::keep_norm_fp32,
/// which stay views into the masters with a small fp32 gradient of their own. The model then
/// receives its inputs as they are (the autocast region casts fp32 inputs for matmul-like ops).
/// Checkpoints hold the masters; loading restores the half parameters from them.
///
/// The window's gradient is summed in fp32 (step.md §3): after each backward that the phase
/// does not follow, the half gradient joins an fp32 sum. In the optimizer phase the gradient
/// is fp32 in one of two ways, chosen per phase:
///   whole    the half gradient cast into one fp32 buffer (or added to the window's sum),
///            reduced over the ranks in fp32 (phase 5), then norm and update as FlatStorage
///   chunked  one process, or a half all-reduce (TrainerOptions::reduce_precision), with no
///            fp32 sum in the window and a model over TrainerOptions::master_chunk: the norm
///            and the update each cast one chunk at a time, so the phase adds one chunk, not
///            4 bytes per parameter
/// After the update the half parameters are rewritten from the masters (one copy); a skipped
/// step left the masters unchanged, so it rewrites the same values (no host sync to tell).
#include <trainkit/detail/master_weights.hpp>
#include <trainkit/storage.hpp>

#include <map>
#include <optional>
#include <string>
#include <unordered_set>

namespace trainkit {

class MasterStorage : public detail::FlatParameters {
 public:
  /// A torch::optim::Optimizer would update the model's half parameters, not the masters.
  static constexpr bool accepts_torch_optimizer = false;
  static void validate(const TrainerOptions&, const std::string&) {}

  MasterStorage(torch::nn::Module& model, const TrainerOptions& options, torch::Device device, at::ScalarType half)
      : options_(options) {
    auto placed = place(model, options, device, static_cast<std::int64_t>(c10::elementSize(half)),
                        /*any_floating_point=*/true);
    allocate_parameters(device);
    std::unordered_set<const c10::TensorImpl*> kept;  // parameters that stay fp32 (views into the masters)
    if (options.keep_norm_fp32()) kept = detail::normalisation_parameters(model);
    half_.allocate_parameters(layout_.padded(), half, device);
    detail::store_untrained_in(model, half, options.keep_norm_fp32());
    std::int64_t kept_numel = 0;
    for (auto& e : placed) {
      auto master = copy_in(e);
      if (kept.count(e.param.unsafeGetTensorImpl())) {
        e.param.set_data(master);
        kept_numel += e.param.numel();
      } else {
        masters_.emplace(e.name, master);
        e.param.set_data(half_.param_view(e.offset, e.param.numel()).view(e.param.sizes()));
      }
    }
    release_cached(device);
    half_.allocate_gradients(kept_numel);
    for (auto& e : placed) {
      const auto n = e.param.numel();
      e.param.mutable_grad() = (kept.count(e.param.unsafeGetTensorImpl()) ? half_.add_kept(e.offset, n)
                                                                         : half_.grad_view(e.offset, n))
                                   .view(e.param.sizes());
      record_view(e);
    }
    make_groups(placed, torch::Tensor());  // (the groups' gradient is bound in each phase)
    half_.finish();
    half_.write_back(params_);
  }

  /// The fp32 gradient of the optimizer phase (whole); undefined between windows and in a
  /// chunked phase.
  const torch::Tensor& gradients() const { return grad_; }
  /// The flat half storage the model's parameters and .grad are views into (same layout as
  /// parameters()), and the fp32 gradients of the parameters kept in fp32 (undefined: none).
  const torch::Tensor& half_parameters() const { return half_.params(); }
  const torch::Tensor& half_gradients() const { return half_.grad(); }
  const torch::Tensor& kept_gradients() const { return half_.kept_grad(); }
  /// How many chunks the last optimizer phase cast its fp32 gradient in; 0 when it was whole.
  std::int64_t phase_chunks() const { return phase_chunks_; }

  void attach(Replicas& replicas, torch::nn::Module& model) {
    replicas.attach(model, params_);
    half_.write_back(params_);  // rank 0's masters
    single_process_ = dynamic_cast<const SingleProcess*>(&replicas) != nullptr;
  }
  // A backward the phase does not follow: its half gradient joins the window's fp32 sum.
  void backward_done(bool closes) {
    if (!closes) half_.accumulate();
  }

  // 5. The mode of this phase (the file comment), then the sum over the ranks.
  GradientFactor reduce(Replicas& replicas, const WindowWeights& window) {
    std::optional<GradientFactor> reduced;
    if (reduce_half())
      reduced = half_.reduce_in_half([&](torch::Tensor& h) { return replicas.reduce_gradients(h, window); });
    if ((single_process_ || reduced) && !half_.summed().defined() && params_.numel() > options_.master_chunk()) {
      chunk_ = torch::empty({(options_.master_chunk() + 63) / 64 * 64}, params_.options());
      return reduced ? *reduced : GradientFactor{window.rescale, {}};  // (one process: nothing to sum)
    }
    grad_ = half_.gather();
    bind_gradients(grad_);
    return reduced ? *reduced : replicas.reduce_gradients(grad_, window);
  }
  torch::Tensor norm() {
    return chunk_.defined() ? half_.norm_in_chunks(chunk_) : at::linalg_vector_norm(grad_, 2);
  }
  template <class Update>
  void update(Update&& f) {
    phase_chunks_ = 0;
    if (chunk_.defined()) {
      const auto total = params_.numel(), size = chunk_.numel();
      for (std::int64_t begin = 0; begin < total; begin += size, ++phase_chunks_) {
        const auto n = std::min(size, total - begin);
        auto part = chunk_.narrow(0, 0, n);
        half_.gradient_chunk(begin, n, part);
        f(groups_in(begin, part), part);
      }
    } else {
      f(groups_, grad_);
    }
    half_.write_back(params_);  // the model's half parameters from the masters, one copy
  }
  // The half and kept gradients zeroed; the phase's fp32 gradient and chunk released.
  void zero() {
    half_.zero_grad();
    grad_ = torch::Tensor();
    chunk_ = torch::Tensor();
    bind_gradients(grad_);
  }

  void save_window(torch::serialize::OutputArchive& archive) const {
    layout_.write(archive, "window.gradient_half", half_.grad());
    if (half_.summed().defined()) layout_.write(archive, "window.gradient_sum", half_.summed());
    if (half_.kept_grad().defined()) detail::write_tensor(archive, "window.gradient_kept", half_.kept_grad());
  }
  void load_window(torch::serialize::InputArchive& archive) {
    layout_.read_into(archive, "window.gradient_half", half_.grad());
    torch::Tensor sum;  // the fp32 sum of the window's earlier micro-batches, when it has some
    if (archive.try_read("window.gradient_sum", sum, /*is_buffer=*/true))
      layout_.unpack_into(sum, half_.summed_for_load(), "checkpoint record 'window.gradient_sum'");
    else
      half_.drop_sum();
    if (half_.kept_grad().defined()) detail::read_into(archive, "window.gradient_kept", half_.kept_grad());
  }
  /// A checkpoint holds a parameter's fp32 master where there is one, else the parameter.
  const torch::Tensor& stored(const std::string& name, const torch::Tensor& param) const {
    const auto it = masters_.find(name);
    return it != masters_.end() ? it->second : param;
  }
  void parameters_loaded() { half_.write_back(params_); }

 private:
  // Whether this phase all-reduces the half gradient: data parallel, no fp32 sum in the
  // window, and reduce_precision half (automatic: half for FP16, fp32 for BF16).
  bool reduce_half() const {
    const auto p = options_.reduce_precision();
    const bool half = p == ReducePrecision::half ||
                      (p == ReducePrecision::automatic && half_.params().scalar_type() == at::kHalf);
    return half && !single_process_ && !half_.summed().defined();
  }

  TrainerOptions options_;
  detail::HalfStorage half_;
  std::map<std::string, torch::Tensor> masters_;  // name -> fp32 master (kept parameters have none)
  torch::Tensor grad_;   // the phase's whole fp32 gradient
  torch::Tensor chunk_;  // the chunked phase's fp32 chunk
  bool single_process_ = true;
  std::int64_t phase_chunks_ = 0;
};

}  // namespace trainkit
