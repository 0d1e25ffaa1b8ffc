// The fit loop as a process (tests/programs/fit_driver): SIGKILL at random instants never leaves
// a partial checkpoint and every run resumes to the uninterrupted run's final state; SIGTERM
// writes a checkpoint and exits 0 saying how to resume; a second signal exits at once.
#include "../support/helpers.hpp"

#include <trainkit/fit/checkpoint.hpp>

#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace test_fit_process {  // this file's names, apart from those of the files it shares a unity batch with

using testing::TempDir;

namespace {

using Clock = std::chrono::steady_clock;

std::string driver_path() {
  char exe[4096];
  const auto n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  REQUIRE(n > 0);
  std::string path(exe, static_cast<size_t>(n));
  return path.substr(0, path.find_last_of('/')) + "/fit_driver";
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

/// The driver's arguments for a run in `dir`: 12 epochs of 7 micro-batches, a checkpoint after
/// each, two kept.
std::vector<std::string> arguments(const std::string& dir, std::vector<std::string> more = {}) {
  std::vector<std::string> a = {"--model-dir", dir, "--set", "RNG_SEED=3", "--set", "TRAIN.END_EPOCH=12",
                                "--set", "LOG_FREQUENT=1", "--set", "TRAIN.CHECKPOINT_KEEP=2",
                                "--set", "TRAIN.FP16_INIT_SCALE=1024", "--set", "TRAIN.FP16_GROWTH_INTERVAL=3"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

/// Starts the driver with stdout and stderr going to files in `log_dir`.
pid_t start(const std::vector<std::string>& args, const std::string& log_dir) {
  const std::string driver = driver_path();
  const std::string out = log_dir + "/stdout", err = log_dir + "/stderr";
  std::vector<std::string> storage = args;
  storage.insert(storage.begin(), driver);
  std::vector<char*> argv;
  for (auto& s : storage) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, 1);
    ::dup2(e, 2);
    ::execv(driver.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

/// The exit status, or 128 + the signal that ended it.
int wait_for(pid_t pid) {
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

struct Finished {
  int status;
  std::string out, err;
  double seconds;
};
Finished run(const std::vector<std::string>& args, const std::string& log_dir) {
  const auto t0 = Clock::now();
  const int status = wait_for(start(args, log_dir));
  return {status, read_file(log_dir + "/stdout"), read_file(log_dir + "/stderr"),
          std::chrono::duration<double>(Clock::now() - t0).count()};
}

std::string final_hash(const std::string& out) {
  const auto at = out.find("final-hash ");
  return at == std::string::npos ? "" : out.substr(at + 11, 16);
}

/// Files in `dir` (0 when it does not exist).
int count_files(const std::string& dir) {
  int n = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}

/// Waits until the driver's fit() has begun: each run opens a new TensorBoard event file in
/// <dir>/tensorboard when the loop starts (after LibTorch's start-up). Returns -1 then, or the
/// exit status (as wait_for) when the process ended first.
int wait_for_training(pid_t pid, const std::string& dir, int event_files_before) {
  while (count_files(dir + "/tensorboard") <= event_files_before) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return -1;
}

/// Waits up to `seconds` for the process to end: its exit status (as wait_for) and, in `took`,
/// the seconds it took; -1 while it still runs.
int wait_up_to(pid_t pid, double seconds, double& took) {
  const auto t0 = Clock::now();
  while (true) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      took = std::chrono::duration<double>(Clock::now() - t0).count();
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (std::chrono::duration<double>(Clock::now() - t0).count() >= seconds) return -1;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}
/// The uninterrupted run: its final hash, how long it took, and how long its fit() took.
struct Reference {
  Finished run;
  double training_seconds;
};
const Reference& reference() {
  static TempDir dir;
  static TempDir logs;
  static const Reference r = [] {
    const auto t0 = Clock::now();
    const pid_t pid = start(arguments(dir.path), logs.path);
    REQUIRE(wait_for_training(pid, dir.path, 0) == -1);
    const auto t1 = Clock::now();
    const int status = wait_for(pid);
    const auto t2 = Clock::now();
    return Reference{{status, read_file(logs / "stdout"), read_file(logs / "stderr"),
                      std::chrono::duration<double>(t2 - t0).count()},
                     std::chrono::duration<double>(t2 - t1).count()};
  }();
  return r;
}

/// Every file under a checkpoint's final name reads back complete; returns how many there are.
int check_checkpoints(const std::string& dir) {
  tk::CheckpointManager m(dir, "model", 2);
  int n = 0;
  for (const auto& f : m.list()) {
    std::string why;
    CAPTURE(f.path);
    CAPTURE(why);
    CHECK(tk::CheckpointManager::is_complete(f.path, &why));
    ++n;
  }
  return n;
}

bool wait_until_exists(const std::string& path, double seconds) {
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < until) {
    if (testing::file_exists(path)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

}  // namespace

TEST_CASE("SIGKILL at random instants: no partial checkpoint, and every run resumes to the uninterrupted final state") {
  const Reference& ref = reference();
  REQUIRE(ref.run.status == 0);
  const std::string expected = final_hash(ref.run.out);
  REQUIRE(expected.size() == 16);

  std::mt19937 rng(2026);  // fixed: a failure can be replayed
  // An instant inside the training, after start-up (LibTorch's start-up is most of a run here);
  // resumed runs have less left to do, hence half the uninterrupted run's training time.
  // The reference's time is measured once, beside whatever else runs then: a first run that
  // ends before its kill says how long training takes now, and later instants are drawn from
  // that (the shortest seen).
  double training_seconds = ref.training_seconds;
  std::uniform_real_distribution<double> instant(0.0, 0.5);
  // Chains of up to 3 kills in one directory, each run resuming the previous one's checkpoints,
  // then a run to the end; a run that ends before its kill closes its chain. How many runs end
  // first depends on the machine's load (the instants are drawn from the reference run's time,
  // and a resumed run has less left to do; under a parallel build 16 of 36 did): chains go on
  // until the kills are there, up to 80 chains.
  const int wanted_kills = 24;
  int kills = 0, with_checkpoints = 0, finished_before_kill = 0, chains = 0;
  const auto t0 = Clock::now();
  while (kills < wanted_kills && chains < 80) {
    ++chains;
    TempDir dir, logs;
    bool finished = false;
    for (int k = 0; k < 3 && !finished; ++k) {
      const double at = instant(rng) * training_seconds;
      CAPTURE(chains);
      CAPTURE(k);
      CAPTURE(at);
      const pid_t pid = start(arguments(dir.path), logs.path);
      int status = wait_for_training(pid, dir.path, k);
      if (status < 0) {
        double took = 0;
        status = wait_up_to(pid, at, took);
        if (status < 0) {
          ::kill(pid, SIGKILL);
          status = wait_for(pid);
        } else if (k == 0) {
          training_seconds = std::min(training_seconds, took);
        }
      }
      if (status == 128 + SIGKILL) {
        ++kills;
        if (check_checkpoints(dir.path) > 0) ++with_checkpoints;
      } else {
        CHECK(status == 0);
        CHECK(final_hash(read_file(logs / "stdout")) == expected);
        finished = true;
        ++finished_before_kill;
      }
    }
    if (finished) continue;
    const Finished last = run(arguments(dir.path), logs.path);
    CAPTURE(last.err);
    CHECK(last.status == 0);
    CHECK(final_hash(last.out) == expected);
    check_checkpoints(dir.path);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  MESSAGE(kills << " SIGKILLs (" << with_checkpoints << " of them with checkpoints on disk; " << finished_before_kill
                << " runs ended before their kill) in " << chains << " chains, " << seconds
                << " s in all; an uninterrupted run takes " << ref.run.seconds << " s, its fit() "
                << ref.training_seconds << " s (" << training_seconds << " s at the end)");
  CHECK(kills >= wanted_kills);
  CHECK(with_checkpoints >= wanted_kills / 2);  // the kills landed during training, not only at start-up
}

TEST_CASE("SIGTERM from outside: a checkpoint, exit 0 with how to resume; resuming continues exactly") {
  const Finished& ref = reference().run;
  REQUIRE(ref.status == 0);
  TempDir dir, logs;
  const pid_t pid = start(arguments(dir.path, {"--sleep-ms", "10"}), logs.path);
  REQUIRE(wait_until_exists(dir / "model-0001.ckpt", 60));
  std::this_thread::sleep_for(std::chrono::milliseconds(25));  // somewhere inside epoch 2
  ::kill(pid, SIGTERM);
  CHECK(wait_for(pid) == 0);
  const std::string err = read_file(logs / "stderr");
  CAPTURE(err);
  CHECK(err.find("stopped by SIGTERM at epoch") != std::string::npos);
  CHECK(err.find("run the same command again (TRAIN.AUTO_RESUME is on)") != std::string::npos);
  CHECK(final_hash(read_file(logs / "stdout")).empty());
  const auto files = tk::CheckpointManager(dir.path).list();
  REQUIRE(!files.empty());
  CHECK(err.find("checkpoint '" + files.back().path + "' written") != std::string::npos);
  check_checkpoints(dir.path);

  const Finished resumed = run(arguments(dir.path), logs.path);
  CHECK(resumed.status == 0);
  CHECK(final_hash(resumed.out) == final_hash(ref.out));
}

TEST_CASE("SIGTERM at a known micro-batch: the window finishes, the checkpoint is named after it; a second signal exits at once") {
  const Finished& ref = reference().run;
  REQUIRE(ref.status == 0);
  SUBCASE("one signal") {
    TempDir dir, logs;
    const Finished stopped = run(arguments(dir.path, {"--raise", "4:2"}), logs.path);
    CHECK(stopped.status == 0);
    CHECK(testing::file_exists(dir / "model-0004-000004.ckpt"));  // micro-batch 3 closes the window
    CHECK(stopped.err.find("stopped by SIGTERM at epoch 4, micro-batch 4") != std::string::npos);
    const Finished resumed = run(arguments(dir.path), logs.path);
    CHECK(resumed.status == 0);
    CHECK(resumed.err.find("resumed from '" + dir / "model-0004-000004.ckpt' at epoch 4, micro-batch 4") != std::string::npos);
    CHECK(final_hash(resumed.out) == final_hash(ref.out));
  }
  SUBCASE("two signals") {
    TempDir dir, logs;
    const Finished killed = run(arguments(dir.path, {"--raise", "4:2:2"}), logs.path);
    CHECK(killed.status == 128 + SIGTERM);
    CHECK(killed.err.find("second signal: exiting now") != std::string::npos);
    CHECK_FALSE(testing::file_exists(dir / "model-0004-000004.ckpt"));
    CHECK(testing::file_exists(dir / "model-0003.ckpt"));
    const Finished resumed = run(arguments(dir.path), logs.path);
    CHECK(resumed.status == 0);
    CHECK(final_hash(resumed.out) == final_hash(ref.out));
  }
}

TEST_CASE("RESUME without a checkpoint is an error; a damaged newest checkpoint is skipped with a message") {
  const Finished& ref = reference().run;
  REQUIRE(ref.status == 0);
  TempDir dir, logs;
  const Finished none = run(arguments(dir.path, {"--resume"}), logs.path);
  CHECK(none.status == 1);
  CHECK(none.err.find("TRAIN.RESUME: no complete checkpoint") != std::string::npos);

  const Finished stopped = run(arguments(dir.path, {"--raise", "6:0"}), logs.path);
  REQUIRE(stopped.status == 0);
  const std::string newest = dir / "model-0006-000002.ckpt";
  REQUIRE(testing::file_exists(newest));
  REQUIRE(::truncate(newest.c_str(), testing::file_size(newest) / 2) == 0);
  const Finished resumed = run(arguments(dir.path), logs.path);
  CHECK(resumed.status == 0);
  CHECK(resumed.err.find("skipping checkpoint '" + newest + "': truncated") != std::string::npos);
  CHECK(final_hash(resumed.out) == final_hash(ref.out));
}

TEST_CASE("a checkpoint set whose newest piece is damaged: found as it is read, and the run resumes from the previous "
          "one exactly") {
  const Finished& ref = reference().run;
  REQUIRE(ref.status == 0);
  TempDir dir, logs;
  const std::vector<std::string> set{"--set", "TRAIN.CHECKPOINT_FORMAT=sharded"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), set.begin(), set.end());
    return more;
  };
  const Finished stopped = run(arguments(dir.path, with({"--raise", "6:0"})), logs.path);
  REQUIRE(stopped.status == 0);
  const std::string newest = dir / "model-0006-000002.ckpt", piece = newest + ".00000-of-00001.safetensors";
  REQUIRE(tk::detail::ShardSource::is_index(newest));
  std::string bytes = read_file(piece);
  std::uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  bytes[8 + header + 2] = static_cast<char>(bytes[8 + header + 2] ^ 0x01);  // (a parameter's first piece)
  std::ofstream(piece, std::ios::binary | std::ios::trunc) << bytes;
  const Finished resumed = run(arguments(dir.path, with({})), logs.path);
  CAPTURE(resumed.err);
  CHECK(resumed.status == 0);
  CHECK(resumed.err.find("skipping checkpoint '" + newest + "': checkpoint '" + piece + "' is damaged") != std::string::npos);
  CHECK(resumed.err.find("resumed from '" + dir / "model-0005.ckpt'") != std::string::npos);
  CHECK(final_hash(resumed.out) == final_hash(ref.out));
}


namespace {

/// The names in `dir` of checkpoint files being written (`<name>.tmp.<pid>`).
std::vector<std::string> temporaries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d))
      // ("<name>.ckpt.tmp.<pid>", and a set's "<name>.ckpt.<file>.tmp.<pid>")
      if (std::string(e->d_name).find(".ckpt") != std::string::npos && std::string(e->d_name).find(".tmp.") != std::string::npos)
        out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

/// A set's member files ("<name>.ckpt.<file>") under their final names whose index is not there
/// yet: a set being written, each named with its inode and time so that a set written again is
/// told from the one before it.
std::set<std::string> unfinished_sets(const std::string& dir) {
  std::set<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d)) {
      const std::string name = e->d_name;
      const auto at = name.find(".ckpt.");
      if (at == std::string::npos || name.find(".tmp.") != std::string::npos) continue;
      if (tk::detail::ShardSource::is_index(dir + "/" + name.substr(0, at + 5))) continue;
      struct stat st {};
      if (::stat((dir + "/" + name).c_str(), &st) != 0) continue;
      out.insert(name + " " + std::to_string(st.st_ino) + " " + std::to_string(st.st_mtim.tv_sec) + "." +
                 std::to_string(st.st_mtim.tv_nsec));
    }
    ::closedir(d);
  }
  return out;
}

/// Waits until the process, started when `complete` checkpoints were in `dir`, is writing one
/// (a temporary of its own) while a complete one is there: once it completed one of its own
/// when there were none, at once otherwise. False when it ended first.
bool wait_for_second_write(pid_t pid, const std::string& dir, size_t complete, double seconds) {
  const std::string own = ".tmp." + std::to_string(pid);
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  bool wrote = false;
  while (Clock::now() < until) {
    if (::waitpid(pid, nullptr, WNOHANG) == pid) return false;
    if (!wrote) wrote = complete > 0 || !tk::CheckpointManager(dir).list().empty();
    if (wrote)
      for (const auto& t : temporaries(dir))
        if (t.find(own) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return false;
}

}  // namespace

TEST_CASE("SIGKILL while a checkpoint is written in the background, at 10 instants: the previous one stays whole, and the run resumes exactly") {
  // Checkpoints of 22 MB (hidden 150000: 1.8 million parameters and AdamW's two moments), written
  // on the loop's writer thread (TRAIN.CHECKPOINT_BACKGROUND, on by default) while training goes
  // on: epochs of one window (2 micro-batches, ~180 ms here), each longer than a write (~25 ms),
  // so that every run is cheap. Each run is killed while its writer writes a checkpoint (a complete one there), at
  // i / 10 of the writer's time measured in the uninterrupted run (its text log says it), and
  // the next run resumes from the newest complete one. One file, and a set (its file, its
  // records, its index last).
  std::string format;
  SUBCASE("one file") { format = "single"; }
  SUBCASE("a set") { format = "sharded"; }
  CAPTURE(format);
  const std::vector<std::string> big = {"--hidden", "150000", "--batches", "2", "--set", "TRAIN.END_EPOCH=14",
                                        "--set", "TRAIN.CHECKPOINT_FORMAT=" + format};
  TempDir ref_dir, ref_logs;
  const Finished ref = run(arguments(ref_dir.path, big), ref_logs.path);
  REQUIRE(ref.status == 0);
  REQUIRE(final_hash(ref.out).size() == 16);
  std::vector<double> writer_seconds;  // "checkpoint '...' written (20.6 MiB in 0.0163 s, in the background)"
  const std::string ref_log = read_file(ref_dir / "model-log.txt");
  for (auto at = ref_log.find("MiB in "); at != std::string::npos; at = ref_log.find("MiB in ", at + 1))
    writer_seconds.push_back(std::stod(ref_log.substr(at + 7)));
  REQUIRE(writer_seconds.size() >= 10);
  std::sort(writer_seconds.begin(), writer_seconds.end());
  const double write_time = writer_seconds[writer_seconds.size() / 2];

  TempDir dir, logs;
  // (On a busy machine a write can end before a late instant: up to 5 more kills, at the early
  // instants again, until 5 have landed inside a write.)
  int during = 0, kills = 0;
  for (int i = 0; i < 10 || (during < 5 && i < 15); ++i) {
    CAPTURE(i);
    const size_t complete = tk::CheckpointManager(dir.path).list().size();
    const std::set<std::string> unfinished_before = unfinished_sets(dir.path);
    const pid_t pid = start(arguments(dir.path, big), logs.path);
    const bool writing = wait_for_second_write(pid, dir.path, complete, 120);
    if (!writing) {  // (it ended first: the run is complete)
      CHECK(wait_for(pid) == 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(write_time * (i % 10) / 10));
    ::kill(pid, SIGKILL);
    ++kills;
    REQUIRE(wait_for(pid) == 128 + SIGKILL);
    // Killed inside the write: a temporary of its own is there, or (a set) a file of a set
    // whose index it had not written yet (between a set's files, no temporary is open).
    bool inside = false;
    for (const auto& t : temporaries(dir.path)) inside = inside || t.find(".tmp." + std::to_string(pid)) != std::string::npos;
    for (const auto& u : unfinished_sets(dir.path)) inside = inside || unfinished_before.count(u) == 0;
    during += inside;
    CHECK(check_checkpoints(dir.path) >= 1);  // every file under a final name complete, one at least
  }
  MESSAGE(during << " of " << kills << " SIGKILLs landed inside a background write (the writer's median time "
                 << write_time * 1e3 << " ms)");
  CHECK(during >= 5);
  const Finished last = run(arguments(dir.path, big), logs.path);
  CAPTURE(last.err);
  CHECK(last.status == 0);
  CHECK(final_hash(last.out) == final_hash(ref.out));
  check_checkpoints(dir.path);
  CHECK(temporaries(dir.path).empty());  // the killed runs' temporaries removed by the retention
  // A set's files all belong to a set whose index is there (a killed run's half-written set was
  // written again, or removed).
  if (DIR* d = ::opendir(dir.path.c_str())) {
    int members = 0;
    while (auto* e = ::readdir(d)) {
      const std::string name = e->d_name;
      const auto at = name.find(".ckpt.");
      if (at == std::string::npos) continue;
      CAPTURE(name);
      CHECK(tk::detail::ShardSource::is_index(dir / name.substr(0, at + 5)));
      ++members;
    }
    ::closedir(d);
    // (a file and the records for each set kept)
    CHECK(members == (format == "sharded" ? 2 * static_cast<int>(tk::CheckpointManager(dir.path).list().size()) : 0));
  }
}

}  // namespace test_fit_process
