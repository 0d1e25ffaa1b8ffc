#pragma once
/// The storage of master weights (PrecisionPolicy<MasterWeights<T>>; storage.hpp states the
/// contract). The flat fp32 buffer holds the masters; the model's parameters are views into a
/// flat half buffer of the same layout and their .grad views into a flat half gradient
/// (detail::HalfStorage), except normalisation layers with TrainerOptions::keep_norm_fp32,
/// which stay fp32 with a small fp32 gradient of their own. The model then receives its inputs
/// as they are (the autocast region casts fp32 inputs for matmul-like ops). Checkpoints hold
/// the masters; loading restores the half parameters from them.
///
/// The window's gradient is summed in fp32 (docs/design/storage.md): after each backward that
/// the phase does not follow, the half gradient joins an fp32 sum. Replicated, the optimizer
/// phase's fp32 gradient is made in one of two ways, chosen per phase:
///   whole    the half gradient cast into one fp32 buffer (or added to the window's sum),
///            reduced over the ranks in fp32 (phase 5), then norm and update as FlatStorage
///   chunked  one process, or a half all-reduce (TrainerOptions::reduce_precision), with no
///            fp32 sum in the window and a model over TrainerOptions::master_chunk: the norm
///            and the update each cast one chunk at a time, so the phase adds one chunk, not
///            4 bytes per parameter
/// After the update the half parameters are rewritten from the masters (one copy); a skipped
/// step left the masters unchanged, so it rewrites the same values (no host sync to tell).
///
/// What it answers for each mode (mode.hpp): stages 1-2 keep the masters (and the optimizer's
/// state) for this rank's slices only; the gradient is reduce-scattered into those slices, in
/// half (reduce_precision half, one micro-batch) or from the fp32 gradient; after the update
/// this rank's masters go into its slices of the half model, which every rank then all-gathers.
/// Stage 3 holds no whole half model either: each unit's half parameters are all-gathered where
/// it is used (sharded_units.hpp) from every rank's half copy of its fp32 master slices; each
/// unit's gradient is summed in fp32 as its half gradients arrive and reduce-scattered in fp32.
/// Sharded, the parameters kept in fp32 live whole in a small buffer of their own that every
/// rank refreshes after the update (one all-reduce of those elements); their gradient goes
/// through the flat gradient (stage 3: their unit's).
#include <trainkit/detail/inline.hpp>
#include <trainkit/storage/master_weights.hpp>
#include <trainkit/storage/storage_base.hpp>

#include <optional>
#include <string>
#include <vector>

namespace trainkit {

class MasterStorage : public detail::StorageBase {
 public:
  /// A torch::optim::Optimizer would update the model's half parameters, not the masters.
  static constexpr bool accepts_torch_optimizer = false;
  static void validate(const TrainerOptions& options, const std::string& trainer);

  MasterStorage(torch::nn::Module& model, const TrainerOptions& options, torch::Device device, at::ScalarType half);

  /// The fp32 gradient of the optimizer phase (whole); undefined between windows and in a
  /// chunked or sharded phase.
  const torch::Tensor& gradients() const { return grad_; }
  /// The flat half storage the model's parameters and .grad are views into (same layout as
  /// the masters), and the fp32 gradients of the parameters kept in fp32 (undefined: none).
  /// Stage 3 over several ranks has none of the three (undefined): the half parameters are its
  /// units' buffers (unit_gathers()), the gradients one fp32 buffer per unit.
  const torch::Tensor& half_parameters() const { return half_.params(); }
  const torch::Tensor& half_gradients() const { return half_.grad(); }
  const torch::Tensor& kept_gradients() const { return half_.kept_grad(); }
  /// StorageBase::held_tensors, the fp32 gradient and chunk, the kept parameters and the half
  /// storage's buffers.
  void held_tensors(std::vector<torch::Tensor>& out) const {
    StorageBase::held_tensors(out);
    out.insert(out.end(), {grad_, chunk_, kept_params_});
    half_.held_tensors(out);
  }
  /// How many chunks the last optimizer phase cast its fp32 gradient in; 0 when it was whole.
  std::int64_t phase_chunks() const { return phase_chunks_; }
  /// Phase 9 (StorageBase::update), counting its chunks afresh.
  void update(const detail::UpdatePart& f) {
    phase_chunks_ = 0;
    StorageBase::update(f);
  }

