#pragma once
/// Data-parallel replicas: how a Trainer talks to the other processes that train the same model
/// on other shards of the data. One process (SingleProcess, the trainer's default) has nobody to
/// talk to; <trainkit/parallel/data_parallel.hpp> implements it over PyTorch's c10d (tk::DataParallel).
///
/// Contract — what the trainer calls, and when (every rank makes the same calls in the same order):
///   attach(model, flat_params, rewritten)
///                                 once, from Trainer::set_replicas(): every rank's parameters and
///                                 buffers become rank 0's (those that are views of `rewritten`
///                                 the caller sets from flat_params afterwards)
///   sum_counts(counts)            Trainer::begin_window, before a window of loss terms: each
///                                 term's item count summed over the ranks, in place (a device
///                                 tensor: no host sync; one small collective per window)
///   check_same_state(state, what) after Trainer::load(): throws on every rank unless every rank
///                                 holds the same state (each rank loads the full checkpoint)
/// and, for the storage's buckets (detail::Partition, storage.hpp):
///   start_reduction(flat_grad, local, partition, window, closes) -> Reduction
///                                 phase 5, the one reduction of the gradient, bucket by bucket,
///                                 so that it can overlap the last backward (and, with
///                                 Sharding::gradients, every backward of a window): launch(b)
///                                 sends bucket b (every rank launches the buckets in the same
///                                 order), finish() sends the rest, waits, and returns the
///                                 GradientFactor that makes the sum the mean gradient over every
///                                 rank's micro-batches, items or terms when `closes` (without a
///                                 host sync: an item total stays on the device). `local`
///                                 undefined: each bucket summed over the ranks in place; defined
///                                 (sharded): this rank's slice of each bucket's sum into
///                                 `local`. A non-finite value on any rank is non-finite on every
///                                 rank after the sum, so every rank skips the same steps
///   reduce_buckets(...)           start_reduction() and finish() at once (nothing overlapped)
///   start_unit_reduction(buckets, local, partition, window, closes)
///                                 ZeRO stage 3: as start_reduction into `local`, each bucket's
///                                 gradient its own buffer (GradientBuckets: asked for at its
///                                 launch, told when its collective is done, so that its memory
///                                 can go then)
///   global_norm(local)            phases 6-7: the L2 norm over every rank's `local` slices (one
///                                 small all-reduce of the squares; a device scalar)
///   sum(values)                   phase 9, sharded master weights: the fp32-kept parameters
///   all_gather(flat, partition)   phase 9: every rank's slices of `flat` (this rank's in place)
///                                 to every rank, bucket by bucket
///   gather_bucket(mine, bucket, what)
///                                 ZeRO stage 3, a unit's forward or backward: every rank's
///                                 slice of one bucket (`mine`, this rank's) into `bucket`, its
///                                 own buffer (one all-gather, waited for)
///   start_gather_bucket(mine, bucket, what) -> wait
///                                 the same, launched: `wait()` waits for it (on a GPU the
///                                 current stream waits, no host sync); a unit's gather
///                                 launched ahead (TrainerOptions::unit_prefetch)
///   gather_to_main(local, partition)
///                                 checkpoints: every rank's slices into one host tensor in the
///                                 flat layout on the main rank (undefined on the others)
///   keep_after_failure(memory, bytes)
///                                 a unit's buffer whose gather's wait failed: that collective
///                                 may still write it (on NCCL until the communicator is
///                                 aborted), so it is kept, never reused, until the
///                                 communicator is gone, instead of freed
/// and, for the training loop and the application:
///   rank(), world_size(), is_main()   log and write checkpoints on the main rank only
///   all_reduce(values, op)        a few host scalars combined over the ranks (sum, mean or
///                                 max): metrics, counts, the ranks' agreement on a stop (one
///                                 collective; every rank calls it with as many values). Every
///                                 Joinable handed to join_before_all_reduce() joins first
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/partition.hpp>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

/// How Replicas::all_reduce combines the ranks' values.
enum class Reduce { sum, mean, max };

/// What phase 5 knows about the window it reduces (host values, no device work).
struct WindowWeights {
  /// The accumulation policy's factor: flat_grad * rescale is this rank's mean gradient.
  double rescale = 1.0;
  /// This rank's item count in the window, or -1 with plain 1/N weighting.
  std::int64_t items = -1;
  /// Micro-batches in the window (the same on every rank; the distributed sampler ensures it).
  std::int64_t micro_batches = 0;
  /// The loss is terms weighted by their items over every rank (Trainer::begin_window): each
  /// rank's gradient is already its share of the window's mean, and the ranks' are summed as
  /// they are (rescale is 1, items -1).
  bool normalized = false;
};

/// What phase 5 gives back: the gradient * rescale / total is the mean gradient over every rank's
/// micro-batches or items. `total` is undefined (read as 1) unless the divisor is only known on
/// the device: the window's item count summed over the ranks, as a 0-dim float tensor on the
/// gradient's device, which the trainer folds into the optimizer's divisor (reading it on the
/// host would be a sync every window). A total of 0 makes the step non-finite: it is skipped.
struct GradientFactor {
  double rescale = 1.0;
  torch::Tensor total;
};

