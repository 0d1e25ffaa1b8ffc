// An evaluation by unit's announcements (storage/evaluation_order.hpp), one per batch: ranks as
// threads whose collectives meet in lockstep. Each test checks that every collective pairs
// with the same one on every rank (an all-gather with the same unit's, an announcement with
// announcements), that ranks naming different units throw alike, and how many announcements
// were made.
#include "../support/helpers.hpp"

#include <trainkit/storage/evaluation_order.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace test_evaluation_order {  // this file's names, apart from those of the files it shares a unity batch with

using trainkit::detail::EvaluationOrder;

// One collective as a rank makes it: an all-gather of a unit, or an announcement.
struct Op {
  bool announce = false;
  std::int64_t unit = -1;
  double key = 0;
};

// What went wrong in the protocol itself (not a rank's error): collectives that do not pair.
struct Fault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// W threads' collectives, met in lockstep: each returns every rank's op.
class Lockstep {
 public:
  explicit Lockstep(int world) : world_(world), ops_(static_cast<size_t>(world)) {}
  std::vector<Op> exchange(int rank, const Op& op) {
    std::unique_lock<std::mutex> lock(mutex_);
    ops_[static_cast<size_t>(rank)] = op;
    const auto generation = generation_;
    if (++arrived_ == world_) {
      met_ = ops_;
      arrived_ = 0;
      ++generation_;
      met_all_.notify_all();
    } else if (!met_all_.wait_for(lock, std::chrono::seconds(20), [&] { return generation_ != generation; })) {
      throw Fault("rank " + std::to_string(rank) + " waits in a collective that no other rank makes");
    }
    return met_;
  }

 private:
  int world_, arrived_ = 0;
  std::int64_t generation_ = 0;
  std::vector<Op> ops_, met_;
  std::mutex mutex_;
  std::condition_variable met_all_;
};

// A rank's evaluation: the units each of its batches calls, in order.
using Batches = std::vector<std::vector<std::int64_t>>;

struct Outcome {
  std::int64_t announcements = 0, gathers = 0;
  std::vector<std::int64_t> called;  // the units its calls got gathered, in order
  std::string error, fault;
};

// Where a rank runs out of memory (its buffer's reservation throws, before any collective):
// at its call number `call`, or at its `owed`-th gather of units it owes the others (0: none).
struct OutOfMemory {
  std::int64_t call = -1, owed = 0;
};

