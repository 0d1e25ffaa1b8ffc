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
#include <trainkit/any_trainer.hpp>
#include <trainkit/detail/checkpoint_io.hpp>
#include <trainkit/detail/zip_check.hpp>
#include <trainkit/metrics.hpp>

#include <ATen/Context.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
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

  /// The records, "fit.*"; `path` is the file's own name.
  void save(torch::serialize::OutputArchive& a, const std::string& path) const {
    detail::write_value(a, "fit.epoch", position.epoch);
    detail::write_value(a, "fit.index", position.index);
    detail::write_value(a, "fit.seed", seed);
    detail::write_value(a, "fit.config", config_json);
    detail::write_value(a, "fit.best_metric", best_metric);
    detail::write_value(a, "fit.higher_is_better", higher_is_better);
    detail::write_value(a, "fit.best_value", best_value);
    detail::write_value(a, "fit.best_path", best_path);
    detail::write_value(a, "fit.path", path);
    detail::write_value(a, "fit.finished", finished);
    detail::write_value(a, "fit.piece_items", piece_items);
    detail::write_value(a, "fit.world_size", world_size);
    detail::write_value(a, "fit.total_batch", total_batch);
    metrics.save(a, "fit.metrics");
    std::vector<std::string> names;
    std::vector<double> sums, weights;
    for (const auto& [name, sw] : logged.of) {
      names.push_back(name);
      sums.push_back(sw.first);
      weights.push_back(sw.second);
    }
    a.write("fit.logged.names", c10::IValue(c10::List<std::string>(names)));
    a.write("fit.logged.sums", c10::IValue(c10::List<double>(sums)));
    a.write("fit.logged.weights", c10::IValue(c10::List<double>(weights)));
  }
  /// The records save() wrote (those after fit.path may be absent: files of older versions,
  /// whose loop wrote them itself when it did).
  static LoopState read(torch::serialize::InputArchive& a) {
    LoopState s;
    s.position.epoch = detail::read_value(a, "fit.epoch").toInt();
    s.position.index = detail::read_value(a, "fit.index").toInt();
    s.seed = detail::read_value(a, "fit.seed").toInt();
    s.config_json = detail::read_value(a, "fit.config").toStringRef();
    s.best_metric = detail::read_value(a, "fit.best_metric").toStringRef();
    s.higher_is_better = detail::read_value(a, "fit.higher_is_better").toBool();
    s.best_value = detail::read_value(a, "fit.best_value").toDouble();
    s.best_path = detail::read_value(a, "fit.best_path").toStringRef();
    c10::IValue v;
    if (a.try_read("fit.finished", v)) s.finished = v.toStringRef();
    if (a.try_read("fit.piece_items", v)) s.piece_items = v.toInt();
    if (a.try_read("fit.world_size", v)) s.world_size = v.toInt();
    if (a.try_read("fit.total_batch", v)) s.total_batch = v.toInt();
    if (a.try_read("fit.metrics.count", v)) s.metrics.load(a, "fit.metrics");
    if (a.try_read("fit.logged.names", v)) {
      const auto names = v.toListRef();
      const auto sums = detail::read_value(a, "fit.logged.sums").toDoubleList();
      const auto weights = detail::read_value(a, "fit.logged.weights").toDoubleList();
      for (size_t i = 0; i < names.size(); ++i) s.logged.of[names[i].toStringRef()] = {sums.get(i), weights.get(i)};
    }
    return s;
  }
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
  explicit DirectoryLock(const std::string& directory) : path_(directory + "/.trainkit.lock") {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0)
      throw CheckpointError("cannot open the lock file '" + path_ + "': " + std::strerror(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      char buf[32] = {};
      const auto n = ::pread(fd_, buf, sizeof buf - 1, 0);
      ::close(fd_);
      fd_ = -1;
      const std::string holder = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("unknown");
      if (error == EWOULDBLOCK)
        throw CheckpointError("the output directory '" + directory + "' is in use by another training job (pid " +
                              holder.substr(0, holder.find_first_of(" \n")) + ", lock file '" + path_ +
                              "'); give this run its own directory (--model-dir or OUTPUT_PATH), or stop the other job");
      throw CheckpointError("cannot lock '" + path_ + "': " + std::strerror(error));
    }
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) {
      // The lock holds without the pid; a refused job then says "pid unknown".
    }
  }
  ~DirectoryLock() {
    if (fd_ >= 0) ::close(fd_);  // closing the descriptor releases the flock
  }
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

class CheckpointManager {
 public:
  /// `keep` >= 1: complete checkpoints kept besides the best.
  CheckpointManager(std::string directory, std::string prefix = "model", std::int64_t keep = 3)
      : directory_(std::move(directory)), prefix_(std::move(prefix)), keep_(keep) {
    if (directory_.empty()) directory_ = ".";
    if (prefix_.empty() || prefix_.find('/') != std::string::npos)
      throw std::invalid_argument("CheckpointManager: the prefix must be a file name without '/', got '" +
                                  prefix_ + "'");
    if (keep_ < 1) throw std::invalid_argument("CheckpointManager: keep must be >= 1, got " + std::to_string(keep_));
  }

