// Data parallel over c10d/Gloo, two processes on loopback: the test launches the worker
// tests/dist/driver.cpp (trainkit_dist_driver, next to this binary) as separate processes, so
// that no LibTorch thread pool is ever forked.
#if __has_include(<gloo/algorithm.h>)

#include "../support/helpers.hpp"
#include "../support/dist_driver.hpp"

#include <trainkit/parallel/heartbeat.hpp>

#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <array>
#include <chrono>
#include <thread>
#include <sstream>
#include <fstream>
#include <filesystem>
#include <future>
#include <map>
#include <string>
#include <vector>

#include <signal.h>

namespace test_distributed {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

using namespace trainkit_testing::dist_driver;

// Two ranks on loopback (rank 0 hosts the store), launched by the harness.
std::vector<Child> spawn_two(const std::string& out, const std::string& port, const std::vector<std::string>& extra) {
  return spawn_ranks(2, out, port, extra);
}

// Two ranks training for good (slowed down), returned once rank 0 has closed window 3.
std::vector<Child> start_two_training(const std::string& out, const std::string& port, std::vector<std::string> extra) {
  extra.insert(extra.begin(), {"--steps", "100000", "--batch", "4", "--sleep-ms", "5"});
  std::vector<Child> ranks = spawn_two(out, port, extra);
  const auto start = std::chrono::steady_clock::now();
  while (slurp(ranks[0].out).find("window 3\n") == std::string::npos &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  REQUIRE(slurp(ranks[0].out).find("window 3\n") != std::string::npos);
  return ranks;
}

void run_two(const std::string& out, const std::vector<std::string>& extra, double seconds = 120) {
  run_ranks(2, out, extra, seconds);
}

}  // namespace

TEST_CASE("data parallel: 2 ranks with micro-batch B equal 1 process with 2B") {
  testing::TempDir dir;
  struct Case {
    const char* name;
    std::vector<std::string> args;
    double tolerance = 1e-5;
  };
  // 64 samples; 2 ranks x 4 = 1 x 8 per micro-batch, 8 micro-batches per epoch.
  const std::vector<Case> cases = {
      {"FP32, N = 1", {"--accum", "1", "--steps", "12"}},
      {"FP32, N = 4", {"--accum", "4", "--steps", "6"}},
      // Sample i weighs 1 + i % 3 items: the ranks' windows hold different counts, and the
      // average is over all items of both (not the mean of the two ranks' means).
      {"FP32, N = 4, item counts that differ between ranks", {"--accum", "4", "--steps", "6", "--items", "1"}},
      // Elementwise model: nothing runs in fp16, so the comparison is as tight as FP32's.
      {"FP16Dynamic, N = 4, overflow on rank 1 in window 2",
       {"--accum", "4", "--steps", "6", "--precision", "fp16", "--overflow-window", "2", "--model", "affine"}},
      // The MLP's matmuls run in fp16 (autocast): a sum over 4 rows in fp16 is not the same
      // number as over 8, so batch 4 + 4 and batch 8 differ by fp16 rounding (5e-5 seen).
      {"FP16Dynamic MLP, N = 4, overflow on rank 1 in window 2",
       {"--accum", "4", "--steps", "6", "--precision", "fp16", "--overflow-window", "2"}, 1e-3},
  };
  for (const auto& c : cases) {
    SUBCASE(c.name) {
      const bool overflow = std::string(c.name).find("overflow") != std::string::npos;
      auto two = c.args, one = c.args;
      two.insert(two.end(), {"--batch", "4"});
      one.insert(one.end(), {"--batch", "8"});
      if (overflow) {
        two.insert(two.end(), {"--overflow-rank", "1"});
        one.insert(one.end(), {"--overflow-rank", "0"});
      }
      run_two(dir / "two", two);
      run_one(dir / "one", one);
      const auto p0 = params(dir / "two", 0), p1 = params(dir / "two", 1), ref = params(dir / "one", 0);
      // The ranks hold the same parameters, bit for bit (same reduced gradient, same update),
      // and they are the big-batch run's.
      CHECK(torch::equal(p0, p1));
      CHECK(max_relative(p0, ref) <= c.tolerance);
      const auto s0 = summary(dir / "two", 0), s1 = summary(dir / "two", 1), s = summary(dir / "one", 0);
      CHECK(s0["world"] == 2);
      CHECK(s["world"] == 1);
      CHECK(s0["applied"] == s["applied"]);
      CHECK(s1["applied"] == s["applied"]);
      CHECK(s0["mean_loss"] == s1["mean_loss"]);  // averaged over ranks: the same number on both
      if (overflow) {
        // Both ranks skipped window 2 (only rank 1 overflowed) and backed off the scale.
        CHECK(s0["skipped"] == 1);
        CHECK(s1["skipped"] == 1);
        CHECK(s0["scale"] == 32768.0);
        CHECK(s1["scale"] == 32768.0);
        CHECK(s["scale"] == 32768.0);
      } else {
        CHECK(s0["skipped"] == 0);
      }
    }
  }
}

TEST_CASE("data parallel with master weights: FP16 all-reduces the half gradient (half the bytes), BF16 fp32") {
  testing::TempDir dir;
  // Item counts that differ between the ranks (each rank's part weighted by items / total
  // before the half sum), an inf loss on rank 1 in window 2, and a LayerNorm kept in fp32
  // (its gradient travels in the half buffer's unused slices).
  const std::vector<std::string> common{"--model", "mlp-ln", "--accum", "1", "--steps", "12", "--batch", "4",
                                        "--items", "1", "--overflow-rank", "1", "--overflow-window", "2"};
  // The four runs in one launch (the driver's --then).
  Runs runs;
  for (const auto& [name, precision, reduce] : std::vector<std::array<const char*, 3>>{
           {"half", "fp16master", "half"}, {"fp32", "fp16master", "fp32"}, {"auto", "fp16master", "auto"},
           {"bf16", "bf16master", "auto"}}) {
    auto a = common;
    a.insert(a.end(), {"--precision", precision, "--reduce", reduce});
    runs.push_back({dir / name, a});
  }
  run_chain(2, runs);
  auto run = [&](const std::string& name) {
    CHECK(torch::equal(params(dir / name, 0), params(dir / name, 1)));  // the ranks agree, bit for bit
    return summary(dir / name, 0);
  };
  const auto half = run("half"), fp32 = run("fp32"), automatic = run("auto"), bf16 = run("bf16");
  const std::int64_t numel = half["numel"], windows = 12;
  // Per window: the gradient (2 or 4 bytes per element) and the item count (4 bytes).
  CHECK(half["allreduce_bytes"] == windows * (numel * 2 + 4));
  CHECK(fp32["allreduce_bytes"] == windows * (numel * 4 + 4));
  CHECK(automatic["allreduce_bytes"] == half["allreduce_bytes"]);
  CHECK(torch::equal(params(dir / "auto", 0), params(dir / "half", 0)));
  CHECK(bf16["allreduce_bytes"] == windows * (numel * 4 + 4));
  for (const auto* s : {&half, &fp32, &automatic, &bf16}) {
    CHECK((*s)["skipped"] == 1);  // window 2, on both ranks
    CHECK((*s)["applied"] == 11);
  }
  // The half sum rounds where the fp32 one does not: the parameters differ by fp16 rounding.
  const double diff = max_relative(params(dir / "half", 0), params(dir / "fp32", 0));
  MESSAGE("12 AdamW steps, half vs fp32 all-reduce: max relative parameter difference " << diff);
  CHECK(diff <= 5e-4);  // 3.8e-5 measured
}

TEST_CASE("data parallel: all-reduce calls per optimizer step equal the buckets, for any N") {
  testing::TempDir dir;
  // 212 parameters in a flat storage of 224 elements (each parameter starts 64-byte aligned):
  // 896 bytes in 256-byte buckets, 4 buckets.
  const auto out_of = [&](const std::string& n) { return dir / ("n" + n); };
  run_chain(2, {{out_of("1"), {"--accum", "1", "--steps", "4", "--bucket-bytes", "256"}},
                {out_of("4"), {"--accum", "4", "--steps", "4", "--bucket-bytes", "256"}}});  // (one launch)
  for (const char* n : {"1", "4"}) {
    CAPTURE(n);
    const std::string out = out_of(n);
    for (int r = 0; r < 2; ++r) {
      const auto s = summary(out, r);
      CHECK(s["numel"] == 224);
      CHECK(s["buckets"] == 4);
      CHECK(s["windows"] == 4);
      // Only the gradient buckets were all-reduced during training, once per window.
      CHECK(s["allreduce_calls"].get<int>() == 4 * 4);
    }
  }
}

TEST_CASE("data parallel: resume on every rank from the same checkpoint equals never stopping") {
  static const testing::TempDir dir;  // (the runs before the subcase, made once: doctest enters once per subcase)
  const std::vector<std::string> common{"--accum", "2", "--batch", "4", "--precision", "fp16"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), common.begin(), common.end());
    return more;
  };
  // Straight through, the first half saving, and the resumed second half: one launch.
  static const bool ran = (run_chain(2, {{dir / "straight", with({"--steps", "8"})},
                                         {dir / "first", with({"--steps", "4", "--save", dir / "ckpt.pt"})},
                                         {dir / "resumed", with({"--steps", "8", "--load", dir / "ckpt.pt"})}}),
                           true);
  REQUIRE(ran);
  CHECK(testing::file_exists(dir / "ckpt.pt"));
  CHECK(torch::equal(params(dir / "resumed", 0), params(dir / "straight", 0)));
  CHECK(torch::equal(params(dir / "resumed", 1), params(dir / "straight", 1)));

  SUBCASE("ranks that load different checkpoints are stopped") {
    run_two(dir / "other", with({"--steps", "2", "--save", dir / "other.pt"}));
    const std::string port = std::to_string(free_port());
    std::vector<Child> ranks;
    for (int r = 0; r < 2; ++r)
      ranks.push_back(spawn(driver_args(dir / "mixed", with({"--steps", "8", "--load", dir / "ckpt.pt",
                                                             "--load-rank1", dir / "other.pt"})),
                            {{"RANK", std::to_string(r)}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                             {"MASTER_PORT", port}},
                            dir / ("mixed.log" + std::to_string(r))));
    for (auto& c : ranks) {
      CHECK(wait_exit(c, 120) == 1);
      CHECK(slurp(c.err).find("the ranks loaded different training states") != std::string::npos);
    }
  }
}

