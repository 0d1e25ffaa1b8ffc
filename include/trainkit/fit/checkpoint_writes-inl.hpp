#pragma once
/// The definitions of CheckpointManager's background writes and checkpoint sets (checkpoint.hpp;
/// docs/design/checkpoints.md, "Background writes" and "Sharded sets"): the state staged on the
/// host while the loop goes on, a set's files written by every rank, their agreement on failure.
/// The second of checkpoint.hpp's -inl files (header-only: included by it; compiled mode: by
/// src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/fit/checkpoint.hpp>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>

namespace trainkit {

namespace detail {
struct BackgroundWrite {
  std::thread thread;
  std::atomic<bool> done{false};
  std::atomic<bool> cancel{false};  // a set's main rank stops waiting for the other ranks' files
  CheckpointManager::Written written;
  std::string error;  // set by the thread before `done`
};

struct StagedSet {
  std::string path;
  std::string error;  // staging failed on this rank after the ranks agreed (the save then fails on every rank)
  std::uint64_t token = 0;
  std::int64_t rank = 0, world = 1;
  bool main = true;
  std::vector<RecordChunk> chunks;       // this rank's pieces
  CheckpointManager::Staged records;     // the main rank's other records
  // This rank's files (the main rank: the records too). Returns their size.
  std::size_t write() {
    std::size_t bytes = write_shard(path, rank, world, token, chunks);
    if (main) bytes += records.write();
    return bytes;
  }
};

// A write counted in exit_after_writes() is over: the last one out takes a second stop signal's
// exit.
TRAINKIT_INLINE void write_finished() {
  auto& writes = exit_after_writes();
  if (writes.writing.fetch_sub(1) == 1)
    if (const int sig = writes.exit_signal.load(); sig != 0) ::_exit(128 + sig);
}

// What `work` threw, or "".
template <class Work>
std::string error_of(Work&& work) {
  try {
    work();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Every rank learns whether any rank failed at this point of a set's save (`error`: this rank's
// failure, or ""), and each throws alike: its own error, or that `others` failed.
TRAINKIT_INLINE void agree_on_failure(Replicas& replicas, const std::string& error, const std::string& path,
                                      const std::string& others) {
  const auto failed = replicas.count_failures({!error.empty()});
  if (!error.empty()) throw CheckpointError(error);
  if (failed[0] > 0)
    throw CheckpointError("cannot write checkpoint '" + path + "': " + std::to_string(failed[0]) +
                          " other rank(s) " + others + " (each says why); the previous checkpoints are intact");
}

// A save's token: what tells its files from an earlier attempt's at the same name (48 bits: a
// double carries it exactly through the ranks' all-reduce).
TRAINKIT_INLINE std::uint64_t fresh_token() {
  std::random_device device;
  const auto now = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return ((static_cast<std::uint64_t>(device()) << 16 ^ now ^ static_cast<std::uint64_t>(::getpid()) << 32) &
          ((std::uint64_t{1} << 48) - 1)) | 1;
}
}  // namespace detail

TRAINKIT_INLINE detail::StagedSet CheckpointManager::stage_set(AnyTrainer& trainer, const LoopState& state,
                                                               bool epoch_end, const std::vector<CallbackState>& callbacks,
                                                               bool copies, bool count_write) const {
  auto& replicas = trainer.replicas();
  detail::StagedSet s;
  s.path = epoch_end ? epoch_path(state.position.epoch - 1) : position_path(state.position);
  s.rank = replicas.rank();
  s.world = replicas.world_size();
  s.main = replicas.is_main();
  const auto fail = [&](const std::string& why) { return CheckpointError("cannot write checkpoint '" + s.path + "': " + why); };
  // The ranks agree, in two small all-reduces: on the main rank's token for the save; that they
  // name one directory; that each sees the file the main rank has just written there (a set's
  // files meet in a directory every rank shares).
  const std::string probe = directory_ + "/." + prefix_ + ".set-probe";
  // (A set already under the name, from a resume that writes names again, stays loadable until
  // the first new file replaces one of its own; from then on its index and its files' tokens
  // differ, and a reader skips it as damaged until the new index is in.)
  std::uint64_t token = 0;
  std::string failed_here;
  if (s.main) {
    try {
      token = detail::fresh_token();
      detail::write_bytes_atomically(detail::token_text(token), probe);
    } catch (const std::exception& e) {
      failed_here = e.what();
    }
  }
  const auto place = static_cast<double>(std::hash<std::string>{}(directory_) & ((std::uint64_t{1} << 48) - 1));
  std::vector<double> agreed{static_cast<double>(token), place, -place, failed_here.empty() ? 0.0 : 1.0};
  replicas.all_reduce(agreed, Reduce::max);
  if (!failed_here.empty()) throw fail(failed_here);
  if (agreed[3] > 0) throw fail("the main rank could not write into '" + directory_ + "' (it says why)");
  s.token = static_cast<std::uint64_t>(agreed[0]);
  const auto blind = replicas.count_failures({!sees_probe(probe, s.token)});
  if (s.main) ::unlink(probe.c_str());
  if (blind[0] > 0 && agreed[1] != -agreed[2])
    throw fail("the ranks name different output directories (this rank's is '" + directory_ + "'); a checkpoint "
               "set's files meet in one directory that every rank shares: give every rank the same OUTPUT_PATH, or "
               "set TRAIN.CHECKPOINT_FORMAT: single");
  if (blind[0] > 0)
    throw fail(std::to_string(blind[0]) + " rank(s) do not see the files the main rank writes in '" +
               directory_ + "': a checkpoint set needs a directory every rank shares (one machine, or a shared file "
               "system); set TRAIN.CHECKPOINT_FORMAT: single to have the main rank write one file");
  if (count_write) detail::exit_after_writes().writing.fetch_add(1);  // (a second signal now waits for this file)
  // From here on a failure is this rank's alone: kept, and agreed on by the caller.
  try {
    auto archive = std::make_unique<torch::serialize::OutputArchive>();
    bool copied = true;
    {
      std::optional<detail::StagedWrites> staged;
      if (copies) staged.emplace(&staging_);
      {
        detail::ShardedWrites pieces(*archive, s.main);
        if (s.main) {
          fill(*archive, trainer, state, s.path, callbacks);
          detail::write_value(*archive, "set.token", detail::token_text(s.token));
        } else {
          trainer.save(*archive);  // (this rank's pieces; its other records are the main rank's)
        }
        s.chunks = pieces.take();
      }
      if (staged) {
        staged->wait();
        copied = staged->complete() && callbacks.empty();  // (a callback writes its own records)
      }
    }
    if (s.main) {
      s.records.path_ = detail::records_path(s.path);
      if (copied) s.records.archive_ = std::move(archive);
      else s.records.bytes_ = detail::archive_bytes(*archive);
    }
  } catch (const std::exception& e) {
    s.error = "cannot write checkpoint '" + s.path + "': " + e.what();
  }
  return s;
}

TRAINKIT_INLINE bool CheckpointManager::sees_probe(const std::string& probe, std::uint64_t token) {
  std::ifstream in(probe, std::ios::binary);
  std::string text;
  std::getline(in, text);
  return text == detail::token_text(token);
}

TRAINKIT_INLINE std::string CheckpointManager::save_set(AnyTrainer& trainer, const LoopState& state, bool epoch_end,
                                                        const std::vector<CallbackState>& callbacks) {
  auto s = stage_set(trainer, state, epoch_end, callbacks, /*copies=*/false);
  // Every rank learns whether every file is in place, and then whether the index is: no rank
  // reports a checkpoint that does not exist, none waits for one that will not.
  std::string error = s.error;
  if (error.empty()) error = detail::error_of([&] { s.write(); });
  detail::agree_on_failure(trainer.replicas(), error, s.path, "could not write their files");
  if (s.main) {
    // (every file was renamed in before the all-reduce: a short wait is for the file system)
    const std::atomic<bool> never{false};
    error = detail::error_of([&] { detail::write_index(s.path, s.world, s.token, never, std::min(set_timeout_s_, 60.0)); });
  }
  detail::agree_on_failure(trainer.replicas(), error, s.path, "(the main rank) could not write the index");
  if (s.main) prune(state.best_path, s.path);
  return s.path;
}

TRAINKIT_INLINE std::string CheckpointManager::save_set_in_background(AnyTrainer& trainer, const LoopState& state,
                                                                      bool epoch_end,
                                                                      const std::vector<CallbackState>& callbacks) {
  // Counted once the ranks agreed, before the copy: a second stop signal then waits for this
  // rank's file (not before: a rank waiting in the agreement for a peer gone would wait long).
  auto staged = std::make_shared<detail::StagedSet>(
      stage_set(trainer, state, epoch_end, callbacks, /*copies=*/true, /*count_write=*/true));
  // Every rank learns whether every rank staged its part (a failure here is one rank's).
  try {
    detail::agree_on_failure(trainer.replicas(), staged->error, staged->path, "could not copy their part");
  } catch (...) {
    detail::write_finished();
    throw;
  }
  const std::string path = staged->path;
  start_background(path, [this, staged = std::move(staged), best = state.best_path](const std::atomic<bool>& cancel) mutable {
    std::size_t bytes = staged->write();
    if (staged->main) {
      bytes = detail::write_index(staged->path, staged->world, staged->token, cancel, set_timeout_s_);
      prune(best, staged->path);
    }
    staged.reset();  // (its copies, cut from the region: gone before the region grows)
    staging_.reserve_wanted();
    return bytes;
  });
  return path;
}

TRAINKIT_INLINE void CheckpointManager::start_background(const std::string& path,
                                                         std::function<std::size_t(const std::atomic<bool>&)> write) {
  auto job = std::make_unique<detail::BackgroundWrite>();
  job->written = {path, 0, 0.0};
  detail::BackgroundWrite* j = job.get();
  job->thread = std::thread([j, write = std::move(write)] {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      j->written.bytes = write(j->cancel);
    } catch (const std::exception& e) {
      j->error = e.what();
    } catch (...) {
      j->error = "cannot write checkpoint '" + j->written.path + "': an unknown error";
    }
    j->written.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    j->done.store(true, std::memory_order_release);
    detail::write_finished();
  });
  background_ = std::move(job);
}

TRAINKIT_INLINE std::string CheckpointManager::save_in_background(AnyTrainer& trainer, const LoopState& state,
                                                                  bool epoch_end,
                                                                  const std::vector<CallbackState>& callbacks) {
  wait_background();
  if (writes_set(trainer)) return save_set_in_background(trainer, state, epoch_end, callbacks);
  auto staged = std::make_shared<Staged>(stage(trainer, state, epoch_end, callbacks));
  const std::string path = staged->path();
  detail::exit_after_writes().writing.fetch_add(1);  // (before the thread: a second signal waits for it)
  start_background(path, [this, staged = std::move(staged), best = state.best_path](const std::atomic<bool>&) mutable {
    const std::size_t bytes = staged->write();
    prune(best, staged->path());
    staged.reset();  // (its copies, cut from the region: gone before the region grows)
    staging_.reserve_wanted();
    return bytes;
  });
  return path;
}

TRAINKIT_INLINE CheckpointManager::Staged CheckpointManager::stage(const AnyTrainer& trainer, const LoopState& state,
                                                                  bool epoch_end,
                                                                  const std::vector<CallbackState>& callbacks) const {
  Staged s;
  s.path_ = epoch_end ? epoch_path(state.position.epoch - 1) : position_path(state.position);
  try {
    s.archive_ = std::make_unique<torch::serialize::OutputArchive>();
    bool copied = false;
    {
      detail::StagedWrites copies(&staging_);
      fill(*s.archive_, trainer, state, s.path_, callbacks);
      copies.wait();
      copied = copies.complete() && callbacks.empty();  // (a callback writes its own records)
    }
    if (!copied) s.bytes_ = detail::archive_bytes(*std::exchange(s.archive_, nullptr));
  } catch (const std::exception& e) {
    throw CheckpointError("cannot write checkpoint '" + s.path_ + "': " + e.what());
  }
  return s;
}

TRAINKIT_INLINE std::size_t CheckpointManager::Staged::write() {
  if (archive_) return detail::write_archive_atomically(*std::exchange(archive_, nullptr), path_);
  return detail::write_bytes_atomically(std::exchange(bytes_, std::string()), path_);
}

TRAINKIT_INLINE CheckpointManager::Written CheckpointManager::join_background() {
  background_->thread.join();
  const auto job = std::move(background_);
  if (!job->error.empty()) throw CheckpointError(job->error + " (written in the background)");
  return job->written;
}

TRAINKIT_INLINE std::optional<CheckpointManager::Written> CheckpointManager::background_done() {
  if (!background_ || !background_->done.load(std::memory_order_acquire)) return std::nullopt;
  return join_background();
}

TRAINKIT_INLINE std::optional<CheckpointManager::Written> CheckpointManager::wait_background() {
  if (!background_) return std::nullopt;
  return join_background();
}

TRAINKIT_INLINE void CheckpointManager::cancel_background() {
  if (!background_) return;
  background_->cancel.store(true);
  background_->thread.join();
  background_.reset();
}

TRAINKIT_INLINE CheckpointManager::~CheckpointManager() {
  if (!background_) return;
  // A set's other ranks may be gone: their files are waited for a while (a set is complete
  // when they are alive and a moment behind), then no longer.
  for (int i = 0; i < 3000 && !background_->done.load(std::memory_order_acquire); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  background_->cancel.store(true);
  try {
    join_background();
  } catch (const std::exception& e) {
    std::cerr << "trainkit: " << e.what() << std::endl;
  }
}

}  // namespace trainkit