/// ZeRO stage 3's gradient, a buffer per bucket (a unit's): `input(b)` gives bucket b's buffer
/// (whole, allocated: the reduction weights it in place), `done(b)` says that its collective has
/// completed (the buffer may be released).
struct GradientBuckets {
  std::function<torch::Tensor(std::int64_t)> input;
  std::function<void(std::int64_t)> done;
};

/// One window's gradient reduction in flight (Replicas::start_reduction).
class Reduction {
 public:
  virtual ~Reduction() = default;
  /// Starts bucket b's collective (at most once per bucket; in the same order on every rank).
  virtual void launch(std::int64_t bucket) = 0;
  /// Starts the buckets not launched yet (in descending order), waits for every one, and
  /// returns phase 5's factor (meaningful when the reduction closes the window).
  virtual GradientFactor finish() = 0;
};

/// What must take part in the other ranks' collectives before a collective of the task's own
/// can pair up (PyTorch's Joinable): ZeRO stage 3's evaluation by unit, in which the ranks may
/// forward different numbers of batches. A storage hands it to its replicas
/// (Replicas::join_before_all_reduce); each all_reduce() joins it first.
class Joinable {
 public:
  virtual ~Joinable() = default;
  /// This rank's forwards are done until the next collective of the task's: take part in the
  /// others' until every rank has come to that point. Nothing when nothing is open.
  virtual void join() = 0;
};

/// See the file comment. Implementations: SingleProcess, tk::DataParallel (data_parallel.hpp).
class Replicas {
 public:
  virtual ~Replicas() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// True on the rank that logs and writes checkpoints.
  bool is_main() const { return rank() == 0; }
  /// Whether the group's store is gone while the ranks' own connections may still work
  /// (torchrun's agent killed): a training loop stops at its next agreement (tk::fit does,
  /// writing a checkpoint, as for SIGTERM). Read at every window: no collective.
  virtual bool store_gone() const { return false; }
  /// tk::fit's ranks agree on stops and checkpoint requests at their log windows, and between
  /// them at least about this often (seconds; windows agreed from the ranks' measured times).
  static constexpr double agreement_seconds = 10.0;

  /// Makes every rank's parameters and buffers (and `flat_params`, the trainer's storage) rank 0's.
  /// Parameters that are views of `rewritten` (where defined) are left alone: the caller sets
  /// them from `flat_params` afterwards (the master weights' half copy), so sending them too
  /// would cost a collective and a temporary of their size for nothing.
  virtual void attach(torch::nn::Module& model, const torch::Tensor& flat_params,
                      const torch::Tensor& rewritten = torch::Tensor()) = 0;
  /// Before a window of loss terms: `counts` (a device tensor, one per term) summed over the
  /// ranks in place, without a host sync. (The default serves one process only.)
  virtual void sum_counts(torch::Tensor&) {
    if (world_size() > 1)
      throw std::logic_error("trainkit::Replicas: this implementation does not sum the loss terms' counts over its " +
                             std::to_string(world_size()) + " ranks (Replicas::sum_counts); Trainer::begin_window needs it");
  }
  /// Throws (on every rank) unless `state` is the same on every rank; `what` names it.
  virtual void check_same_state(const std::vector<torch::Tensor>& state, const std::string& what) = 0;
  /// `values` combined elementwise over the ranks by `op`, in place.
  virtual void all_reduce(std::vector<double>& values, Reduce op) = 0;
  /// How many ranks failed at one point of an operation every rank makes (a load, a save), by
  /// kind: `failed[k]`, this rank's failure of kind k. One all_reduce (a sum) of a few values;
  /// every rank then throws alike. The one agreement on failure (Trainer::load, a checkpoint's
  /// save).
  std::vector<std::int64_t> count_failures(const std::vector<bool>& failed) {
    std::vector<double> counts(failed.begin(), failed.end());
    all_reduce(counts, Reduce::sum);
    return std::vector<std::int64_t>(counts.begin(), counts.end());
  }
  /// `joinable` joins before each all_reduce() from now on, as long as it lives (held weakly).
  void join_before_all_reduce(std::weak_ptr<Joinable> joinable) { joinables_.push_back(std::move(joinable)); }
  /// all_reduce() as a Joinable's own collective (its announcements while it joins): no
  /// Joinable joins first.
  void all_reduce_while_joining(std::vector<double>& values, Reduce op) {
    struct Own {  // (restored on every path)
      bool& joining;
      bool was = std::exchange(joining, true);
      ~Own() { joining = was; }
    } own{joining_};
    all_reduce(values, op);
  }