TEST_CASE("data parallel: a stop agreed between log windows resumes to the uninterrupted run") {
  // LOG_FREQUENT 1000: the ranks' one agreement between log windows here is the run's second
  // window (fit/agreements.hpp). Rank 1 alone asks to stop after window 1; both stop at window 2,
  // and the checkpoint holds the running sums they agreed there. Resumed, epoch 0's means and the
  // final weights are the straight run's.
  testing::TempDir dir;
  auto with = [&](std::vector<std::string> more) {
    for (const char* s : {"--samples", "64", "--batch", "4", "--accum", "2", "--log-frequent", "1000", "--steps", "0",
                          "--resume", "1"})
      more.push_back(s);
    return more;
  };
  run_two(dir / "straight", with({"--fit", dir / "straight-out"}));
  run_two(dir / "stopped", with({"--fit", dir / "out", "--stop-rank", "1", "--stop-window", "1"}));
  for (int r = 0; r < 2; ++r) {
    const std::string said = slurp(dir / ("stopped.log" + std::to_string(r) + ".out"));
    CAPTURE(said);
    CHECK(said.find("fit stopped at epoch 0, micro-batch 4") != std::string::npos);  // (window 2's end)
    CHECK(said.find("fit epoch 0") == std::string::npos);
  }
  run_two(dir / "resumed", with({"--fit", dir / "out"}));
  auto epoch_loss = [&](const std::string& name, int r, int epoch) {
    const std::string said = slurp(dir / (name + ".log" + std::to_string(r) + ".out"));
    const std::string key = "fit epoch " + std::to_string(epoch) + " train Loss ";
    const auto at = said.find(key);
    REQUIRE(at != std::string::npos);
    return std::stod(said.substr(at + key.size()));
  };
  for (int r = 0; r < 2; ++r)
    for (int epoch = 0; epoch < 2; ++epoch) {
      CAPTURE(r);
      CAPTURE(epoch);
      // (the same sums, added in another order: the agreed ones first)
      CHECK(epoch_loss("resumed", r, epoch) == doctest::Approx(epoch_loss("straight", r, epoch)).epsilon(1e-12));
    }
  CHECK(torch::equal(params(dir / "resumed", 0), params(dir / "straight", 0)));
  CHECK(torch::equal(params(dir / "resumed", 1), params(dir / "straight", 1)));
}

