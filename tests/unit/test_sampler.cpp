// DistributedSampler: shards per rank, reshuffled per epoch, the same batches on every rank.
#include <trainkit/parallel/sampler.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <vector>

namespace test_sampler {  // this file's names, apart from those of the files it shares a unity batch with

namespace tk = trainkit;
using Remainder = tk::DistributedSampler::Remainder;

namespace {
std::vector<std::int64_t> epoch_of(const tk::DistributedSampler& s, std::int64_t epoch) {
  std::vector<std::int64_t> all;
  for (std::int64_t i = 0; i < s.batches_per_epoch(); ++i) {
    const auto b = s.batch(epoch, i);
    all.insert(all.end(), b.begin(), b.end());
  }
  return all;
}
}  // namespace

TEST_CASE("sampler: shards are disjoint, cover the data, and have the same batches on every rank") {
  for (std::int64_t size : {64, 67, 5}) {
    for (int world : {1, 2, 3, 4}) {
      for (const auto remainder : {Remainder::pad, Remainder::drop}) {
        const std::int64_t batch = 2;
        if (remainder == Remainder::drop && size < world * batch) continue;
        CAPTURE(size);
        CAPTURE(world);
        CAPTURE(remainder == Remainder::pad);
        std::vector<std::int64_t> seen;
        std::set<std::int64_t> distinct;
        std::int64_t batches = -1;
        std::vector<size_t> sizes;
        for (int r = 0; r < world; ++r) {
          tk::DistributedSampler s(size, batch, r, world, /*seed*/ 3, true, remainder);
          if (batches < 0) batches = s.batches_per_epoch();
          CHECK(s.batches_per_epoch() == batches);  // the same number on every rank
          std::vector<size_t> mine;
          for (std::int64_t i = 0; i < s.batches_per_epoch(); ++i) mine.push_back(s.batch(5, i).size());
          if (r == 0) sizes = mine;
          CHECK(mine == sizes);  // and batch for batch the same sizes
          const auto e = epoch_of(s, 5);
          CHECK(static_cast<std::int64_t>(e.size()) == s.samples_per_rank());
          seen.insert(seen.end(), e.begin(), e.end());
          distinct.insert(e.begin(), e.end());
        }
        for (auto i : seen) CHECK((i >= 0 && i < size));
        if (remainder == Remainder::pad) {
          CHECK(static_cast<std::int64_t>(distinct.size()) == size);  // covers everything
          CHECK(static_cast<std::int64_t>(seen.size()) - size < world);  // padding < one per rank
        } else {
          CHECK(distinct.size() == seen.size());  // disjoint
          CHECK(size - static_cast<std::int64_t>(seen.size()) < world * batch);
          CHECK(sizes.back() == static_cast<size_t>(batch));  // only full batches
        }
      }
    }
  }
}

TEST_CASE("sampler: reshuffled each epoch from the seed; a pure function of (epoch, index)") {
  tk::DistributedSampler a(100, 4, 1, 2, 11), b(100, 4, 1, 2, 11), c(100, 4, 1, 2, 12);
  CHECK(epoch_of(a, 0) == epoch_of(b, 0));
  CHECK(epoch_of(a, 0) != epoch_of(a, 1));  // a new order each epoch
  CHECK(epoch_of(a, 0) != epoch_of(c, 0));  // another seed, another order
  // Asking out of order (resume) gives the same batch as asking in order.
  const auto in_order = a.batch(3, 7);
  (void)a.batch(0, 0);
  CHECK(a.batch(3, 7) == in_order);
  tk::DistributedSampler copy = a;
  CHECK(copy.batch(3, 7) == in_order);
  // The permutation is a permutation.
  auto p = a.permutation(2);
  std::sort(p.begin(), p.end());
  std::vector<std::int64_t> iota(100);
  std::iota(iota.begin(), iota.end(), 0);
  CHECK(p == iota);
  // Without shuffling: rank r takes every world-th sample in order.
  tk::DistributedSampler plain(10, 2, 1, 2, 0, /*shuffle*/ false);
  CHECK(plain.batch(0, 0) == std::vector<std::int64_t>{1, 3});
  CHECK(plain.batch(9, 2) == std::vector<std::int64_t>{9});
}

TEST_CASE("sampler: W ranks with batch B see, batch for batch, one process's batch of W * B") {
  const std::int64_t size = 96, batch = 4;
  const int world = 3;
  tk::DistributedSampler one(size, world * batch, 0, 1, 9);
  for (std::int64_t i = 0; i < one.batches_per_epoch(); ++i) {
    std::vector<std::int64_t> together;
    for (int r = 0; r < world; ++r) {
      const auto b = tk::DistributedSampler(size, batch, r, world, 9).batch(2, i);
      together.insert(together.end(), b.begin(), b.end());
    }
    auto big = one.batch(2, i);
    std::sort(big.begin(), big.end());
    std::sort(together.begin(), together.end());
    CHECK(together == big);
  }
}

TEST_CASE("sampler: bad arguments say what is wrong") {
  CHECK_THROWS_WITH_AS(tk::DistributedSampler(10, 2, 2, 2), doctest::Contains("rank must be in [0, world_size)"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(tk::DistributedSampler(3, 2, 0, 2, 0, true, Remainder::drop),
                       doctest::Contains("leaves no batch"), std::invalid_argument);
  CHECK_THROWS_AS(tk::DistributedSampler(10, 2).batch(0, 5), std::out_of_range);
}

}  // namespace test_sampler
