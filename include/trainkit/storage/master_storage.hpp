#pragma once
/// The storage of master weights (PrecisionPolicy<MasterWeights<T>>; the contract is
/// storage.hpp's). The flat fp32 buffer holds the masters; the model's parameters are views
/// into a flat half buffer of the same layout and their .grad views into a flat half gradient
/// (detail::HalfStorage), except normalisation layers with TrainerOptions::keep_norm_fp32,
/// which stay fp32 with a small fp32 gradient of their own. The model then receives its inputs
/// as they are (the autocast region casts fp32 inputs for matmul-like ops). Checkpoints hold
/// the masters; loading restores the half parameters from them.
///
/// The window's gradient is summed in fp32 (docs/design/storage.md): after each backward that the phase
/// does not follow, the half gradient joins an fp32 sum. In the optimizer phase the gradient
/// is fp32 in one of three ways, chosen per phase:
///   whole    the half gradient cast into one fp32 buffer (or added to the window's sum),
///            reduced over the ranks in fp32 (phase 5), then norm and update as FlatStorage
///   chunked  one process, or a half all-reduce (TrainerOptions::reduce_precision), with no
///            fp32 sum in the window and a model over TrainerOptions::master_chunk: the norm
///            and the update each cast one chunk at a time, so the phase adds one chunk, not
///            4 bytes per parameter
///   sharded  TrainerOptions::sharding with several ranks: the masters (and the optimizer's
///            state) exist for this rank's slices only; the gradient is reduce-scattered
///            into those slices, in half (reduce_precision half) or from the fp32 gradient;
///            the parameters kept in fp32 live in a small buffer of their own that every
///            rank refreshes after the update (one all-reduce of those elements)
/// After the update the half parameters are rewritten from the masters (one copy; sharded,
/// this rank's slices, then an all-gather); a skipped step left the masters unchanged, so it
/// rewrites the same values (no host sync to tell).
///
/// ZeRO stage 3 (Sharding::parameters over several ranks) holds no whole half model either:
/// each unit's half parameters are all-gathered where it is used (storage/sharded_units.hpp)
/// from every rank's half copy of its fp32 master slices (unit_slices_, rewritten after each
/// update); each unit's gradient is summed in fp32 as its half gradients arrive and
/// reduce-scattered in fp32 into this rank's slices at each micro-batch's end. The parameters
/// kept in fp32 stay whole beside the units, as sharded above (their gradient goes through
/// their unit's).
#include <trainkit/detail/inline.hpp>
#include <trainkit/storage/master_weights.hpp>
#include <trainkit/storage/storage.hpp>

#include <optional>
#include <string>
#include <unordered_set>

namespace trainkit {

class MasterStorage : public detail::FlatParameters {
 public:
  /// A torch::optim::Optimizer would update the model's half parameters, not the masters.
  static constexpr bool accepts_torch_optimizer = false;
  static void validate(const TrainerOptions& options, const std::string& trainer) {
    if (options.sharding() == Sharding::parameters && options.reduce_precision() == ReducePrecision::half)
      throw std::invalid_argument("trainkit::TrainerOptions: " + trainer + ": reduce_precision half "
                                  "with ZeRO stage 3 (Sharding::parameters, "
                                  "TRAIN.ZERO_STAGE: 3): each unit's gradient is summed in fp32 as its half gradients "
                                  "arrive and reduce-scattered in fp32 at each micro-batch's end; set reduce_precision "
                                  "automatic or fp32, or use stage 2 for a half reduction");
  }

  MasterStorage(torch::nn::Module& model, const TrainerOptions& options, torch::Device device, at::ScalarType half);

  /// The fp32 gradient of the optimizer phase (whole); undefined between windows and in a
  /// chunked or sharded phase.
  const torch::Tensor& gradients() const { return grad_; }
  /// The flat half storage the model's parameters and .grad are views into (same layout as
  /// the masters), and the fp32 gradients of the parameters kept in fp32 (undefined: none).
  /// ZeRO stage 3 over several ranks has none of the three (undefined): the half parameters
  /// are its units' buffers (sharded_units()), the gradients one fp32 buffer per unit.
  const torch::Tensor& half_parameters() const { return half_.params(); }
  const torch::Tensor& half_gradients() const { return half_.grad(); }
  const torch::Tensor& kept_gradients() const { return half_.kept_grad(); }
  /// FlatParameters::held_tensors, the fp32 gradient and chunk, the kept parameters and the
  /// half storage's buffers.
  void held_tensors(std::vector<torch::Tensor>& out) const {
    FlatParameters::held_tensors(out);
    out.insert(out.end(), {grad_, chunk_, kept_params_});
    half_.held_tensors(out);
  }
  /// How many chunks the last optimizer phase cast its fp32 gradient in; 0 when it was whole.
  std::int64_t phase_chunks() const { return phase_chunks_; }

  bool attach(Replicas& replicas, torch::nn::Module& model);
  void backward_begins(const detail::BackwardDone& done) {
    if (units_) begin_unit_backward(done);
    else half_.allocate_if_released();
  }
  /// The half gradient's memory, where Sharding::gradients released it, allocated (zeros): for
  /// a backward outside the step (the memory plan's measurement), which zero() releases again.
  void allocate_gradient() {
    if (!units_) half_.allocate_if_released();  // (stage 3: one per unit, as needed)
  }
  /// Sharding::gradients or parameters with several ranks: each micro-batch's gradient is
  /// reduce-scattered into this rank's slices of the window's sum at its end.
  bool reduces_each_micro_batch() const { return shards_gradients(); }
  /// With reduces_each_micro_batch(): the gradient of a micro-batch that failed before its
  /// reduction dropped (the half one, or stage 3's units'); the window's earlier micro-batches,
  /// already summed, stay.
  void discard_micro_batch() {
    if (!units_) return half_.zero_grad(/*release=*/true);
    drop_backward();
  }
  // A backward the phase does not follow: its half gradient joins the window's fp32 sum, or
  // with Sharding::gradients this rank's slices of it (at the micro-batch's end).
  void backward_done(const detail::BackwardDone& done);