TEST_CASE("data parallel: tk::fit writes checkpoints and logs on rank 0 only") {
  testing::TempDir dir;
  run_two(dir / "fit", {"--fit", dir / "out", "--steps", "0", "--batch", "4", "--accum", "2"});
  CHECK(testing::file_exists(dir / "out/rank0/model-0000.ckpt"));
  CHECK(testing::file_exists(dir / "out/rank0/model-0001.ckpt"));
  CHECK_FALSE(testing::file_exists(dir / "out/rank1"));  // nothing at all from rank 1
  CHECK(slurp(dir / "fit.log0.out").find("fit wrote 2 checkpoints") != std::string::npos);
  CHECK(slurp(dir / "fit.log1.out").find("fit wrote 0 checkpoints") != std::string::npos);
  CHECK(torch::equal(params(dir / "fit", 0), params(dir / "fit", 1)));
  // The same with FitOptions::write_files(false) on rank 1: it writes nothing and still takes
  // part in every agreement (a background write's, at each checkpoint and at the end).
  run_two(dir / "quiet", {"--fit", dir / "quiet-out", "--steps", "0", "--batch", "4", "--accum", "2", "--main-writes", "1"});
  CHECK(testing::file_exists(dir / "quiet-out/rank0/model-0001.ckpt"));
  CHECK_FALSE(testing::file_exists(dir / "quiet-out/rank1"));
  CHECK(torch::equal(params(dir / "quiet", 1), params(dir / "fit", 1)));
}

