#pragma once
/// Each rank's liveness, through the group's store: a thread per rank writes a counter every
/// `silence / 5` and reads the others'. A rank whose counter has not moved for `silence` died or
/// hangs (a SIGKILL, a SIGSTOP, a deadlock, a lost node); the thread then calls `on_silent` once
/// with a message naming it.
///
/// Why: NCCL's wait() does not fail when a peer is gone; its watchdog ends the process only
/// after the collective's timeout (30 minutes by default), with its own message. Gloo fails at
/// once on a dead peer (the connection resets) but waits out the timeout for a hung one. The
/// heartbeat says which rank it is within seconds, and lets ProcessGroup abort NCCL's
/// communicator so that the survivors stop (tk::DistributedError) instead of waiting.
///
/// Shutdown: a rank that destroys its group writes "left" (its peers stop watching it), and
/// the rank hosting the store (rank 0) waits, for at most `silence`, until every other rank has
/// left, so that the store does not vanish under a peer's last beat. A rank that leaves with an
/// error (leave_with_error(), or its group destroyed while an exception unwinds the stack) writes
/// "failed:<reason>" instead: its peers, which may be blocked in a collective it will never
/// join (NCCL's wait() does not fail then), call `on_silent` within a beat, naming it.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace trainkit::detail {

class Heartbeat {
 public:
  using Clock = std::chrono::steady_clock;

  Heartbeat(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, std::chrono::milliseconds silence,
            std::function<void(const std::string&)> on_silent)
      : store_(std::move(store)),
        rank_(rank),
        world_size_(world_size),
        silence_(silence),
        period_(std::max<std::chrono::milliseconds>(silence / 5, std::chrono::milliseconds(50))),
        on_silent_(std::move(on_silent)) {
    store_->set(key(rank_), beat_text(0));
    thread_ = std::thread([this] { run(); });
  }
  ~Heartbeat() {
    std::string error;
    if (std::uncaught_exceptions() > uncaught_at_start_) {
      // What this rank heard first, if anything, so that the others learn the first cause.
      const std::string heard = failure();
      error = heard.empty() ? "an exception unwound its process group" : "it stopped after: " + heard;
    }
    finish(error);
    if (thread_.joinable()) thread_.detach();  // finish() was called on the beat's own thread: it returns by itself
    try {
      if (rank_ == 0) wait_for_others_to_leave();
    } catch (const std::exception&) {
      // The store is gone already.
    }
  }
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  /// How on_silent's message starts when the store itself stopped answering (its host is gone:
  /// rank 0, or torchrun's agent), rather than a peer.
  static constexpr const char* kStoreGone = "the store does not answer the heartbeat";
  /// Whether the store stopped answering (on_silent was called with kStoreGone).
  bool store_gone() const { return store_gone_.load(); }

  /// The message given to on_silent, or "" while every rank beats.
  std::string failure() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return failure_;
  }
  std::chrono::milliseconds silence() const { return silence_; }

  /// This rank stops beating and tells its peers that it leaves with an error (`reason`, one
  /// line): each calls its on_silent within a beat, naming this rank and the reason. Once; the
  /// destructor then has nothing left to say.
  void leave_with_error(const std::string& reason) { finish(reason.empty() ? "no reason given" : reason); }

 private:
  static std::string key(int rank) { return "heartbeat/" + std::to_string(rank); }
  static std::vector<std::uint8_t> beat_text(std::int64_t n) {
    const auto s = std::to_string(n);
    return {s.begin(), s.end()};
  }
  static std::vector<std::uint8_t> left_text() { return {'l', 'e', 'f', 't'}; }
  static constexpr const char* kFailed = "failed:";
  static bool is_failed(const std::vector<std::uint8_t>& v) {
    const std::string prefix = kFailed;
    return v.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), v.begin());
  }

  // Stops the beat and writes this rank's last word, once: "left", or "failed:<error>" where
  // `error` is not empty.
  void finish(const std::string& error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_) return;
      finished_ = stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
    try {
      if (error.empty()) {
        store_->set(key(rank_), left_text());
      } else {
        const std::string text = kFailed + error.substr(0, error.find('\n'));
        store_->set(key(rank_), std::vector<std::uint8_t>(text.begin(), text.end()));
      }
    } catch (const std::exception&) {
      // The store is gone already: nothing to tell.
    }
  }

  void run() {
    std::vector<std::string> keys;
    std::vector<int> peers;
    for (int r = 0; r < world_size_; ++r)
      if (r != rank_) keys.push_back(key(r)), peers.push_back(r);
    std::vector<std::vector<std::uint8_t>> last(peers.size());
    std::vector<Clock::time_point> changed(peers.size(), Clock::now());
    std::vector<bool> left(peers.size(), false);
    std::int64_t beat = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      lock.unlock();
      std::string message;
      try {
        store_->set(key(rank_), beat_text(++beat));
        // Keys a peer has not written yet (it is still joining) count as beating.
        const auto now = Clock::now();
        std::vector<int> silent;
        std::string failed;  // the peers that left with an error, and why
        for (size_t i = 0; i < peers.size(); ++i) {
          if (left[i] || !store_->check({keys[i]})) continue;
          const auto value = store_->get(keys[i]);
          if (value == left_text()) left[i] = true;
          else if (is_failed(value))
            failed += (failed.empty() ? "" : "; ") + std::string("rank ") + std::to_string(peers[i]) +
                      " left with an error (" + std::string(value.begin() + std::string(kFailed).size(), value.end()) + ")";
          else if (value != last[i]) last[i] = value, changed[i] = now;
          else if (now - changed[i] > silence_) silent.push_back(peers[i]);
        }
        if (!failed.empty()) {
          message = failed;
        } else if (!silent.empty()) {
          std::string ranks;
          for (size_t i = 0; i < silent.size(); ++i) ranks += (i ? ", " : "") + std::to_string(silent[i]);
          std::ostringstream text;
          text << "rank" << (silent.size() > 1 ? "s " : " ") << ranks << " sent no heartbeat for "
               << silence_.count() / 1000.0 << " s: died or hangs";
          message = text.str();
        }
      } catch (const std::exception&) {
        message = std::string(kStoreGone) + ": its host (rank 0, or torchrun's agent) is gone";
        store_gone_ = true;
      }
      lock.lock();
      if (!message.empty() && !stop_) {
        failure_ = message;
        lock.unlock();
        on_silent_(message);
        return;
      }
      wake_.wait_for(lock, period_, [this] { return stop_; });
    }
  }

  void wait_for_others_to_leave() {
    const auto deadline = Clock::now() + silence_;
    auto gone = [&](int r) {
      const auto value = store_->get(key(r));
      return value == left_text() || is_failed(value);
    };
    for (int r = 1; r < world_size_; ++r)
      while (Clock::now() < deadline && store_->check({key(r)}) && !gone(r))
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_, world_size_;
  const std::chrono::milliseconds silence_, period_;
  std::function<void(const std::string&)> on_silent_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false, finished_ = false;
  std::atomic<bool> store_gone_{false};
  const int uncaught_at_start_ = std::uncaught_exceptions();
  std::string failure_;
  std::thread thread_;
};

}  // namespace trainkit::detail
