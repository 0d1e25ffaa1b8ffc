#pragma once
/// Checkpoints of a training run in one directory: naming, retention, finding the one to
/// resume from.
///
///   tk::CheckpointManager checkpoints(dir, "model", /*keep*/ 3);
///   checkpoints.save(trainer, state, /*epoch_end*/ true);   // model-0004.ckpt
///   if (auto resumed = checkpoints.resume_newest(trainer)) start = resumed->state.position;
///
///   // or in two steps, to look at the loop's state before the trainer changes:
///   if (auto opened = checkpoints.open_newest()) {
///     check(opened->state.config_json);               // throws: nothing has changed
///     checkpoints.restore(*opened, trainer, callbacks);
///   }
///
/// Names (the position is where training resumes from the file):
///   <prefix>-<epoch:04d>.ckpt               written after epoch `epoch` completed
///                                           (VL-BERT's numbering: RESUME at BEGIN_EPOCH = e + 1)
///   <prefix>-<epoch:04d>-<index:06d>.ckpt   written inside epoch `epoch` (a signal, a request)
///                                           after micro-batches [0, index); resumes at `index`
/// Each part writes its own records: the trainer (AnyTrainer::save), the loop's state (one
/// LoopState: position, seed, resolved configuration, best metric, running sums...) and each
/// callback's (CallbackState). The file is written atomically (temporary file in the same
/// directory, fsync, rename, directory fsync): a file under one of these names is always
/// complete. The RNG states (CPU, and CUDA on a GPU) are the trainer's (detail/rng_state.hpp).
/// A restore that fails puts the trainer's previous state back (detail::load_or_restore).
///
/// Retention: after a new file is in place, the newest `keep` files (by position) stay, and the
/// best one (by the validation metric recorded in LoopState); older ones are deleted. Stale
/// temporary files left by a killed process are deleted too.
///
/// Resuming: resume_newest() loads the newest complete file. A file that is not a complete,
/// undamaged archive (truncated, a record that fails its CRC-32, not a trainkit checkpoint of a
/// fit loop) is reported on stderr with its name and why, and the previous one is tried. A
/// checkpoint of another trainer type or other parameter shapes is an error (Trainer::load's
/// message names the file and the first mismatch): a wrong configuration, not a damaged file.
#include <trainkit/detail/inline.hpp>
#include <trainkit/trainer/any_trainer.hpp>
#include <trainkit/archive/checkpoint_io.hpp>
#include <trainkit/archive/checkpoint_set.hpp>
#include <trainkit/archive/zip_check.hpp>
#include <trainkit/fit/fit_options.hpp>
#include <trainkit/fit/metrics.hpp>

#include <ATen/Context.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

namespace trainkit {

/// Where a run stands: the next micro-batch to train is `index` of `epoch`.
struct FitPosition {
  std::int64_t epoch = 0;
  std::int64_t index = 0;
  friend bool operator<(const FitPosition& a, const FitPosition& b) {
    return std::tie(a.epoch, a.index) < std::tie(b.epoch, b.index);
  }
  friend bool operator==(const FitPosition& a, const FitPosition& b) {
    return a.epoch == b.epoch && a.index == b.index;
  }
};

/// The fit loop's state stored with the trainer's in every checkpoint: one record set, written
/// and read by save() / read().
struct LoopState {
  FitPosition position;           ///< where training resumes (the data sampler's state)
  std::int64_t seed = -1;         ///< the run's RNG_SEED (the data order depends on it)
  std::string config_json;        ///< the resolved configuration
  std::string best_metric;        ///< validation metric that ranks checkpoints ("" = none)
  bool higher_is_better = true;
  double best_value = std::numeric_limits<double>::quiet_NaN();  ///< NaN: none yet
  std::string best_path;          ///< the checkpoint holding the best value ("" = none)
  std::string finished;           ///< why a callback finished training ("": it goes on)
  std::int64_t piece_items = 0;   ///< the largest piece of a micro-batch run (0: whole ones)
  std::int64_t world_size = 0;    ///< processes of the run that wrote it (0: not recorded)
  std::int64_t total_batch = 0;   ///< its samples per optimizer step over every process (0: not known)
  Metrics metrics;                ///< the epoch's running sums ("Loss" and the task's metrics)
  Metrics::Totals logged;         ///< the sums at the last log window
  std::map<std::string, double> train;       ///< the last completed epoch's means (over every rank)
  std::map<std::string, double> validation;  ///< the last validation's metrics