// Every rank's evaluation run as UnitGathers runs it (before_forward, join_evaluation), `units`
// units in all.
std::vector<Outcome> evaluate(const std::vector<Batches>& ranks, std::int64_t units = 8,
                              std::vector<OutOfMemory> oom = {}) {
  oom.resize(ranks.size());
  const int world = static_cast<int>(ranks.size());
  Lockstep group(world);
  std::vector<Outcome> out(ranks.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto& o = out[static_cast<size_t>(r)];
      EvaluationOrder order(units);
      order.reset();
      const auto gather = [&](std::int64_t u) {
        const auto all = group.exchange(r, {false, u, 0});
        ++o.gathers;
        for (const auto& op : all)
          if (op.announce || op.unit != u)
            throw Fault("an all-gather of unit " + std::to_string(u) + " met " +
                        (op.announce ? "an announcement" : "unit " + std::to_string(op.unit) + "'s"));
      };
      const auto announce = [&](std::int64_t u, double key) {  // (as UnitGathers::announce)
        const auto all = group.exchange(r, {true, u, key});
        ++o.announcements;
        EvaluationOrder::Agreed said;
        std::int64_t lowest = -1;
        said.lowest = said.highest = key;
        for (const auto& op : all) {
          if (!op.announce) throw Fault("an announcement met an all-gather of unit " + std::to_string(op.unit));
          said.unit = std::max(said.unit, op.unit);
          if (op.unit >= 0) lowest = lowest < 0 ? op.unit : std::min(lowest, op.unit);
          said.lowest = std::min(said.lowest, op.key), said.highest = std::max(said.highest, op.key);
        }
        if (said.unit >= 0 && lowest != said.unit)
          throw trainkit::detail::UnitsDiffer("units " + std::to_string(lowest) + " and " + std::to_string(said.unit));
        return said;
      };
      std::int64_t calls = 0, owed = 0;
      const auto reserve = [&] {
        if (calls++ == oom[static_cast<size_t>(r)].call) throw std::runtime_error("out of memory");
      };
      const auto owe = [&](std::int64_t v) {
        if (++owed == oom[static_cast<size_t>(r)].owed) throw std::runtime_error("out of memory");
        gather(v);
      };
      try {
        try {
          for (const auto& batch : ranks[static_cast<size_t>(r)])
            for (const auto u : batch) {
              reserve();
              order.call(u, owe, announce);
              gather(u);
              o.called.push_back(u);
            }
        } catch (const Fault&) {
          throw;
        } catch (const std::exception& e) {
          o.error = e.what();
        }
        order.join(gather, announce);  // (also after an error, as the fit loop's validation ends)
      } catch (const Fault& f) {
        o.fault = f.what();
      } catch (const std::exception& e) {
        if (o.error.empty()) o.error = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

Batches repeat(const std::vector<std::int64_t>& batch, int times) { return Batches(static_cast<size_t>(times), batch); }

void check_paired(const std::vector<Batches>& ranks, const std::vector<Outcome>& out) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    CAPTURE(r);
    CHECK(out[r].fault == "");
    CHECK(out[r].error == "");
    std::vector<std::int64_t> calls;
    for (const auto& b : ranks[r]) calls.insert(calls.end(), b.begin(), b.end());
    CHECK(out[r].called == calls);
    CHECK(out[r].gathers == out[0].gathers);
    CHECK(out[r].announcements == out[0].announcements);
  }
}

TEST_CASE("an evaluation by unit announces once a batch once the ranks know its units: ranks with more batches are "
          "joined, their units gathered with them unannounced") {
  const std::vector<std::int64_t> batch{0, 1, 2, 3, 4, 5};
  const std::vector<Batches> ranks{repeat(batch, 3), repeat(batch, 5)};
  const auto out = evaluate(ranks);
  check_paired(ranks, out);
  // The first batch learnt unit by unit (6), one a batch after it (4), the end (1): 11 where
  // one a unit made 5 x 6 + 1.
  CHECK(out[0].announcements == 11);
  CHECK(out[0].gathers == 5 * 6);
  // Three ranks, one with a single batch (nothing learnt before it is done).
  const std::vector<Batches> three{repeat(batch, 1), repeat(batch, 4), repeat(batch, 2)};
  check_paired(three, evaluate(three));
}

TEST_CASE("an evaluation by unit whose units change alike on every rank, or end sooner on one rank, stays paired") {
  const std::vector<std::int64_t> forward{0, 1, 2, 3}, reversed{0, 3, 2, 1}, early{0, 1};
  SUBCASE("batches that call their units in another order on every rank") {
    const Batches alike{forward, forward, reversed, forward, reversed, forward};
    const std::vector<Batches> ranks{alike, alike};
    const auto out = evaluate(ranks);
    check_paired(ranks, out);
    // The first change costs the followed batch's rest (3 units gathered for nothing); then
    // every unit is announced for the rest of the evaluation, and no batch costs more.
    CHECK(out[0].gathers == 6 * 4 + 3);
    CHECK(out[0].announcements == 4 + 1 + (1 + 3) + 3 * 4 + 1);
  }
  SUBCASE("a batch that ends sooner on one rank, another batch after it") {
    const std::vector<Batches> ranks{{forward, forward, forward}, {forward, early, forward, forward}};
    check_paired(ranks, evaluate(ranks));
  }
  SUBCASE("a unit called twice in a batch, and a batch made of one unit") {
    const std::vector<Batches> ranks{{{0, 1, 1, 2}, {0, 1, 1, 2}, {0, 1, 1, 2}}, {{0, 1, 1, 2}, {0, 1, 1, 2}}};
    check_paired(ranks, evaluate(ranks));
    const std::vector<Batches> single{repeat({3}, 4), repeat({3}, 2)};
    const auto out = evaluate(single);
    check_paired(single, out);
    CHECK(out[0].announcements == 4 + 1);  // (one a batch: nothing follows the head)
  }
}

TEST_CASE("an evaluation by unit in which the ranks call different units throws on every rank, before an all-gather "
          "pairs two units") {
  const std::vector<std::int64_t> forward{0, 1, 2, 3}, reversed{0, 3, 2, 1};
  const std::vector<Batches> ranks{{forward, forward, forward}, {forward, reversed, forward}};
  const auto out = evaluate(ranks);
  for (const auto& o : out) {
    CHECK(o.fault == "");
    CHECK(o.error.find("units") == 0);
  }
  // Learning, unit by unit: the first batch.
  const std::vector<Batches> first{{forward, forward}, {reversed, forward}};
  for (const auto& o : evaluate(first)) {
    CHECK(o.fault == "");
    CHECK(o.error.find("units 1 and 3") == 0);
  }
  // A rank already done when the others differ answers until they are done too, and throws the
  // same (it leaving the others' last announcements unanswered would hang them).
  // (Rank 2 leaves the third batch at its second unit: it gathers the rest with the others, then
  // names unit 3 where rank 1 names the fourth batch's first.)
  const std::vector<Batches> joined{{forward}, repeat(forward, 4), {forward, forward, reversed, forward}};
  for (const auto& o : evaluate(joined)) {
    CHECK(o.fault == "");
    CHECK(o.error.find("units 0 and 3") == 0);
  }
}

TEST_CASE("an evaluation by unit in which a rank runs out of memory, at a unit it follows or at one it owes the "
          "others, stays paired: that rank joins the others") {
  const std::vector<std::int64_t> forward{0, 1, 2, 3}, reversed{0, 3, 2, 1};
  const auto check = [](const std::vector<Outcome>& out) {
    CHECK(out[0].fault == "");
    CHECK(out[1].fault == "");
    CHECK(out[0].error == "");
    CHECK(out[1].error == "out of memory");
  };
  // Rank 1's sixth call: the second unit of its second batch, followed.
  check(evaluate({repeat(forward, 3), repeat(forward, 3)}, 8, {{}, {5, 0}}));
  // Rank 1 leaves its third batch at its second unit, and its second owed gather fails.
  check(evaluate({repeat(forward, 4), {forward, forward, reversed, forward}}, 8, {{}, {-1, 2}}));
}

TEST_CASE("an evaluation by unit never pairs different collectives, whatever units each rank's batches call") {
  std::mt19937 random(5);
  const std::vector<std::vector<std::int64_t>> shapes{{0, 1, 2, 3}, {0, 1, 2, 3}, {0, 3, 2, 1}, {0, 1}, {1, 2}, {0}};
  for (int trial = 0; trial < 60; ++trial) {
    CAPTURE(trial);
    const int world = 2 + static_cast<int>(random() % 3);
    std::vector<Batches> ranks(static_cast<size_t>(world));
    const bool alike = random() % 2 == 0;  // (the same batches on every rank, in different numbers)
    Batches common;
    for (int b = 0; b < 6; ++b) common.push_back(shapes[random() % shapes.size()]);
    for (auto& batches : ranks) {
      const auto n = 1 + random() % 6;
      for (size_t b = 0; b < n; ++b) batches.push_back(alike ? common[b] : shapes[random() % shapes.size()]);
    }
    const auto out = evaluate(ranks, 4);
    for (size_t r = 0; r < out.size(); ++r) {
      CAPTURE(r);
      CHECK(out[r].fault == "");
      CHECK((out[r].error == "") == (out[0].error == ""));  // (every rank throws, or none)
    }
    if (alike) check_paired(ranks, out);
  }
}

}  // namespace test_evaluation_order