TEST_CASE("data parallel: a rank that runs out of memory replays its window alone, and the ranks stay equal") {
  testing::TempDir dir;
  const std::vector<std::string> fit{"--steps", "0", "--batch", "4", "--accum", "2"};
  auto with = [&](const std::string& out, std::vector<std::string> extra) {
    extra.insert(extra.begin(), {"--fit", dir / out});
    extra.insert(extra.end(), fit.begin(), fit.end());
    return extra;
  };
  run_two(dir / "straight", with("straight-out", {}));
  run_two(dir / "oom", with("oom-out", {"--oom-rank", "1"}));
  CHECK(slurp(dir / "oom.log1.out").find("replayed 1 window(s)") != std::string::npos);
  CHECK(slurp(dir / "oom.log0.out").find("replayed 0 window(s)") != std::string::npos);
  CHECK(torch::equal(params(dir / "oom", 0), params(dir / "oom", 1)));  // one all-reduce per window still
  CHECK(testing::relative_error(params(dir / "oom", 0), params(dir / "straight", 0)) < 1e-5);
}

// A real out-of-memory error: LibTorch's CPU allocator failing under an address-space cap
// (RLIMIT_AS) in the driver (--cap-rank, --cap), not a thrown error. The cap leaves a fraction of
// what one micro-batch needs, so the allocation fails at another point of the forward or
// backward for each fraction, after other dropout masks were drawn. The replayed window starts
// from the window's generators and sums, so every run ends equal.
TEST_CASE("out of memory for real (RLIMIT_AS): a replayed window is the same wherever the allocation failed") {
  testing::TempDir dir;
  auto with = [&](const std::string& out, const std::vector<std::string>& cap) {
    std::vector<std::string> a{"--fit", dir / out, "--steps", "0", "--model", "wide", "--width", "512", "--dropout", "0.3",
                               "--batch", "1024", "--accum", "1", "--overlap", "0"};
    a.insert(a.end(), cap.begin(), cap.end());
    return a;
  };
  SUBCASE("one process") {
    std::vector<torch::Tensor> ends;
    for (const char* fraction : {"0.55", "0.7", "0.85"}) {
      CAPTURE(fraction);
      const std::string out = dir / (std::string("one-") + fraction);
      std::vector<std::string> a = with(out + "-fit", {"--cap-rank", "0", "--cap", fraction});
      a.insert(a.end(), {"--samples", "8192"});
      run_one(out, a);
      const std::string log = slurp(out + ".log.out");
      CHECK(log.find("address space capped") != std::string::npos);
      CHECK(log.find("replayed 1 window(s)") != std::string::npos);
      CHECK(slurp(out + ".log.err").find("can't allocate memory") != std::string::npos);  // LibTorch's own error
      ends.push_back(params(out, 0));
    }
    CHECK(torch::equal(ends[0], ends[1]));
    CHECK(torch::equal(ends[0], ends[2]));
  }
  SUBCASE("two Gloo ranks, rank 1 capped") {
    std::vector<torch::Tensor> ends;
    for (const char* fraction : {"0.55", "0.85"}) {
      CAPTURE(fraction);
      const std::string out = dir / (std::string("two-") + fraction);
      std::vector<std::string> a = with(out + "-fit", {"--cap-rank", "1", "--cap", fraction});
      a.insert(a.end(), {"--samples", "16384"});
      run_two(out, a, 240);
      CHECK(slurp(out + ".log1.out").find("replayed 1 window(s)") != std::string::npos);
      CHECK(slurp(out + ".log0.out").find("replayed 0 window(s)") != std::string::npos);
      CHECK(torch::equal(params(out, 0), params(out, 1)));
      ends.push_back(params(out, 0));
    }
    CHECK(torch::equal(ends[0], ends[1]));
  }
}