  // 5. The mode of this phase (the file comment), then the sum over the ranks.
  GradientFactor reduce(Replicas& replicas, const WindowWeights& window);
  torch::Tensor norm();
  /// The gradient norm() sees, parameter by parameter (the overflow diagnosis): the slices, the
  /// whole fp32 gradient, or with the chunked phase the half gradient and the fp32-kept
  /// parameters' own (TrainerOptions::keep_norm_fp32: their slots in the half one are unused
  /// zeros).
  void gradient_pieces(std::vector<torch::Tensor>& pieces, std::vector<std::int64_t>& owners) const {
    if (sharded() || grad_.defined()) return pieces_of(sharded() ? local_grad_ : grad_, pieces, owners);
    pieces_of(half_.grad(), pieces, owners);
    for (size_t i = 0; i < placed_.size(); ++i)
      if (kept_[i] && placed_[i].param.grad().defined()) {
        pieces.push_back(placed_[i].param.grad().view({-1}));
        owners.push_back(placed_[i].order);
      }
  }
  template <class Update>
  void update(Update&& f) {
    phase_chunks_ = 0;
    if (sharded()) {
      if (units_) units_->settle_all();  // (the half slices are a gather's input)
      for (std::int64_t b = 0; b < partition_.buckets(); ++b) {
        auto part = local_grad_.narrow(0, partition_.local(b), partition_.slice(b).length);
        f(slice_groups(b, params_, /*params_local=*/true, local_grad_), part);
      }
      write_back_sharded();
      return;
    }
    if (chunk_.defined()) {
      const auto total = params_.numel(), size = chunk_.numel();
      for (std::int64_t begin = 0; begin < total; begin += size, ++phase_chunks_) {
        const auto n = std::min(size, total - begin);
        auto part = chunk_.narrow(0, 0, n);
        half_.gradient_chunk(begin, n, part);
        f(chunk_groups({begin, n}, params_.narrow(0, begin, n), part, begin), part);
      }
    } else {
      f(groups_, grad_);
    }
    half_.write_back(params_);  // the model's half parameters from the masters, one copy
  }
  // The half and kept gradients zeroed; the phase's fp32 gradient and chunk released.
  void zero();

  /// The fp32 masters by parameter name (model.param.<name>; the half model's frozen
  /// parameters as they are) and the rule's flat state.
  void save(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
            const detail::UpdateRule& rule) const;
  void load(torch::serialize::InputArchive& archive, torch::nn::Module& module, detail::UpdateRule& rule);
  void snapshot(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                const detail::UpdateRule& rule) const;
  void restore(torch::serialize::InputArchive& archive, torch::nn::Module& module, detail::UpdateRule& rule);
  /// What every rank must hold alike after a load: the masters, or sharded the half model
  /// (stage 3: its root unit).
  const torch::Tensor& replicated_state() const {
    return units_ ? root_unit() : sharded() ? half_.params() : params_;
  }

  /// The open window's gradient (a checkpoint inside a window, PARTIAL_WINDOW: span): the half
  /// gradient and the fp32 sum as they are, or with Sharding::gradients the reduced sum of the
  /// window's micro-batches so far, gathered by parameter name (a collective).
  void save_window(torch::serialize::OutputArchive& archive, bool snapshot = false) const;
  void load_window(torch::serialize::InputArchive& archive, bool snapshot = false);

 private:
  bool shards_gradients() const {
    return sharded() && (options_.sharding() == Sharding::gradients || options_.sharding() == Sharding::parameters);
  }

  // Whether this phase all-reduces the half gradient: data parallel, no fp32 sum in the
  // window, and reduce_precision half (automatic: half for FP16, fp32 for BF16).
  bool reduce_half() const;

  // attach() with sharding: the half buffers padded to the partition, the masters cut to this
  // rank's slices, the kept parameters moved into a buffer of their own.
  void shard();
  // attach() with stage 3: the kept parameters moved into a buffer of their own, the whole
  // half buffers dropped, the masters cut into units (FlatParameters::shard_into_units).
  void shard_units();
  // The kept parameters made views of kept_params_ (back to back), their values from `masters`
  // (the whole fp32 masters, in the layout the parameters are placed in now).
  void move_kept(const torch::Tensor& masters);
  // Once the partition is made: the kept elements this rank updates, in its slices and in
  // kept_params_ (kept_local_index_, kept_compact_index_).
  void index_kept();

  // Sharded: the window's gradient reduce-scattered into this rank's slices (in half when
  // reduce_precision asks for it and the window has one micro-batch; else from the fp32
  // gradient), added to the window's earlier micro-batches with Sharding::gradients.
  GradientFactor scatter_into_sum(const WindowWeights& window, bool closes);
  bool half_precision_reduction() const;

  // Sharded phase 9's end: this rank's masters into its slices of the half model, the kept
  // parameters from every rank's masters (an all-reduce of those elements), then the half
  // model's slices from every rank (stage 3: into the half slices, and the root unit gathered).
  void write_back_sharded();

  TrainerOptions options_;
  torch::Device device_;
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
