#pragma once
/// An evaluation by unit's announcements, one per batch (UnitGathers, ZeRO stage 3): which
/// units every rank gathers without saying so first.
///
/// In an evaluation by unit every rank says which unit it calls before gathering it (one small
/// all-reduce, a host sync), so that ranks whose forwards differ in number still pair their
/// all-gathers, and ranks that call different units throw instead of exchanging the wrong
/// parameters. Said for every unit that is a sync per unit per batch. This class lets the ranks
/// say it once per batch:
///   learning    the units agreed at each announcement are recorded from the evaluation's first
///               one (its head) until the head is agreed again: that run is the batch's sequence
///   following   once every rank holds the same sequence (its key, said with each
///               announcement, is the same everywhere), an agreed head commits every rank to the
///               rest of the sequence: each of those units is gathered when called, unannounced.
///               A rank whose forwards are done (joining) gathers the rest with them.
///   deviation   a rank that calls another unit than the sequence's next one while following
///               first gathers the rest of the sequence as the others will (settle_rest: their
///               all-gathers still pair), then announces its own unit. Its key is now "off":
///               at that announcement the keys differ, and every rank stops following for the
///               rest of the evaluation (one unit, one announcement, as before). When the ranks
///               then name different units they throw, as before; when they name the same (a
///               forward that changed alike on every rank, or a shorter batch) they go on.
/// Everything that decides whether to follow is agreed (the announced unit, the keys' maximum
/// and minimum), so every rank decides alike; only a deviation is seen by one rank alone, and
/// its next announcement carries it. A unit's sequence is the units' indices in call order, a
/// unit called twice in a batch included.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <utility>
#include <vector>

namespace trainkit::detail {

/// An announcement at which the ranks still evaluating named different units (thrown on each of
/// them alike).
struct UnitsDiffer : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class EvaluationOrder {
 public:
  /// `units`: how many units there are (bounds the learning: a head that never comes back).
  explicit EvaluationOrder(std::int64_t units = 0) : limit_(4 * units + 16) {}

  /// What an announcement agreed: the unit (-1: every rank is done) and the ranks' keys'
  /// smallest and largest (key()).
  struct Agreed {
    std::int64_t unit = -1;
    double lowest = 0, highest = 0;
  };

  /// A new evaluation: nothing learnt.
  void reset() {
    sequence_.clear();
    recording_.clear();
    next_ = 0;
    following_ = deviated_ = off_ = false;
  }
  /// This rank calls unit `u`; the caller gathers it afterwards. Unannounced when it is the
  /// next unit of the batch that every rank follows. Otherwise `owe(v)` first for each unit the
  /// others still gather in that batch (a deviation), then `announce(u, key())` (a collective
  /// that throws UnitsDiffer on every rank still evaluating when they name different units)
  /// returns what was agreed.
  template <class Owe, class Announce>
  void call(std::int64_t u, Owe&& owe, Announce&& announce) {
    if (follows(u)) return;
    settle_rest(owe);
    agreed(announce(u, key()));
  }
  /// This rank's forwards are done (or threw): `gather(v)` for the rest of a followed batch,
  /// then `announce(-1, key())` until every rank is done, with `gather(v)` for each unit the
  /// others call, announced or followed. When the others named different units (they throw,
  /// then join too), this rank goes on answering until every rank is done, and throws the same.
  template <class Gather, class Announce>
  void join(Gather&& gather, Announce&& announce) {
    settle_rest(gather);
    std::exception_ptr differed;
    for (;;) {
      Agreed said;
      try {
        said = announce(-1, key());
      } catch (const UnitsDiffer&) {
        if (!differed) differed = std::current_exception();
        stop();
        continue;
      }
      if (said.unit < 0) break;
      agreed(said);
      gather(said.unit);
      settle_rest(gather);
    }
    if (differed) std::rethrow_exception(differed);
  }
  /// What this rank says with its announcement: 0 while learning, 1 when off, else the
  /// sequence's hash (an integer below 2^53 + 2: exact as a double).
  double key() const { return off_ ? 1.0 : sequence_.empty() ? 0.0 : static_cast<double>(hash_); }
 private:
  // Whether u is the followed batch's next unit (advanced past it: the caller has reserved its
  // buffer, so that only a failed collective can keep it from gathering it). A call that is
  // not, while following, is a deviation.
  bool follows(std::int64_t u) {
    if (!following_) return false;
    if (sequence_[next_] != u) {
      deviated_ = true;
      return false;
    }
    following_ = ++next_ < sequence_.size();
    return true;
  }
  // `gather(v)` for each unit of the followed batch still to gather, one at a time: a gather
  // that throws (this rank out of memory) leaves it and the units after it owed, for the join
  // to gather. Following ends; after a deviation this rank's key is "off" from here.
  template <class Gather>
  void settle_rest(Gather&& gather) {
    while (following_) {
      gather(sequence_[next_]);
      following_ = ++next_ < sequence_.size();
    }
    if (std::exchange(deviated_, false)) stop();
  }
  // An announcement's outcome: the learning goes on, or the batch is followed from its unit.
  void agreed(const Agreed& said) {
    following_ = false;
    if (said.lowest != said.highest) stop();
    if (off_) return;
    if (sequence_.empty()) {
      if (recording_.empty() || recording_.front() != said.unit) {
        recording_.push_back(said.unit);
        if (static_cast<std::int64_t>(recording_.size()) > limit_) stop();
        return;
      }
      sequence_.swap(recording_);
      hash_ = hash(sequence_);
    }
    next_ = 1;
    following_ = sequence_.front() == said.unit && sequence_.size() > 1;
  }
  void stop() {
    off_ = true;
    following_ = false;
    sequence_.clear();
    recording_.clear();
  }
  static std::uint64_t hash(const std::vector<std::int64_t>& units) {
    std::uint64_t h = 1469598103934665603ull;  // (FNV-1a over the indices' bytes)
    for (const auto u : units)
      for (int byte = 0; byte < 8; ++byte) h = (h ^ ((static_cast<std::uint64_t>(u) >> (8 * byte)) & 0xff)) * 1099511628211ull;
    return (h & ((std::uint64_t{1} << 52) - 1)) + 2;
  }

  std::vector<std::int64_t> sequence_, recording_;
  size_t next_ = 0;  // the sequence's next unit while following
  std::uint64_t hash_ = 0;
  std::int64_t limit_;
  bool following_ = false, deviated_ = false, off_ = false;
};

}  // namespace trainkit::detail