TEST_CASE("data parallel: torchrun --no-python trains like the harness' launch") {
  const std::string launcher = torchrun();
  if (!testing::file_exists(launcher)) {
    MESSAGE("skipped: no torchrun at '" << launcher << "' (set TRAINKIT_TORCHRUN)");
    return;
  }
  testing::TempDir dir;
  const std::vector<std::string> extra{"--accum", "2", "--steps", "6", "--batch", "4"};
  std::vector<std::string> argv{launcher, "--no-python", "--nproc-per-node", "2", "--master-addr",
                                "127.0.0.1", "--master-port", std::to_string(free_port())};
  const auto worker = driver_args(dir / "torchrun", extra);
  argv.insert(argv.end(), worker.begin(), worker.end());
  auto c = spawn(argv, {}, dir / "torchrun.log");
  expect_success(c, wait_exit(c, 180));
  run_two(dir / "harness", extra);
  for (int r = 0; r < 2; ++r) {
    CHECK(summary(dir / "torchrun", r)["launcher"] == "torchrun");
    CHECK(torch::equal(params(dir / "torchrun", r), params(dir / "harness", r)));
  }
}

namespace {
// The processes whose parent is `pid` (Linux: /proc/<p>/stat's fourth field).
std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream f(e.path() / "stat");
    std::string stat;
    std::getline(f, stat);
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    pid_t parent = 0;
    rest >> state >> parent;
    if (parent == pid) out.push_back(static_cast<pid_t>(std::stol(name)));
  }
  return out;
}
// Whether `pid` still runs (a zombie that nobody reaps has ended).
bool running(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(f, stat)) return false;
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z' && stat[close + 2] != 'X';
}
}  // namespace