  // --- sharded storage (see the file comment) ---
  /// Bytes per bucket of the gradient's reduction (the partition's bucket size).
  virtual std::int64_t bucket_bytes() const { return std::int64_t{25} << 20; }
  /// Whether the storage cuts its buffers as a sharded run does even at world size 1 (and
  /// installs the overlap's hooks), so that every collective of sharding runs, each on one
  /// rank: DataParallel::shard_at_world_size_one, the GPU check's way to run them on NCCL.
  virtual bool shards_alone() const { return false; }
  /// Whether the storage cuts its buffers for this many ranks (more than one, or shards_alone).
  bool communicates() const { return world_size() > 1 || shards_alone(); }
  virtual std::unique_ptr<Reduction> start_reduction(torch::Tensor& flat_grad, torch::Tensor local,
                                                     const detail::Partition& partition, const WindowWeights& window,
                                                     bool closes) = 0;
  /// (The default serves implementations that never shard parameters.)
  virtual std::unique_ptr<Reduction> start_unit_reduction(GradientBuckets, torch::Tensor, const detail::Partition&,
                                                          const WindowWeights&, bool) {
    throw std::logic_error("trainkit::Replicas: this implementation does not reduce a gradient held per unit; ZeRO "
                           "stage 3 (Sharding::parameters) needs Replicas::start_unit_reduction");
  }
  /// start_reduction() and finish() at once (nothing overlapped).
  GradientFactor reduce_buckets(torch::Tensor& flat_grad, torch::Tensor local, const detail::Partition& partition,
                                const WindowWeights& window, bool closes);
  virtual torch::Tensor global_norm(const torch::Tensor& local) = 0;
  /// A device tensor summed over the ranks, in place (sharded master weights: the parameters
  /// kept in fp32, each rank contributing the elements it updated).
  virtual void sum(torch::Tensor& values) = 0;
  virtual void all_gather(torch::Tensor& flat, const detail::Partition& partition) = 0;
  /// (The default serves implementations that never shard parameters.)
  virtual void gather_bucket(const torch::Tensor& /*mine*/, const torch::Tensor& /*bucket*/, const std::string& what) {
    throw std::logic_error("trainkit::Replicas: this implementation does not all-gather one bucket (" + what +
                           "); ZeRO stage 3 (Sharding::parameters) needs Replicas::gather_bucket");
  }
  /// (The default gathers at once, and its wait does nothing.)
  virtual std::function<void()> start_gather_bucket(const torch::Tensor& mine, const torch::Tensor& bucket,
                                                    const std::string& what) {
    gather_bucket(mine, bucket, what);
    return [] {};
  }
  virtual torch::Tensor gather_to_main(const torch::Tensor& local, const detail::Partition& partition) = 0;
  /// Memory that a failed collective may still write, kept until the communicator is gone (see
  /// the file comment; DataParallel keeps it with its process group). Here: as long as these
  /// replicas live.
  virtual void keep_after_failure(c10::DataPtr memory, std::int64_t bytes) {
    kept_.push_back(std::move(memory));
    kept_bytes_ += bytes;
  }
  /// Bytes handed to keep_after_failure() (all of this process's, for the process group's).
  virtual std::int64_t kept_after_failure() const { return kept_bytes_; }

 protected:
  /// Every live Joinable handed to join_before_all_reduce() joined (an implementation's
  /// all_reduce() calls it before its collective); those gone are forgotten.
  void join_all() {
    if (joining_) return;
    for (size_t i = 0; i < joinables_.size();) {
      if (auto j = joinables_[i].lock()) {
        j->join();
        ++i;
      } else {
        joinables_.erase(joinables_.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
  }

 private:
  std::vector<std::weak_ptr<Joinable>> joinables_;
  bool joining_ = false;  // inside all_reduce_while_joining
  std::vector<c10::DataPtr> kept_;  // keep_after_failure's
  std::int64_t kept_bytes_ = 0;
};

/// One process: nothing to send, nothing to wait for.
class SingleProcess final : public Replicas {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  void attach(torch::nn::Module&, const torch::Tensor&, const torch::Tensor& = torch::Tensor()) override {}
  void sum_counts(torch::Tensor&) override {}
  void check_same_state(const std::vector<torch::Tensor>&, const std::string&) override {}
  void all_reduce(std::vector<double>&, Reduce) override {}
  // Nothing to send: the gradient is the sum already (a partition of world size 1 is never
  // sharded; `local`, when given, receives the slices).
  TRAINKIT_INLINE std::unique_ptr<Reduction> start_reduction(torch::Tensor& flat_grad, torch::Tensor local,
                                                             const detail::Partition& partition, const WindowWeights& window,
                                                             bool) override;
  torch::Tensor global_norm(const torch::Tensor& local) override { return at::linalg_vector_norm(local, 2); }
  void sum(torch::Tensor&) override {}
  void all_gather(torch::Tensor&, const detail::Partition&) override {}
  TRAINKIT_INLINE torch::Tensor gather_to_main(const torch::Tensor& local, const detail::Partition& partition) override;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/step/replicas-inl.hpp>
#endif