  /// The records, "fit.*"; `path` is the file's own name.
  void save(torch::serialize::OutputArchive& a, const std::string& path) const;
  /// The records save() wrote (those after fit.path may be absent: files of older versions,
  /// whose loop wrote them itself when it did).
  static LoopState read(torch::serialize::InputArchive& a);

 private:
  static void write_means(torch::serialize::OutputArchive& a, const std::string& key,
                          const std::map<std::string, double>& means);
  static std::map<std::string, double> read_means(torch::serialize::InputArchive& a, const std::string& key);
};

/// State a callback keeps across a resume (an EMA of the weights, early stopping's counters):
/// `save` writes it into every checkpoint the loop writes (as "fit.callback.<name>"), `load`
/// reads it back when the loop resumes from one. A checkpoint without it (written before the
/// callback existed) is said once, and `load` is not called. Data parallel: the main rank's
/// state is saved, and every rank loads it.
struct CallbackState {
  std::string name;
  std::function<void(torch::serialize::OutputArchive&)> save;
  std::function<void(torch::serialize::InputArchive&)> load;
};

/// A checkpoint file found in the directory.
struct CheckpointFile {
  std::string path;
  std::int64_t epoch = 0;
  std::int64_t index = -1;  ///< -1: written after epoch `epoch` completed; else mid-epoch
  bool epoch_end() const { return index < 0; }
  FitPosition resume_at() const { return epoch_end() ? FitPosition{epoch + 1, 0} : FitPosition{epoch, index}; }
};

/// Thrown when a checkpoint cannot be written (the message names the file and why).
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// An exclusive lock on a run's output directory, held while a job writes into it: two jobs
/// started on one directory would otherwise delete each other's temporary files and overwrite
/// each other's checkpoints. flock() on `<directory>/.trainkit.lock`, so the kernel releases it
/// when the holder exits or dies (SIGKILL included); the file keeps the holder's pid for the
/// message of the job that is refused.
class DirectoryLock {
 public:
  /// Throws CheckpointError naming the directory and the holder's pid when another process (or
  /// another DirectoryLock in this one) holds it.
  explicit DirectoryLock(const std::string& directory);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

namespace detail {
struct BackgroundWrite;
struct StagedSet;
}

class CheckpointManager {
 public:
  /// `keep` >= 1: complete checkpoints kept besides the best.
  CheckpointManager(std::string directory, std::string prefix = "model", std::int64_t keep = 3);
  /// Waits for a background write in flight (its error, if any, said on stderr).
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  const std::string& directory() const { return directory_; }
  const std::string& prefix() const { return prefix_; }
  CheckpointFormat format() const { return format_; }
  void set_format(CheckpointFormat format) { format_ = format; }
  /// Whether a checkpoint of `trainer` is a set (docs/design/checkpoints.md, "Sharded sets"):
  /// then every rank calls save() / save_in_background(), each writing its own file, and the
  /// main rank the index; else the main rank alone calls them (a sharded trainer's other ranks
  /// call trainer.save(archive) for the gather).
  bool writes_set(const AnyTrainer& trainer) const;

  /// The file name of the checkpoint written after epoch `epoch` completed.
  std::string epoch_path(std::int64_t epoch) const;
  /// The file name of a checkpoint inside epoch `p.epoch`, resuming at micro-batch `p.index`.
  std::string position_path(FitPosition p) const;

  /// Creates the directory (and its parents) if needed; a clear error when that fails.
  void create_directory() const;

  /// The checkpoints in the directory, oldest first (by the position they resume at).
  std::vector<CheckpointFile> list() const;

  /// Writes a checkpoint of `trainer`, `state` and the callbacks' states (epoch_end: named
  /// after the completed epoch state.position.epoch - 1; else after the position), then
  /// applies the retention rule. Returns the path. Throws CheckpointError naming the file;
  /// files already written stay. Waits for a background write in flight first (its error
  /// thrown): one file at a time.
  std::string save(AnyTrainer& trainer, const LoopState& state, bool epoch_end,
                   const std::vector<CallbackState>& callbacks = {});

