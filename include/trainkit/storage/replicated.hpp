#pragma once
/// The mode Replicated (mode.hpp): every rank holds every buffer whole, and phase 5 all-reduces
/// the gradient, bucket by bucket (no rank at all in one process). Stage 0, and every stage in
/// one process. The optimizer phase is the storage's own on its whole buffers (reduce_whole,
/// norm_whole, update_whole); with the overlap (TrainerOptions::overlap_reduction) the window's
/// reduction starts before its last backward and each bucket leaves as the hooks find it
/// complete (readiness.hpp).
#include <trainkit/storage/mode.hpp>

namespace trainkit::detail {

class Replicated final : public ShardingMode {
 public:
  /// `replicas`: null before the storage is attached; `overlap`: the hooks installed at attach.
  Replicated(StorageCore& storage, Replicas* replicas, Partition partition, bool overlap)
      : ShardingMode(storage, replicas, std::move(partition)), overlap_(overlap) {}

  void attach(torch::nn::Module& model) override;
  void backward_done(const BackwardDone& done) override;
  GradientFactor reduce(Replicas& replicas, const WindowWeights& window) override;
  torch::Tensor norm() override;
  void update(const UpdatePart& f) override;
  void zero() override;
  void gradient_parts(std::vector<torch::Tensor>& parts, std::vector<std::int64_t>& owners) const override;
  void save(torch::serialize::OutputArchive& archive, torch::nn::Module& module, const UpdateRule& rule) const override;
  void load(torch::serialize::InputArchive& archive, torch::nn::Module& module, UpdateRule& rule) override;
  void save_window(torch::serialize::OutputArchive& archive, bool snapshot) const override;
  void load_window(torch::serialize::InputArchive& archive, bool snapshot) override;
  const torch::Tensor& replicated_state() const override;
  void write_local(torch::serialize::OutputArchive& archive, const std::string& prefix,
                   const torch::Tensor& local) const override;
  std::vector<ParameterSlice> slices_of(const PlacedParameter& e) const override { return {{e.offset, 0, e.param.numel()}}; }

 private:
  // Also the records of trainkit 0.1, which held the state per group, packed (optim.<kind>.<g>).
  void read_state(torch::serialize::InputArchive& archive, const std::string& prefix,
                  const torch::Tensor& flat) const override;

  bool overlap_;
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/replicated-inl.hpp>
#endif