TEST_CASE("data parallel: workers whose torchrun agent is killed stop within 30 s, writing a checkpoint") {
  // The agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); its SIGKILL leaves the workers
  // and their own Gloo connections alive. Their heartbeat finds the store gone, and tk::fit
  // stops at the ranks' next agreement (about every 10 s between log windows: LOG_FREQUENT is
  // 10000 here, far past the run), writing a checkpoint, as for SIGTERM.
  const std::string launcher = torchrun();
  if (!testing::file_exists(launcher)) {
    MESSAGE("skipped: no torchrun at '" << launcher << "' (set TRAINKIT_TORCHRUN)");
    return;
  }
  testing::TempDir dir;
  std::vector<std::string> argv{launcher, "--no-python", "--nproc-per-node", "2", "--master-addr",
                                "127.0.0.1", "--master-port", std::to_string(free_port())};
  const auto worker = driver_args(dir / "orphans", {"--fit", dir / "orphans-out", "--samples", "8000", "--batch", "4",
                                                    "--sleep-ms", "50", "--log-frequent", "10000", "--heartbeat", "2",
                                                    "--steps", "0"});
  argv.insert(argv.end(), worker.begin(), worker.end());
  auto agent = spawn(argv, {}, dir / "agent.log");
  std::vector<pid_t> workers;
  for (int i = 0; i < 600 && workers.size() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    workers = children_of(agent.pid);
  }
  REQUIRE(workers.size() == 2);
  std::this_thread::sleep_for(std::chrono::seconds(4));  // (joined and training)
  ::kill(agent.pid, SIGKILL);
  wait_exit(agent, 10);
  const auto t0 = std::chrono::steady_clock::now();
  while ((running(workers[0]) || running(workers[1])) && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const pid_t w : workers)
    if (running(w)) ::kill(w, SIGKILL);
  const std::string said = slurp(agent.err) + slurp(agent.out);
  INFO(said);
  MESSAGE("the workers stopped " << took << " s after their agent's SIGKILL");
  CHECK(took < 30);
  CHECK(said.find("the store does not answer the heartbeat") != std::string::npos);
  CHECK(said.find("the launcher is gone, the ranks are not") != std::string::npos);
  CHECK(said.find("trainkit: stopped because the group's store is gone") != std::string::npos);
  CHECK(said.find("fit wrote 1 checkpoints") != std::string::npos);
  bool checkpoint = false;
  for (const auto& e : std::filesystem::directory_iterator(dir / "orphans-out/rank0"))
    checkpoint |= e.path().extension() == ".ckpt";
  CHECK(checkpoint);
}

TEST_CASE("data parallel: a rank that dies or hangs stops the other within the timeout") {
  testing::TempDir dir;
  for (const int signal : {SIGKILL, SIGSTOP}) {
    CAPTURE(signal);
    const double timeout = 4;
    const std::string port = std::to_string(free_port());
    const std::string out = dir / (signal == SIGKILL ? "killed" : "stopped");
    std::vector<Child> ranks = start_two_training(out, port, {"--timeout", std::to_string(timeout)});
    // They train; now take rank 1 away.
    ::kill(ranks[1].pid, signal);
    const auto t0 = std::chrono::steady_clock::now();
    const int status = wait_exit(ranks[0], timeout + 10);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string err = slurp(ranks[0].err);
    INFO("rank 0's stderr: " << err);
    CHECK(status == 1);          // an error, not a hang (-1) or a crash
    // Killed: the connection resets at once; stopped: Gloo's timeout passes first.
    CHECK(took < (signal == SIGKILL ? timeout : timeout + 4));
    CHECK(err.find("rank 0 of 2") != std::string::npos);
    CHECK(err.find("rank 1 does not answer") != std::string::npos);
    ::kill(ranks[1].pid, SIGKILL);
    wait_exit(ranks[1], 10);
  }
}