  /// A checkpoint ready to be written: the state as it was at stage(), whatever changes it
  /// afterwards. Its records are host copies of the state's tensors (detail::StagedWrites),
  /// serialized by write(); where a record cannot be copied so (callbacks' states, a
  /// torch::optim optimizer's), the whole file was serialized at stage() instead.
  class Staged {
   public:
    const std::string& path() const { return path_; }
    /// The records are copies, serialized by write() (false: serialized at stage()).
    bool copied() const { return archive_ != nullptr; }
    /// Writes the file atomically, as save() does, serializing the records into it (no copy of
    /// the file in memory) when they were not serialized at stage(). Any thread, once. Returns
    /// the file's size.
    std::size_t write();

   private:
    friend class CheckpointManager;
    std::string path_;
    std::unique_ptr<torch::serialize::OutputArchive> archive_;
    std::string bytes_;
  };
  Staged stage(const AnyTrainer& trainer, const LoopState& state, bool epoch_end,
               const std::vector<CallbackState>& callbacks = {}) const;

  /// save() with the file written on a thread of its own (FitOptions::background_checkpoints).
  /// Waits for the previous background write first (throwing its error), then stage()s the
  /// checkpoint: the only pause, a copy of the state to host memory (training may change the
  /// state as soon as this returns). A thread serializes and writes it, atomically as save()
  /// does, and applies the retention rule; the path returned is complete once
  /// background_done() or wait_background() has returned it. Throws CheckpointError naming
  /// the file.
  std::string save_in_background(AnyTrainer& trainer, const LoopState& state, bool epoch_end,
                                 const std::vector<CallbackState>& callbacks = {});
  /// A background write, finished.
  struct Written {
    std::string path;
    std::size_t bytes = 0;
    double seconds = 0;  ///< the thread's time: the file, its flush to disk, the rename, retention
  };
  /// The background write, when it finished since the last call (never waits); throws
  /// CheckpointError naming the file when it failed (the previous checkpoints are intact).
  std::optional<Written> background_done();
  /// The background write in flight, waited for; as background_done().
  std::optional<Written> wait_background();
  /// The host region background saves copy the state into, reused by each (its bytes; the last
  /// save's copies, and those made outside it: the first save's, or where the state grew).
  const detail::StagingRegion& staging() const { return staging_; }
  /// The background write in flight, stopped where it waits for other ranks (a set's main rank,
  /// for their files: the set then has no index) and joined; its result or error dropped. For
  /// when another rank's part failed.
  void cancel_background();

  /// Deletes all but the newest `keep` checkpoints and `best_path` (a set's files with its
  /// index, the index first), stale temporary files, and the files of sets whose index was
  /// never written (a crash) up to the position of `written`, the checkpoint just written
  /// (later ones may be in flight on other ranks). Complete checkpoints after `written` (of a
  /// timeline the run left, resuming from an earlier one) neither count nor go.
  void prune(const std::string& best_path = {}, const std::string& written = {}) const;

  /// A checkpoint opened and checked (its CRCs, the loop's records), nothing loaded yet.
  struct Opened {
    std::string path;
    LoopState state;
    torch::serialize::InputArchive archive;  ///< a set's: its records file
    std::shared_ptr<detail::ShardSource> shards;  ///< a set's tensor records (none: one file)
  };
  /// Opens `path`. Throws when the file is damaged or is not a fit checkpoint.
  Opened open(const std::string& path) const;
  /// Opens the newest complete checkpoint (older than the checkpoint `before`, when given: one
  /// that failed to load); std::nullopt when there is none. Damaged files are reported on
  /// `report` (stderr by default) and skipped.
  std::optional<Opened> open_newest(std::ostream& report = std::cerr, const std::string& before = {}) const;
  /// Loads an opened checkpoint into `trainer` (a failure puts its previous state back and
  /// throws, naming the file), then into each callback. Returns the names of the callbacks
  /// the checkpoint has no state for (written without them): they are not loaded.
  std::vector<std::string> restore(Opened& opened, AnyTrainer& trainer,
                                   const std::vector<CallbackState>& callbacks = {}) const;

