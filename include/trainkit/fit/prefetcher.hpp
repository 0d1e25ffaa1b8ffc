#pragma once
/// The fit loop's batches made ahead (FitOptions::workers, NUM_WORKERS_PER_GPU): a
/// task.batch(epoch, index) is a pure function of its position, so the loop can make the next
/// ones on worker threads while the step runs.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>

namespace trainkit::detail {

/// Micro-batches made ahead on worker threads (FitOptions::workers): while the step runs, up to
/// `workers` of the epoch's next positions are being made. next(epoch, index) returns that
/// position's batch, made on this thread when it was not ahead (an epoch's first, a resume's);
/// an exception of task.batch surfaces there, for its own position. Batches in flight when the
/// loop ends are waited for and dropped.
template <class Batch>
class Prefetcher {
 public:
  using Make = std::function<Batch(std::int64_t, std::int64_t)>;
  Prefetcher(const Make& make, std::int64_t workers) : make_(make), workers_(static_cast<std::size_t>(workers)) {}
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;
  ~Prefetcher() { drop(); }

  Batch next(std::int64_t epoch, std::int64_t index, std::int64_t batches) {
    if (workers_ == 0) return make_(epoch, index);
    if (!ahead_.empty() && (ahead_.front().epoch != epoch || ahead_.front().index != index)) drop();
    if (ahead_.empty()) {
      top_up(epoch, index + 1, batches);
      return make_(epoch, index);
    }
    std::future<Batch> batch = std::move(ahead_.front().batch);
    ahead_.pop_front();
    top_up(epoch, index + 1, batches);
    return batch.get();
  }

 private:
  struct Ahead {
    std::int64_t epoch, index;
    std::future<Batch> batch;
  };
  void top_up(std::int64_t epoch, std::int64_t from, std::int64_t batches) {
    std::int64_t index = ahead_.empty() ? from : ahead_.back().index + 1;
    for (; ahead_.size() < workers_ && index < batches; ++index)
      ahead_.push_back({epoch, index, std::async(std::launch::async, [this, epoch, index] { return make_(epoch, index); })});
  }
  void drop() {
    for (auto& a : ahead_) a.batch.wait();  // their errors are not this position's
    ahead_.clear();
  }
  const Make& make_;
  std::size_t workers_;
  std::deque<Ahead> ahead_;
};

}  // namespace trainkit::detail
