#pragma once
/// The definitions of trainkit/parallel/heartbeat.hpp (header-only: included by it; compiled mode
/// with TRAINKIT_COMPILED_PARALLEL: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/parallel/heartbeat.hpp>

namespace trainkit::detail {

TRAINKIT_PARALLEL_INLINE Heartbeat::Heartbeat(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                     std::chrono::milliseconds silence,
                                     std::function<void(const std::string&)> on_silent)
    : store_(std::move(store)), rank_(rank), world_size_(world_size), silence_(silence), period_(std::max<std::chrono::milliseconds>(silence / 5, std::chrono::milliseconds(50))), on_silent_(std::move(on_silent)) {
  store_->set(key(rank_), beat_text(0));
  thread_ = std::thread([this] { run(); });
}

TRAINKIT_PARALLEL_INLINE Heartbeat::~Heartbeat() {
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

TRAINKIT_PARALLEL_INLINE std::string Heartbeat::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

TRAINKIT_PARALLEL_INLINE std::vector<std::uint8_t> Heartbeat::beat_text(std::int64_t n) {
  const auto s = std::to_string(n);
  return {s.begin(), s.end()};
}

TRAINKIT_PARALLEL_INLINE bool Heartbeat::is_failed(const std::vector<std::uint8_t>& v) {
  const std::string prefix = kFailed;
  return v.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), v.begin());
}

TRAINKIT_PARALLEL_INLINE void Heartbeat::finish(const std::string& error) {
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

TRAINKIT_PARALLEL_INLINE void Heartbeat::run() {
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

TRAINKIT_PARALLEL_INLINE void Heartbeat::wait_for_others_to_leave() {
  const auto deadline = Clock::now() + silence_;
  auto gone = [&](int r) {
    const auto value = store_->get(key(r));
    return value == left_text() || is_failed(value);
  };
  for (int r = 1; r < world_size_; ++r)
    while (Clock::now() < deadline && store_->check({key(r)}) && !gone(r))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

}  // namespace trainkit::detail