  /// What load() and resume_newest() give back.
  struct Loaded {
    std::string path;
    LoopState state;
  };
  /// open() and restore() in one: `path` into `trainer`.
  Loaded load(AnyTrainer& trainer, const std::string& path) const;
  /// open_newest() and restore() in one; std::nullopt when there is no complete checkpoint. A
  /// checkpoint whose restore finds damage (a set's piece, checked as it is read) is reported and
  /// the previous one tried.
  std::optional<Loaded> resume_newest(AnyTrainer& trainer, std::ostream& report = std::cerr) const;

  /// Whether `path` is a complete, undamaged checkpoint written by this manager (every record
  /// matches its CRC-32, a set's every file and chunk too, the fit loop's records are there);
  /// `why` says what is wrong when not. Reads every file.
  static bool is_complete(const std::string& path, std::string* why = nullptr);

 private:
  // Opens `path` into `archive` (its CRCs checked): "" when it is a complete fit checkpoint,
  // else what is wrong with it.
  // A set's tensor records go to `shards`.
  static std::string open_checkpoint(torch::serialize::InputArchive& archive, const std::string& path,
                                     std::shared_ptr<detail::ShardSource>* shards = nullptr);

  static std::string first_line(const std::string& s);
  // The loop's records of an opened checkpoint (a set's tensors from its files).
  static LoopState read_state(Opened& opened);

  // "<prefix>-EEEE.ckpt" or "<prefix>-EEEE-IIIIII.ckpt" (digits only).
  bool parse_name(const std::string& name, CheckpointFile& f) const;

  // Temporary files of Trainer::save ("<name>.tmp.<pid>") whose process is gone. A temporary
  // of a live process (another job writing into this directory, which DirectoryLock refuses,
  // or this one) is never touched.
  // A set's files' temporaries only for sets up to `up_to` (later ones may be in flight).
  void remove_stale_temporaries(std::optional<FitPosition> up_to) const;

  // kill(pid, 0): ESRCH means no such process; EPERM means it exists (another user's).
  static bool process_is_gone(pid_t pid);

  // The archive of a checkpoint: the trainer's, the loop's and the callbacks' records.
  static void fill(torch::serialize::OutputArchive& archive, const AnyTrainer& trainer, const LoopState& state,
                   const std::string& path, const std::vector<CallbackState>& callbacks);
  // The background write, joined: its result, or its error thrown.
  Written join_background();

  // A set: this rank's pieces and (main rank) its other records, staged with host copies when
  // `copies` (a background write); the main rank's token for the save agreed by every rank.
  // `count_write`: counted in detail::exit_after_writes() once the ranks agreed.
  detail::StagedSet stage_set(AnyTrainer& trainer, const LoopState& state, bool epoch_end,
                              const std::vector<CallbackState>& callbacks, bool copies, bool count_write = false) const;
  std::string save_set(AnyTrainer& trainer, const LoopState& state, bool epoch_end,
                       const std::vector<CallbackState>& callbacks);
  std::string save_set_in_background(AnyTrainer& trainer, const LoopState& state, bool epoch_end,
                                     const std::vector<CallbackState>& callbacks);
  // Whether the probe file holds `token` (the ranks' shared-directory check).
  static bool sees_probe(const std::string& probe, std::uint64_t token);
  // `write` (the bytes written; `cancel`: stop waiting for other ranks) on a thread of its own,
  // as the background write of `path`; the caller has counted it in exit_after_writes().
  void start_background(const std::string& path, std::function<std::size_t(const std::atomic<bool>&)> write);
  // Deletes a checkpoint: a file, or a set (its index first).
  void remove_checkpoint(const std::string& path) const;
  // The set-member file `name` ("<checkpoint>.records", "<checkpoint>.<r>-of-<w>.safetensors"):
  // its checkpoint's name, or "" when it is not one.
  std::string set_of(const std::string& name) const;

  std::string directory_, prefix_;
  std::int64_t keep_;
  CheckpointFormat format_ = CheckpointFormat::automatic;
  double set_timeout_s_ = 1800;  // how long the main rank waits for the other ranks' files
  // The region background saves copy the state into (stage() and stage_set() are const: what
  // they change is this cache of host memory, which the writer thread grows after its write).
  mutable detail::StagingRegion staging_;
  std::unique_ptr<detail::BackgroundWrite> background_;  // the write in flight (or finished, not yet taken)
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/fit/checkpoint-inl.hpp>
#include <trainkit/fit/checkpoint_writes-inl.hpp>
#endif