  const std::string& directory() const { return directory_; }
  const std::string& prefix() const { return prefix_; }

  /// The file name of the checkpoint written after epoch `epoch` completed.
  std::string epoch_path(std::int64_t epoch) const {
    char name[32];
    std::snprintf(name, sizeof name, "-%04lld.ckpt", static_cast<long long>(epoch));
    return directory_ + "/" + prefix_ + name;
  }
  /// The file name of a checkpoint inside epoch `p.epoch`, resuming at micro-batch `p.index`.
  std::string position_path(FitPosition p) const {
    char name[48];
    std::snprintf(name, sizeof name, "-%04lld-%06lld.ckpt", static_cast<long long>(p.epoch),
                  static_cast<long long>(p.index));
    return directory_ + "/" + prefix_ + name;
  }

  /// Creates the directory (and its parents) if needed; a clear error when that fails.
  void create_directory() const {
    std::string partial;
    std::size_t from = 0;
    while (from <= directory_.size()) {
      const auto slash = directory_.find('/', from);
      partial = directory_.substr(0, slash);
      from = slash == std::string::npos ? directory_.size() + 1 : slash + 1;
      if (partial.empty()) continue;
      if (::mkdir(partial.c_str(), 0777) != 0 && errno != EEXIST)
        throw CheckpointError("cannot create the output directory '" + directory_ + "' ('" + partial +
                              "': " + std::strerror(errno) + ")");
    }
    struct stat st {};
    if (::stat(directory_.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      throw CheckpointError("the output directory '" + directory_ + "' is not a directory");
  }

  /// The checkpoints in the directory, oldest first (by the position they resume at).
  std::vector<CheckpointFile> list() const {
    std::vector<CheckpointFile> files;
    DIR* dir = ::opendir(directory_.c_str());
    if (dir == nullptr) return files;
    while (const dirent* e = ::readdir(dir)) {
      CheckpointFile f;
      if (parse_name(e->d_name, f)) {
        f.path = directory_ + "/" + e->d_name;
        files.push_back(f);
      }
    }
    ::closedir(dir);
    std::sort(files.begin(), files.end(), [](const CheckpointFile& a, const CheckpointFile& b) {
      const auto pa = a.resume_at(), pb = b.resume_at();
      if (!(pa == pb)) return pa < pb;
      return !a.epoch_end() && b.epoch_end();  // the same position: the epoch-end file is newer
    });
    return files;
  }

  /// Writes a checkpoint of `trainer`, `state` and the callbacks' states (epoch_end: named
  /// after the completed epoch state.position.epoch - 1; else after the position), then
  /// applies the retention rule. Returns the path. Throws CheckpointError naming the file;
  /// files already written stay.
  std::string save(const AnyTrainer& trainer, const LoopState& state, bool epoch_end,
                   const std::vector<CallbackState>& callbacks = {}) {
    const std::string path = epoch_end ? epoch_path(state.position.epoch - 1) : position_path(state.position);
    try {
      torch::serialize::OutputArchive archive;
      trainer.save(archive);
      state.save(archive, path);
      for (const auto& c : callbacks) {
        torch::serialize::OutputArchive nested;
        c.save(nested);
        archive.write("fit.callback." + c.name, nested);
      }
      detail::write_archive_atomically(archive, path);
    } catch (const std::exception& e) {
      throw CheckpointError(e.what());
    }
    prune(state.best_path);
    return path;
  }

  /// Deletes all but the newest `keep` checkpoints and `best_path`, and stale temporary files.
  void prune(const std::string& best_path = {}) const {
    const auto files = list();
    const std::size_t keep = static_cast<std::size_t>(keep_);
    for (std::size_t i = 0; i + keep < files.size(); ++i)
      if (files[i].path != best_path) ::unlink(files[i].path.c_str());
    remove_stale_temporaries();
  }

  /// A checkpoint opened and checked (its CRCs, the loop's records), nothing loaded yet.
  struct Opened {
    std::string path;
    LoopState state;
    torch::serialize::InputArchive archive;
  };
  /// Opens `path`. Throws when the file is damaged or is not a fit checkpoint.
  Opened open(const std::string& path) const {
    Opened o{path, {}, {}};
    if (const std::string why = open_checkpoint(o.archive, path); !why.empty())
      throw std::runtime_error("checkpoint '" + path + "': " + why);
    o.state = LoopState::read(o.archive);
    return o;
  }
  /// Opens the newest complete checkpoint; std::nullopt when there is none. Damaged files are
  /// reported on `report` (stderr by default) and skipped.
  std::optional<Opened> open_newest(std::ostream& report = std::cerr) const {
    const auto files = list();
    for (auto it = files.rbegin(); it != files.rend(); ++it) {
      Opened o{it->path, {}, {}};
      if (const std::string why = open_checkpoint(o.archive, it->path); !why.empty()) {
        report << "trainkit: skipping checkpoint '" << it->path << "': " << why;
        report << (std::next(it) != files.rend() ? "; trying the previous one\n" : "; no older checkpoint\n");
        continue;
      }
      o.state = LoopState::read(o.archive);
      return o;
    }
    return std::nullopt;
  }
  /// Loads an opened checkpoint into `trainer` (a failure puts its previous state back and
  /// throws, naming the file), then into each callback. Returns the names of the callbacks
  /// the checkpoint has no state for (written without them): they are not loaded.
  std::vector<std::string> restore(Opened& opened, AnyTrainer& trainer, const std::vector<CallbackState>& callbacks = {}) const {
    detail::load_or_restore(trainer, opened.archive, opened.path);
    std::vector<std::string> missing;
    for (const auto& c : callbacks) {
      torch::serialize::InputArchive nested;
      if (opened.archive.try_read("fit.callback." + c.name, nested)) c.load(nested);
      else missing.push_back(c.name);
    }
    return missing;
  }

  /// What load() and resume_newest() give back.
  struct Loaded {
    std::string path;
    LoopState state;
  };
  /// open() and restore() in one: `path` into `trainer`.
  Loaded load(AnyTrainer& trainer, const std::string& path) const {
    Opened o = open(path);
    restore(o, trainer);
    return {o.path, std::move(o.state)};
  }
  /// open_newest() and restore() in one; std::nullopt when there is no complete checkpoint.
  std::optional<Loaded> resume_newest(AnyTrainer& trainer, std::ostream& report = std::cerr) const {
    auto o = open_newest(report);
    if (!o) return std::nullopt;
    restore(*o, trainer);
    return Loaded{o->path, std::move(o->state)};
  }

  /// Whether `path` is a complete, undamaged archive written by this manager (every record
  /// matches its CRC-32, the fit loop's records are there); `why` says what is wrong when not.
  /// Reads the whole file.
  static bool is_complete(const std::string& path, std::string* why = nullptr) {
    torch::serialize::InputArchive archive;
    const std::string what = open_checkpoint(archive, path);
    if (why) *why = what;
    return what.empty();
  }

 private:
  // Opens `path` into `archive` (its CRCs checked): "" when it is a complete fit checkpoint,
  // else what is wrong with it.
  static std::string open_checkpoint(torch::serialize::InputArchive& archive, const std::string& path) {
    try {
      detail::read_archive(archive, path);
      c10::IValue v;
      if (!archive.try_read("meta.trainer", v)) return "not a trainkit checkpoint (no meta.trainer record)";
      if (!archive.try_read("fit.epoch", v)) return "not written by the fit loop (no fit.epoch record)";
      return "";
    } catch (const detail::DamagedArchive& e) {
      return e.damage();
    } catch (const std::exception& e) {
      return first_line(e.what());
    }
  }

  static std::string first_line(const std::string& s) {
    const auto nl = s.find('\n');
    return nl == std::string::npos ? s : s.substr(0, nl);
  }

  // "<prefix>-EEEE.ckpt" or "<prefix>-EEEE-IIIIII.ckpt" (digits only).
  bool parse_name(const std::string& name, CheckpointFile& f) const {
    const std::string head = prefix_ + "-", tail = ".ckpt";
    if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
        name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
      return false;
    const std::string middle = name.substr(head.size(), name.size() - head.size() - tail.size());
    const auto dash = middle.find('-');
    const std::string e = middle.substr(0, dash);
    const std::string i = dash == std::string::npos ? "" : middle.substr(dash + 1);
    auto digits = [](const std::string& s) {
      return !s.empty() && s.size() <= 12 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
    };
    if (!digits(e) || (dash != std::string::npos && !digits(i))) return false;
    f.epoch = std::stoll(e);
    f.index = dash == std::string::npos ? -1 : std::stoll(i);
    return true;
  }

  // Temporary files of Trainer::save ("<name>.tmp.<pid>") whose process is gone. A temporary
  // of a live process (another job writing into this directory, which DirectoryLock refuses,
  // or this one) is never touched.
  void remove_stale_temporaries() const {
    DIR* dir = ::opendir(directory_.c_str());
    if (dir == nullptr) return;
    std::vector<std::string> stale;
    const std::string head = prefix_ + "-", marker = ".ckpt.tmp.";
    while (const dirent* e = ::readdir(dir)) {
      const std::string name = e->d_name;
      const auto at = name.find(marker);
      if (name.compare(0, head.size(), head) != 0 || at == std::string::npos) continue;
      const std::string pid = name.substr(at + marker.size());
      if (pid.empty() || pid.size() > 10 || !std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; }))
        continue;
      if (!process_is_gone(static_cast<pid_t>(std::stoll(pid)))) continue;
      stale.push_back(directory_ + "/" + name);
    }
    ::closedir(dir);
    for (const auto& p : stale) ::unlink(p.c_str());
  }

  // kill(pid, 0): ESRCH means no such process; EPERM means it exists (another user's).
  static bool process_is_gone(pid_t pid) {
    if (pid <= 0) return false;
    return ::kill(pid, 0) != 0 && errno == ESRCH;
  }

  std::string directory_, prefix_;
  std::int64_t keep_;
};

}  // namespace trainkit
