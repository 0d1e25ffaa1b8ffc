#pragma once
/// How data parallelism cuts the trainer's flat buffers: into buckets, the units of
/// communication, and, when the update is sharded, into each rank's slice of every bucket.
///
///   bucket b        elements [begin(b), begin(b) + length(b)) of the flat buffer; the buckets
///                   cover the whole buffer, back to back, in order. Every length is a multiple
///                   of align, and when sharded of world x align, so that each rank's slice is
///                   aligned and all slices of a bucket have the same length (what
///                   reduce-scatter and all-gather need).
///   slice(b)        this rank's part of bucket b: [begin(b) + rank x length(b) / world, ...).
///                   Replicated (not sharded): the whole bucket.
///   local(b)        where slice(b) lives in this rank's local buffers (the gradient it receives,
///                   its fp32 masters, its optimizer state): the slices back to back. Replicated,
///                   the local buffers are the flat ones (local(b) = begin(b)).
///
/// The padded total (total()) can exceed the layout's own padded size by less than one
/// world x align unit: those elements are zeros, like the layout's gaps, and stay
/// zeros in every buffer (no gradient reaches them, so no update moves them).
///
/// Why slices of every bucket rather than one contiguous shard per rank: a bucket can then be
/// reduce-scattered as soon as its gradients are ready (DDP's and ZeRO's overlap), and every
/// rank receives its part of it at once; a contiguous shard would make each bucket the business
/// of one rank. A rank's slices are still contiguous runs of the flat buffer, one per bucket,
/// and the update walks them as the chunked master-weights phase walks its chunks.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace trainkit::detail {

/// [begin, begin + length) of a flat buffer.
struct Range {
  std::int64_t begin = 0, length = 0;
  std::int64_t end() const { return begin + length; }
};

class Partition {
 public:
  /// One process, nothing cut: one bucket, the whole buffer, replicated.
  Partition() = default;

  /// `numel`: the flat layout's padded size; `bucket_elements`: the wanted bucket size (a
  /// bucket is this size rounded up to the unit, the last one the rest); `align`: elements per
  /// 64-byte unit of the buffers' narrowest dtype.
  Partition(std::int64_t numel, std::int64_t bucket_elements, std::int64_t align, int world, int rank, bool sharded);
  /// Sharded, one bucket per entry of `buckets` (ZeRO stage 3: a bucket per unit): back to
  /// back from 0, each length a multiple of `world` (an aligned slice per rank).
  Partition(const std::vector<Range>& buckets, int world, int rank);

  bool sharded() const { return sharded_; }
  int world_size() const { return world_; }
  int rank() const { return rank_; }
  /// Elements of every flat buffer (the layout's, padded to whole buckets).
  std::int64_t total() const { return total_; }
  std::int64_t buckets() const { return static_cast<std::int64_t>(buckets_.size()); }
  Range bucket(std::int64_t b) const { return buckets_.at(static_cast<size_t>(b)); }
  /// This rank's part of bucket b, in the flat buffer (the whole bucket when replicated).
  Range slice(std::int64_t b) const;
  /// Where slice(b) starts in this rank's local buffers.
  std::int64_t local(std::int64_t b) const { return local_.at(static_cast<size_t>(b)); }
  /// Elements of this rank's local buffers (total() when replicated).
  std::int64_t local_total() const { return local_total_; }

 private:
  int world_ = 1, rank_ = 0;
  bool sharded_ = false;
  std::vector<Range> buckets_;
  std::vector<std::int64_t> local_;
  std::int64_t total_ = 0, local_total_ = 0;
};

}  // namespace trainkit::detail

namespace trainkit::detail {

inline Partition::Partition(std::int64_t numel, std::int64_t bucket_elements, std::int64_t align, int world,
                            int rank, bool sharded)
    : world_(world), rank_(rank), sharded_(sharded) {
  if (world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("trainkit::Partition: rank " + std::to_string(rank) + " of world size " +
                                std::to_string(world));
  if (bucket_elements < 1 || align < 1 || numel < 0)
    throw std::invalid_argument("trainkit::Partition: bucket_elements and align must be >= 1");
  const std::int64_t unit = sharded ? align * world : align;
  const std::int64_t per = std::max<std::int64_t>(1, (bucket_elements + unit - 1) / unit) * unit;
  const std::int64_t padded = (numel + unit - 1) / unit * unit;
  for (std::int64_t begin = 0; begin < padded; begin += per) buckets_.push_back({begin, std::min(per, padded - begin)});
  total_ = padded;
  std::int64_t local = 0;
  for (const auto& b : buckets_) {
    local_.push_back(sharded_ ? local : b.begin);
    local += sharded_ ? b.length / world_ : b.length;
  }
  local_total_ = sharded_ ? local : total_;
}

inline Partition::Partition(const std::vector<Range>& buckets, int world, int rank)
    : world_(world), rank_(rank), sharded_(true), buckets_(buckets) {
  if (world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("trainkit::Partition: rank " + std::to_string(rank) + " of world size " +
                                std::to_string(world));
  std::int64_t at = 0, local = 0;
  for (const auto& b : buckets_) {
    if (b.begin != at || b.length % world != 0)
      throw std::invalid_argument("trainkit::Partition: bucket [" + std::to_string(b.begin) + ", " +
                                  std::to_string(b.end()) + ") does not follow the previous one at " + std::to_string(at) +
                                  " or is not cut in " + std::to_string(world) + " slices");
    local_.push_back(local);
    local += b.length / world;
    at = b.end();
  }
  total_ = at;
  local_total_ = local;
}

inline Range Partition::slice(std::int64_t b) const {
  const Range bucket = buckets_.at(static_cast<size_t>(b));
  if (!sharded_) return bucket;
  const std::int64_t n = bucket.length / world_;
  return {bucket.begin + rank_ * n, n};
}

}  // namespace trainkit::detail