TEST_CASE("data parallel: the heartbeat names a hung rank within seconds, long before the timeout") {
  // Gloo waits out the timeout for a hung peer (12 s here); the heartbeat (1.5 s) says which
  // rank it is at once. (With NCCL it also aborts the communicator: that path needs a GPU.)
  testing::TempDir dir;
  const double timeout = 12, heartbeat = 1.5;
  const std::string port = std::to_string(free_port());
  const std::string out = dir / "hung";
  std::vector<Child> ranks = start_two_training(
      out, port, {"--timeout", std::to_string(timeout), "--heartbeat", std::to_string(heartbeat)});
  ::kill(ranks[1].pid, SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string said = "trainkit: rank 0 of 2: rank 1 sent no heartbeat for 1.5 s: died or hangs";
  while (slurp(ranks[0].err).find(said) == std::string::npos &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO("rank 0's stderr: " << slurp(ranks[0].err));
  CHECK(slurp(ranks[0].err).find(said) != std::string::npos);
  CHECK(took < heartbeat + 3);
  CHECK(wait_exit(ranks[0], timeout + 10) == 1);  // then Gloo's timeout ends it, with an error
  ::kill(ranks[1].pid, SIGKILL);
  wait_exit(ranks[1], 10);
}

TEST_CASE("heartbeat: a rank that leaves with an error stops its peers within a beat, naming it and the error") {
  // NCCL's wait() does not fail when a peer has gone: a rank that leaves through an exception
  // must say so, or its peers wait out NCCL's watchdog (30 minutes). Two ranks' heartbeats
  // over one in-process store, the path ProcessGroup uses (its on_silent aborts NCCL).
  using namespace std::chrono_literals;
  using trainkit::detail::Heartbeat;
  const auto silence = 2000ms;  // a beat every 400 ms
  struct Heard {
    std::mutex mutex;
    std::vector<std::string> messages;
    std::function<void(const std::string&)> callback() {
      return [this](const std::string& m) {
        std::lock_guard<std::mutex> lock(mutex);
        messages.push_back(m);
      };
    }
    std::vector<std::string> wait(std::chrono::milliseconds most) {
      const auto end = std::chrono::steady_clock::now() + most;
      for (;; std::this_thread::sleep_for(10ms)) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!messages.empty() || std::chrono::steady_clock::now() >= end) return messages;
      }
    }
  };
  auto elapsed_ms = [](std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };

  SUBCASE("an exception unwinds rank 1's group") {
    auto store = c10::make_intrusive<c10d::HashStore>();
    Heard heard;
    Heartbeat rank0(store, 0, 2, silence, heard.callback());
    auto t0 = std::chrono::steady_clock::now();
    try {
      Heartbeat rank1(store, 1, 2, silence, [](const std::string&) {});
      std::this_thread::sleep_for(600ms);  // both beat
      t0 = std::chrono::steady_clock::now();
      throw std::runtime_error("the batch at step 7 is empty");
    } catch (const std::runtime_error&) {
    }
    const auto messages = heard.wait(silence);
    const double took = elapsed_ms(t0);
    REQUIRE(messages.size() == 1);
    CHECK(messages[0] == "rank 1 left with an error (an exception unwound its process group)");
    CHECK(took < 1000);  // within a beat (400 ms) and scheduling, not the 2 s of silence
    CHECK(rank0.failure() == messages[0]);
  }
  SUBCASE("leave_with_error sends the reason's first line") {
    auto store = c10::make_intrusive<c10d::HashStore>();
    Heard heard;
    Heartbeat rank1(store, 1, 2, silence, heard.callback());  // the peer, here rank 1
    {
      Heartbeat rank0(store, 0, 2, silence, [](const std::string&) {});
      std::this_thread::sleep_for(600ms);
      const auto t0 = std::chrono::steady_clock::now();
      rank0.leave_with_error("out of memory in the optimizer phase of step 9\nbacktrace ...");
      const auto messages = heard.wait(silence);
      REQUIRE(messages.size() == 1);
      CHECK(messages[0] == "rank 0 left with an error (out of memory in the optimizer phase of step 9)");
      CHECK(elapsed_ms(t0) < 1000);
    }  // said once: the destructor adds nothing (then rank 0, the store's host, waits for rank 1 at most 2 s)
  }
  SUBCASE("a rank that leaves cleanly is not reported, and its peer does not wait for it") {
    auto store = c10::make_intrusive<c10d::HashStore>();
    Heard heard;
    Heartbeat rank0(store, 0, 2, silence, heard.callback());
    { Heartbeat rank1(store, 1, 2, silence, [](const std::string&) {}); std::this_thread::sleep_for(600ms); }
    CHECK(heard.wait(silence + 1000ms).empty());  // longer than the silence: "left" is not silence
    CHECK(rank0.failure().empty());
  }
}

}  // namespace test_distributed

#endif  // Gloo's headers
