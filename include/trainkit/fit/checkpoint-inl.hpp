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
