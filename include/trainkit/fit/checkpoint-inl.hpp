#pragma once
/// The definitions of trainkit/fit/checkpoint.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/fit/checkpoint.hpp>

#include <atomic>
#include <chrono>
#include <fstream>
#include <random>
#include <thread>

namespace trainkit {

TRAINKIT_INLINE void LoopState::save(torch::serialize::OutputArchive& a, const std::string& path) const {
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
  write_means(a, "fit.train", train);
  write_means(a, "fit.validation", validation);
}

TRAINKIT_INLINE void LoopState::write_means(torch::serialize::OutputArchive& a, const std::string& key,
                                           const std::map<std::string, double>& means) {
  std::vector<std::string> names;
  std::vector<double> values;
  for (const auto& [name, value] : means) names.push_back(name), values.push_back(value);
  a.write(key + ".names", c10::IValue(c10::List<std::string>(names)));
  a.write(key + ".values", c10::IValue(c10::List<double>(values)));
}

TRAINKIT_INLINE std::map<std::string, double> LoopState::read_means(torch::serialize::InputArchive& a,
                                                                   const std::string& key) {
  std::map<std::string, double> means;
  c10::IValue names;
  if (!a.try_read(key + ".names", names)) return means;  // (older files: not recorded)
  const auto values = detail::read_value(a, key + ".values").toDoubleList();
  const auto list = names.toListRef();
  if (values.size() != list.size())
    throw std::runtime_error("record '" + key + "' has " + std::to_string(list.size()) + " names and " +
                             std::to_string(values.size()) + " values");
  for (size_t i = 0; i < list.size(); ++i) means[list[i].toStringRef()] = values.get(i);
  return means;
}

TRAINKIT_INLINE LoopState LoopState::read(torch::serialize::InputArchive& a) {
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
  s.train = read_means(a, "fit.train");
  s.validation = read_means(a, "fit.validation");
  return s;
}

TRAINKIT_INLINE DirectoryLock::DirectoryLock(const std::string& directory)
    : path_(directory + "/.trainkit.lock") {
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

TRAINKIT_INLINE DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the descriptor releases the flock
}

TRAINKIT_INLINE CheckpointManager::CheckpointManager(std::string directory, std::string prefix, std::int64_t keep)
    : directory_(std::move(directory)), prefix_(std::move(prefix)), keep_(keep) {
  if (directory_.empty()) directory_ = ".";
  if (prefix_.empty() || prefix_.find('/') != std::string::npos)
    throw std::invalid_argument("CheckpointManager: the prefix must be a file name without '/', got '" +
                                prefix_ + "'");
  if (keep_ < 1) throw std::invalid_argument("CheckpointManager: keep must be >= 1, got " + std::to_string(keep_));
}

TRAINKIT_INLINE std::string CheckpointManager::epoch_path(std::int64_t epoch) const {
  char name[32];
  std::snprintf(name, sizeof name, "-%04lld.ckpt", static_cast<long long>(epoch));
  return directory_ + "/" + prefix_ + name;
}

TRAINKIT_INLINE std::string CheckpointManager::position_path(FitPosition p) const {
  char name[48];
  std::snprintf(name, sizeof name, "-%04lld-%06lld.ckpt", static_cast<long long>(p.epoch),
                static_cast<long long>(p.index));
  return directory_ + "/" + prefix_ + name;
}

TRAINKIT_INLINE void CheckpointManager::create_directory() const {
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

TRAINKIT_INLINE std::vector<CheckpointFile> CheckpointManager::list() const {
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

TRAINKIT_INLINE void CheckpointManager::fill(torch::serialize::OutputArchive& archive, const AnyTrainer& trainer,
                                             const LoopState& state, const std::string& path,
                                             const std::vector<CallbackState>& callbacks) {
  trainer.save(archive);
  state.save(archive, path);
  for (const auto& c : callbacks) {
    torch::serialize::OutputArchive nested;
    c.save(nested);
    archive.write("fit.callback." + c.name, nested);
  }
}

TRAINKIT_INLINE bool CheckpointManager::writes_set(const AnyTrainer& trainer) const {
  return format_ == CheckpointFormat::sharded || (format_ == CheckpointFormat::automatic && trainer.saves_collectively());
}

TRAINKIT_INLINE std::string CheckpointManager::save(AnyTrainer& trainer, const LoopState& state, bool epoch_end,
                                                    const std::vector<CallbackState>& callbacks) {
  wait_background();
  if (writes_set(trainer)) return save_set(trainer, state, epoch_end, callbacks);
  const std::string path = epoch_end ? epoch_path(state.position.epoch - 1) : position_path(state.position);
  try {
    torch::serialize::OutputArchive archive;
    fill(archive, trainer, state, path, callbacks);
    detail::write_archive_atomically(archive, path);
  } catch (const std::exception& e) {
    throw CheckpointError(e.what());
  }
  prune(state.best_path, path);
  return path;
}

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
      if (copies) staged.emplace();
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
  start_background(staged->path, [this, staged, best = state.best_path](const std::atomic<bool>& cancel) {
    std::size_t bytes = staged->write();
    if (staged->main) {
      bytes = detail::write_index(staged->path, staged->world, staged->token, cancel, set_timeout_s_);
      prune(best, staged->path);
    }
    return bytes;
  });
  return staged->path;
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
  detail::exit_after_writes().writing.fetch_add(1);  // (before the thread: a second signal waits for it)
  start_background(staged->path(), [this, staged, best = state.best_path](const std::atomic<bool>&) {
    const std::size_t bytes = staged->write();
    prune(best, staged->path());
    return bytes;
  });
  return staged->path();
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
      detail::StagedWrites copies;
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

TRAINKIT_INLINE void CheckpointManager::prune(const std::string& best_path, const std::string& written) const {
  auto files = list();
  // Checkpoints after the one just written are of a timeline this run left (it resumed from an
  // earlier one: TRAIN.RESUME with BEGIN_EPOCH, or past a damaged newest one): they do not take
  // the places of the run's own (the one just written least of all), and go once the run has
  // passed them.
  CheckpointFile now;
  if (!written.empty() && parse_name(written.substr(written.find_last_of('/') + 1), now))
    files.erase(std::remove_if(files.begin(), files.end(),
                               [&](const CheckpointFile& f) { return now.resume_at() < f.resume_at(); }),
                files.end());
  const std::size_t keep = static_cast<std::size_t>(keep_);
  for (std::size_t i = 0; i + keep < files.size(); ++i)
    if (files[i].path != best_path) remove_checkpoint(files[i].path);
  CheckpointFile last;
  const bool bounded = !written.empty() && parse_name(written.substr(written.find_last_of('/') + 1), last);
  remove_stale_temporaries(bounded ? std::optional<FitPosition>(last.resume_at()) : std::nullopt);
  if (!bounded) return;
  // Files of sets whose index was never written (a crash between a set's files and its index),
  // up to the one just written: later ones may be in flight on other ranks.
  DIR* dir = ::opendir(directory_.c_str());
  if (dir == nullptr) return;
  std::vector<std::string> orphans;
  while (const dirent* e = ::readdir(dir)) {
    const std::string set = set_of(e->d_name);
    CheckpointFile f;
    if (set.empty() || !parse_name(set, f) || last.resume_at() < f.resume_at()) continue;
    if (!detail::ShardSource::is_index(directory_ + "/" + set)) orphans.push_back(directory_ + "/" + e->d_name);
  }
  ::closedir(dir);
  for (const auto& p : orphans) ::unlink(p.c_str());
}

TRAINKIT_INLINE void CheckpointManager::remove_checkpoint(const std::string& path) const {
  const bool set = detail::ShardSource::is_index(path);
  ::unlink(path.c_str());  // (a set no longer exists once its index is gone)
  if (!set) return;
  const std::string name = path.substr(path.find_last_of('/') + 1);
  DIR* dir = ::opendir(directory_.c_str());
  if (dir == nullptr) return;
  std::vector<std::string> members;
  while (const dirent* e = ::readdir(dir))
    if (set_of(e->d_name) == name) members.push_back(directory_ + "/" + e->d_name);
  ::closedir(dir);
  for (const auto& p : members) ::unlink(p.c_str());
}

TRAINKIT_INLINE std::string CheckpointManager::set_of(const std::string& name) const {
  const std::string records = ".ckpt.records";
  if (name.size() > records.size() && name.compare(name.size() - records.size(), records.size(), records) == 0)
    return name.substr(0, name.size() - records.size() + 5);
  // "<set>.ckpt.RRRRR-of-WWWWW.safetensors"
  const std::string tail = ".safetensors";
  const auto at = name.rfind(".ckpt.");
  if (at == std::string::npos || name.size() < tail.size() ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
    return "";
  const std::string middle = name.substr(at + 6, name.size() - tail.size() - at - 6);
  const auto of = middle.find("-of-");
  auto digits = [](const std::string& d) {
    return !d.empty() && std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (of == std::string::npos || !digits(middle.substr(0, of)) || !digits(middle.substr(of + 4))) return "";
  return name.substr(0, at + 5);
}

TRAINKIT_INLINE CheckpointManager::Opened CheckpointManager::open(const std::string& path) const {
  Opened o{path, {}, {}, {}};
  if (const std::string why = open_checkpoint(o.archive, path, &o.shards); !why.empty())
    throw std::runtime_error("checkpoint '" + path + "': " + why);
  o.state = read_state(o);
  return o;
}

TRAINKIT_INLINE std::optional<CheckpointManager::Opened> CheckpointManager::open_newest(std::ostream& report,
                                                                                     const std::string& before) const {
  const auto files = list();
  auto it = files.rbegin();
  if (!before.empty()) {
    while (it != files.rend() && it->path != before) ++it;
    if (it != files.rend()) ++it;
  }
  for (; it != files.rend(); ++it) {
    Opened o{it->path, {}, {}, {}};
    std::string why = open_checkpoint(o.archive, it->path, &o.shards);
    if (why.empty()) {
      try {
        o.state = read_state(o);
        return o;
      } catch (const detail::DamagedArchive& e) {
        why = e.damage();
      }
    }
    report << "trainkit: skipping checkpoint '" << it->path << "': " << why;
    report << (std::next(it) != files.rend() ? "; trying the previous one\n" : "; no older checkpoint\n");
  }
  return std::nullopt;
}

TRAINKIT_INLINE LoopState CheckpointManager::read_state(Opened& opened) {
  std::optional<detail::ShardReads> set;
  if (opened.shards) set.emplace(opened.archive, *opened.shards);
  return LoopState::read(opened.archive);
}

TRAINKIT_INLINE std::vector<std::string> CheckpointManager::restore(Opened& opened, AnyTrainer& trainer,
                                                                    const std::vector<CallbackState>& callbacks) const {
  {
    std::optional<detail::ShardReads> set;
    if (opened.shards) set.emplace(opened.archive, *opened.shards);
    detail::load_or_restore(trainer, opened.archive, opened.path);
  }
  std::vector<std::string> missing;
  for (const auto& c : callbacks) {
    torch::serialize::InputArchive nested;
    if (opened.archive.try_read("fit.callback." + c.name, nested)) c.load(nested);
    else missing.push_back(c.name);
  }
  return missing;
}

TRAINKIT_INLINE CheckpointManager::Loaded CheckpointManager::load(AnyTrainer& trainer, const std::string& path) const {
  Opened o = open(path);
  restore(o, trainer);
  return {o.path, std::move(o.state)};
}

TRAINKIT_INLINE std::optional<CheckpointManager::Loaded> CheckpointManager::resume_newest(AnyTrainer& trainer,
                                                                       std::ostream& report) const {
  for (auto o = open_newest(report); o; o = open_newest(report, o->path)) {
    try {
      restore(*o, trainer);
    } catch (const detail::DamagedArchive& e) {
      report << "trainkit: skipping checkpoint '" << o->path << "': " << detail::first_line_of(e) << "; trying the previous one\n";
      continue;
    }
    return Loaded{o->path, std::move(o->state)};
  }
  return std::nullopt;
}

TRAINKIT_INLINE bool CheckpointManager::is_complete(const std::string& path, std::string* why) {
  torch::serialize::InputArchive archive;
  std::shared_ptr<detail::ShardSource> shards;
  std::string what = open_checkpoint(archive, path, &shards);
  if (what.empty() && shards) what = shards->verify();
  if (why) *why = what;
  return what.empty();
}

TRAINKIT_INLINE std::string CheckpointManager::open_checkpoint(torch::serialize::InputArchive& archive,
                                                               const std::string& path,
                                                               std::shared_ptr<detail::ShardSource>* shards) {
  try {
    auto set = detail::open_checkpoint_file(archive, path);
    if (shards) *shards = std::move(set);
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

TRAINKIT_INLINE std::string CheckpointManager::first_line(const std::string& s) {
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

TRAINKIT_INLINE bool CheckpointManager::parse_name(const std::string& name, CheckpointFile& f) const {
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

TRAINKIT_INLINE void CheckpointManager::remove_stale_temporaries(std::optional<FitPosition> up_to) const {
  DIR* dir = ::opendir(directory_.c_str());
  if (dir == nullptr) return;
  std::vector<std::string> stale;
  // "<checkpoint>.tmp.<pid>", and a set's files' "<checkpoint>.<member>.tmp.<pid>".
  const std::string head = prefix_ + "-", marker = ".tmp.";
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    const auto at = name.rfind(marker);
    if (name.compare(0, head.size(), head) != 0 || at == std::string::npos || name.find(".ckpt") > at) continue;
    const std::string pid = name.substr(at + marker.size());
    if (pid.empty() || pid.size() > 10 || !std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    if (!process_is_gone(static_cast<pid_t>(std::stoll(pid)))) continue;
    // A set's file: another rank's, perhaps on another machine (whose pids mean nothing here),
    // still writing a later set; only those up to the set just written are done with.
    CheckpointFile f;
    if (const std::string set = set_of(name.substr(0, at)); !set.empty())
      if (!up_to || !parse_name(set, f) || *up_to < f.resume_at()) continue;
    stale.push_back(directory_ + "/" + name);
  }
  ::closedir(dir);
  for (const auto& p : stale) ::unlink(p.c_str());
}

TRAINKIT_INLINE bool CheckpointManager::process_is_gone(pid_t pid) {
  if (pid <= 0) return false;
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

}  // namespace trainkit
