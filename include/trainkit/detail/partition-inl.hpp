#pragma once
/// The definitions of trainkit/detail/partition.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/detail/partition.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE Partition::Partition(std::int64_t numel, std::int64_t bucket_elements, std::int64_t align, int world,
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

TRAINKIT_INLINE Range Partition::slice(std::int64_t b) const {
  const Range bucket = buckets_.at(static_cast<size_t>(b));
  if (!sharded_) return bucket;
  const std::int64_t n = bucket.length / world_;
  return {bucket.begin + rank_ * n, n};
}

}  // namespace trainkit::detail
