#pragma once
/// Data parallelism over a process group (<trainkit/parallel/process_group.hpp>): tk::DataParallel, the
/// Replicas a trainer talks to the other ranks through (replicas.hpp's contract).
///
///   auto group = tk::ProcessGroup::create(tk::DistributedOptions().timeout_seconds(600), device);
///   Trainer trainer(model, tk::AdamW{1e-4, 1e-4}, options);
///   trainer.set_replicas(std::make_shared<tk::DataParallel>(group));   // rank 0's weights to all
///   tk::DistributedSampler sampler(size, batch, group.rank(), group.world_size(), seed);
///   ... micro_step on sampler.batch(epoch, i) ...; log and save where group.is_main()
///
/// Communication: the gradient is summed once per window (phase 5, docs/design/optimizer-phase.md)
/// by a bucketed all-reduce of the trainer's flat gradient storage, `bucket_bytes` per
/// collective, started bucket by bucket during the window's last backward as the gradients
/// become ready (TrainerOptions::overlap_reduction), or all at its end; the division by the
/// world size is folded into the factor the trainer already applies (no extra pass). Nothing is
/// sent inside a window. Sharded (TrainerOptions::sharding): a reduce-scatter of the same
/// buckets, the slices' squared norms in one all-reduce, an all-gather of the updated
/// parameters. Failures are the process group's (its file comment).
#include <trainkit/detail/inline.hpp>
#include <trainkit/parallel/process_group.hpp>
#include <trainkit/step/replicas.hpp>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace trainkit {

/// Replicas over a ProcessGroup (replicas.hpp): rank 0's weights at attach, the gradient summed
/// by a bucketed all-reduce once per window, the same state checked after load.
class DataParallel final : public Replicas {
 public:
  /// DDP's default bucket: 25 MiB.
  static constexpr std::int64_t kDefaultBucketBytes = 25 * 1024 * 1024;

  explicit DataParallel(ProcessGroup group, std::int64_t bucket_bytes = kDefaultBucketBytes);

  /// At world size 1, cut the trainer's buffers as a sharded run does (TrainerOptions::sharding:
  /// one slice of every bucket, which is the whole bucket) and install the overlap's hooks:
  /// the reduce-scatters (PREMUL_SUM with item counts on NCCL), all-gathers, gathers to rank 0,
  /// released gradients and hook-launched buckets of sharding then all run, each on one rank,
  /// with the results of one process. For checking that code on a single device (the GPU check,
  /// benchmarks/gpu/nccl_startup.cpp); it costs the collectives' time. No effect with more ranks.
  DataParallel& shard_at_world_size_one(bool on);
  bool shards_alone() const override { return shard_alone_ && world_size() == 1; }

  int rank() const override { return group_.rank(); }
  int world_size() const override { return group_.world_size(); }
  const ProcessGroup& group() const { return group_; }
  bool store_gone() const override { return group_.store_gone(); }
  std::int64_t bucket_bytes() const override { return bucket_bytes_; }
  /// All-reduce calls per window for a gradient of `numel` elements of `element_size` bytes.
  std::int64_t buckets(std::int64_t numel, std::int64_t element_size = 4) const;
  /// Optimizer phases this replica has reduced.
  std::int64_t windows() const { return windows_; }

  TRAINKIT_PARALLEL_INLINE void attach(torch::nn::Module& model, const torch::Tensor& flat_params,
                              const torch::Tensor& rewritten = torch::Tensor()) override;

  TRAINKIT_PARALLEL_INLINE std::unique_ptr<Reduction> start_reduction(torch::Tensor& flat_grad, torch::Tensor local,
                                                             const detail::Partition& partition, const WindowWeights& window,
                                                             bool closes) override;
  TRAINKIT_PARALLEL_INLINE std::unique_ptr<Reduction> start_unit_reduction(GradientBuckets buckets, torch::Tensor local,
                                                                  const detail::Partition& partition, const WindowWeights& window,
                                                                  bool closes) override;
  TRAINKIT_PARALLEL_INLINE torch::Tensor global_norm(const torch::Tensor& local) override;
  TRAINKIT_PARALLEL_INLINE void sum(torch::Tensor& values) override;
  TRAINKIT_PARALLEL_INLINE void all_gather(torch::Tensor& flat, const detail::Partition& partition) override;
  TRAINKIT_PARALLEL_INLINE void gather_bucket(const torch::Tensor& mine, const torch::Tensor& bucket, const std::string& what) override;
  TRAINKIT_PARALLEL_INLINE std::function<void()> start_gather_bucket(const torch::Tensor& mine, const torch::Tensor& bucket, const std::string& what) override;
  TRAINKIT_PARALLEL_INLINE torch::Tensor gather_to_main(const torch::Tensor& local, const detail::Partition& partition) override;
  /// Kept with the process group (ProcessGroup::keep_after_failure), after its backend.
  void keep_after_failure(c10::DataPtr memory, std::int64_t bytes) override {
    group_.keep_after_failure(std::move(memory), bytes);
  }
  std::int64_t kept_after_failure() const override { return group_.kept_after_failure(); }
  TRAINKIT_PARALLEL_INLINE void check_same_state(const std::vector<torch::Tensor>& state, const std::string& what) override;

  TRAINKIT_PARALLEL_INLINE void all_reduce(std::vector<double>& values, Reduce op) override;
  TRAINKIT_PARALLEL_INLINE void sum_counts(torch::Tensor& counts) override;

 private:
  // Phase 5 bucket by bucket (Replicas::start_reduction): the weighting at the start, each
  // bucket's collective at launch(), the item count and the waits at finish().
  class BucketReduction final : public Reduction {
   public:
    BucketReduction(DataParallel& owner, GradientBuckets buckets, std::int64_t element_size, torch::Tensor local,
                    detail::Partition partition, const WindowWeights& window, bool closes);
    TRAINKIT_PARALLEL_INLINE ~BucketReduction() override;

    void limit_in_flight(size_t n) { max_in_flight_ = std::min(max_in_flight_, n); }
    TRAINKIT_PARALLEL_INLINE void launch(std::int64_t b) override;
    TRAINKIT_PARALLEL_INLINE GradientFactor finish() override;

   private:
    DataParallel& owner_;
    GradientBuckets buckets_;
    torch::Tensor local_;
    std::vector<std::int64_t> bucket_of_;  // each work's bucket (-1: the item count)
    detail::Partition partition_;
    std::vector<bool> launched_;
    std::string step_;
    c10d::ReduceOp op_ = c10d::ReduceOp::SUM;
    double premultiplier_ = 1.0;
    torch::Tensor weight_, items_;
    GradientFactor factor_;
    std::vector<c10::intrusive_ptr<c10d::Work>> works_;
    std::vector<std::string> names_;
    size_t waited_ = 0, max_in_flight_ = static_cast<size_t>(-1);

    void wait_next();
  };

  void check_partition(const detail::Partition& partition, const torch::Tensor& flat) const;

  void check_device(const torch::Tensor& t, const std::string& what) const;

  ProcessGroup group_;
  std::int64_t bucket_bytes_;
  std::int64_t windows_ = 0;
  bool shard_alone_ = false;
};

}  // namespace trainkit

#if !defined(TRAINKIT_COMPILED_LIB) || !defined(TRAINKIT_COMPILED_PARALLEL)
#include <trainkit/parallel/data_parallel-inl.hpp>
#endif
