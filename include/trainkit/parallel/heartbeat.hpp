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
#include <trainkit/detail/inline.hpp>
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
            std::function<void(const std::string&)> on_silent);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  /// How on_silent's message starts when the store itself stopped answering (its host is gone:
  /// rank 0, or torchrun's agent), rather than a peer.
  static constexpr const char* kStoreGone = "the store does not answer the heartbeat";
  /// Whether the store stopped answering (on_silent was called with kStoreGone).
  bool store_gone() const { return store_gone_.load(); }

  /// The message given to on_silent, or "" while every rank beats.
  std::string failure() const;
  std::chrono::milliseconds silence() const { return silence_; }

  /// This rank stops beating and tells its peers that it leaves with an error (`reason`, one
  /// line): each calls its on_silent within a beat, naming this rank and the reason. Once; the
  /// destructor then has nothing left to say.
  void leave_with_error(const std::string& reason) { finish(reason.empty() ? "no reason given" : reason); }

 private:
  static std::string key(int rank) { return "heartbeat/" + std::to_string(rank); }
  static std::vector<std::uint8_t> beat_text(std::int64_t n);
  static std::vector<std::uint8_t> left_text() { return {'l', 'e', 'f', 't'}; }
  static constexpr const char* kFailed = "failed:";
  static bool is_failed(const std::vector<std::uint8_t>& v);

  // Stops the beat and writes this rank's last word, once: "left", or "failed:<error>" where
  // `error` is not empty.
  void finish(const std::string& error);

  void run();

  void wait_for_others_to_leave();

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

#if !defined(TRAINKIT_COMPILED_LIB) || !defined(TRAINKIT_COMPILED_PARALLEL)
#include <trainkit/parallel/heartbeat-inl.hpp>
#endif
