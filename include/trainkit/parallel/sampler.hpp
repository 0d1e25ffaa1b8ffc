#pragma once
/// DistributedSampler: which samples rank r trains on in batch (epoch, index).
///
///   tk::DistributedSampler sampler(dataset_size, batch_size, rank, world_size, seed);
///   for (std::int64_t i = 0; i < sampler.batches_per_epoch(); ++i)
///     train_on(sampler.batch(epoch, i));               // this rank's sample indices
///
/// Guarantees: a batch is a pure function of (seed, epoch, index, rank, world size), so the
/// sampler's state is just (epoch, index) and resume is exact. In an epoch the ranks' shards
/// are disjoint (Remainder::drop) or overlap only in the few padding samples (Remainder::pad),
/// together they cover the data set (pad) or all but fewer than world_size * batch_size samples
/// (drop); the order is reshuffled each epoch from the seed (the same permutation on every
/// rank, by a portable generator); every rank has the same number of batches, of the same
/// sizes. Rank r takes every world_size-th sample of the epoch's permutation (as PyTorch's
/// DistributedSampler), so world size W with batch B sees, batch for batch, the samples that
/// one process with batch W * B sees.
///   Remainder::pad   every rank gets ceil(size / W) samples; the permutation is extended by
///                    its own first samples; the last batch may be short (on every rank).
///   Remainder::drop  every rank gets floor(size / (W * B)) full batches; the rest is dropped.
/// No LibTorch dependency; the sampler of one process is the same class with W = 1.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

class DistributedSampler {
 public:
  enum class Remainder { pad, drop };

  DistributedSampler(std::int64_t size, std::int64_t batch_size, int rank = 0, int world_size = 1,
                     std::uint64_t seed = 0, bool shuffle = true, Remainder remainder = Remainder::pad)
      : size_(size), batch_(batch_size), rank_(rank), world_(world_size), seed_(seed),
        shuffle_(shuffle), remainder_(remainder) {
    auto fail = [](const std::string& what) {
      throw std::invalid_argument("trainkit::DistributedSampler: " + what);
    };
    if (size_ < 1) fail("the data set must have >= 1 sample, got " + std::to_string(size_));
    if (batch_ < 1) fail("batch_size must be >= 1, got " + std::to_string(batch_));
    if (world_ < 1) fail("world_size must be >= 1, got " + std::to_string(world_));
    if (rank_ < 0 || rank_ >= world_)
      fail("rank must be in [0, world_size), got " + std::to_string(rank_) + " of " +
           std::to_string(world_));
    if (remainder_ == Remainder::drop && size_ < world_ * batch_)
      fail("Remainder::drop with " + std::to_string(size_) + " samples, " +
           std::to_string(world_) + " ranks and batch " + std::to_string(batch_) +
           " leaves no batch; use Remainder::pad or a smaller batch");
  }

  // Copies share nothing (each has its own cache of the last epoch's shard).
  DistributedSampler(const DistributedSampler& o)
      : size_(o.size_), batch_(o.batch_), rank_(o.rank_), world_(o.world_), seed_(o.seed_),
        shuffle_(o.shuffle_), remainder_(o.remainder_) {}
  DistributedSampler& operator=(const DistributedSampler& o) {
    if (this != &o) {
      std::lock_guard<std::mutex> lock(mutex_);
      size_ = o.size_, batch_ = o.batch_, rank_ = o.rank_, world_ = o.world_, seed_ = o.seed_;
      shuffle_ = o.shuffle_, remainder_ = o.remainder_;
      cached_epoch_ = -1;
      cached_.clear();
    }
    return *this;
  }

  /// Samples this rank trains on per epoch (the same on every rank).
  std::int64_t samples_per_rank() const {
    if (remainder_ == Remainder::drop) return size_ / (world_ * batch_) * batch_;
    return (size_ + world_ - 1) / world_;
  }
  /// Batches per epoch (the same on every rank).
  std::int64_t batches_per_epoch() const { return (samples_per_rank() + batch_ - 1) / batch_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  std::int64_t batch_size() const { return batch_; }

  /// This rank's sample indices for batch `index` of `epoch`.
  std::vector<std::int64_t> batch(std::int64_t epoch, std::int64_t index) const {
    if (index < 0 || index >= batches_per_epoch())
      throw std::out_of_range("trainkit::DistributedSampler: batch " + std::to_string(index) +
                              " of an epoch of " + std::to_string(batches_per_epoch()) + " batches");
    std::lock_guard<std::mutex> lock(mutex_);
    const auto& shard = shard_of(epoch);
    const std::int64_t begin = index * batch_;
    const std::int64_t end = std::min<std::int64_t>(begin + batch_, static_cast<std::int64_t>(shard.size()));
    return {shard.begin() + begin, shard.begin() + end};
  }
  /// This rank's whole shard of `epoch`, in order.
  std::vector<std::int64_t> shard(std::int64_t epoch) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return shard_of(epoch);
  }
  /// The epoch's permutation of [0, size), the same on every rank.
  std::vector<std::int64_t> permutation(std::int64_t epoch) const {
    std::vector<std::int64_t> p(static_cast<size_t>(size_));
    for (std::int64_t i = 0; i < size_; ++i) p[static_cast<size_t>(i)] = i;
    if (!shuffle_) return p;
    // splitmix64 over (seed, epoch): portable, unlike std::shuffle's distributions.
    std::uint64_t state = seed_ ^ (0x9E3779B97F4A7C15ull * (static_cast<std::uint64_t>(epoch) + 1));
    auto next = [&state] {
      std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      return z ^ (z >> 31);
    };
    for (std::int64_t i = size_ - 1; i > 0; --i) {
      const auto bound = static_cast<std::uint64_t>(i) + 1;
      // Rejection keeps the draw unbiased.
      const std::uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
      std::uint64_t r;
      do r = next(); while (r >= limit);
      std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(r % bound)]);
    }
    return p;
  }

 private:
  const std::vector<std::int64_t>& shard_of(std::int64_t epoch) const {
    if (cached_epoch_ == epoch && !cached_.empty()) return cached_;
    const auto p = permutation(epoch);
    const std::int64_t per = samples_per_rank();
    cached_.assign(static_cast<size_t>(per), 0);
    for (std::int64_t j = 0; j < per; ++j)  // position j of this rank: rank + j * world
      cached_[static_cast<size_t>(j)] = p[static_cast<size_t>((rank_ + j * world_) % size_)];
    cached_epoch_ = epoch;
    return cached_;
  }

  std::int64_t size_, batch_;
  int rank_, world_;
  std::uint64_t seed_;
  bool shuffle_;
  Remainder remainder_;
  mutable std::mutex mutex_;
  mutable std::int64_t cached_epoch_ = -1;
  mutable std::vector<std::int64_t> cached_;
};

}  // namespace trainkit