 protected:
  void prepare_gradient() override { half_.allocate_if_released(); }
  // (A backward the phase does not follow: its half gradient joins the window's fp32 sum.)
  void accumulate() override { half_.accumulate(); }
  torch::Tensor fp32_gradient() override { return half_.gather(); }
  bool reduces_in_place() const override { return false; }
  bool holds_masters() const override { return true; }
  void zero_gradient(bool release) override;
  // Replicated: the whole or chunked phase (the file comment); the half gradient all-reduced
  // in half where TrainerOptions::reduce_precision asks for it.
  GradientFactor reduce_whole(Replicas& replicas, const detail::Partition& partition,
                              const WindowWeights& window) override;
  torch::Tensor norm_whole() override;
  void update_whole(const detail::UpdatePart& f) override;
  // The whole fp32 gradient, or with the chunked phase the half gradient and the fp32-kept
  // parameters' own (their slots in the half one are unused zeros).
  void whole_gradient_parts(std::vector<torch::Tensor>& parts, std::vector<std::int64_t>& owners) const override;
  void save_whole_window(torch::serialize::OutputArchive& archive) const override;
  void load_whole_window(torch::serialize::InputArchive& archive) override;
  std::optional<GradientFactor> reduce_scatter_in_half(Replicas& replicas, const detail::Partition& partition,
                                                       const WindowWeights& window, torch::Tensor& local) override;
  void publish_update(const detail::ShardedUpdate& mode) override;
  const torch::Tensor& whole_model() const override { return half_.params(); }
  void publish_units() override { sum_kept(*mode_->replicas()); }
  void snapshot_precision(torch::serialize::OutputArchive& archive) const override;
  void restore_precision(torch::serialize::InputArchive& archive) override;

  using StorageBase::lay_out;
  void lay_out(detail::Replicated& mode, torch::nn::Module& model) override;
  void lay_out(detail::ShardedUpdate& mode, torch::nn::Module& model) override;
  void lay_out(detail::ShardedUnits& mode, torch::nn::Module& model) override;
  using StorageBase::load_values;
  void load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                   const detail::Replicated& mode) override;
  void load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                   const detail::ShardedUpdate& mode) override;
  void load_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                   const detail::ShardedUnits& mode) override;

 private:
  // Whether this phase all-reduces the half gradient: data parallel, no fp32 sum in the
  // window, and reduce_precision half (automatic: half for FP16, fp32 for BF16).
  bool reduce_half() const;
  bool half_precision_reduction() const;

  // Stages 1-2 at attach: the half buffers padded to the partition, the masters cut to this
  // rank's slices, the kept parameters moved into a buffer of their own.
  void shard(const detail::ShardingMode& mode);
  // The kept parameters made views of kept_params_ (back to back), their values from `masters`
  // (the whole fp32 masters, in the layout the parameters are placed in now).
  void move_kept(const torch::Tensor& masters);
  // Once the partition is made: the kept elements this rank updates, in its slices and in
  // kept_params_ (kept_local_index_, kept_compact_index_).
  void index_kept(const detail::ShardingMode& mode);
  // Sharded, after the update: the kept parameters from every rank's masters (an all-reduce of
  // those elements, each rank contributing the ones it updated).
  void sum_kept(Replicas& replicas);

  detail::HalfStorage half_;
  std::vector<bool> kept_;  // per placed parameter: kept in fp32
  torch::Tensor grad_;      // the phase's whole fp32 gradient
  torch::Tensor chunk_;     // the chunked phase's fp32 chunk
  bool single_process_ = true;
  at::ScalarType half_dtype_;
  std::int64_t phase_chunks_ = 0;
  // Sharded:
  torch::Tensor kept_params_;  // the parameters kept in fp32, back to back
  torch::Tensor kept_local_index_, kept_compact_index_;  // the kept elements this rank updates
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/master_storage-inl.hpp>
#endif
