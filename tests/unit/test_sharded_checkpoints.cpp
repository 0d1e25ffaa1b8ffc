// Checkpoints of sharded runs (storage/sharded_slices.hpp's records by pieces; docs/design/
// checkpoints.md): one file or a set, loaded bit for bit at any world size and stage, a set's
// shared directory, a SIGKILL resumed as if never stopped.
#if __has_include(<gloo/algorithm.h>)

#include "../support/helpers.hpp"
#include "../support/dist_driver.hpp"
#include "../support/sharding.hpp"

#include <trainkit/io/weights.hpp>
#include <trainkit/run/plan.hpp>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>

namespace test_sharded_checkpoints {  // this file's names, apart from those of the files it shares a unity batch with

using namespace trainkit_testing::dist_driver;
using namespace trainkit_testing::sharding;

TEST_CASE("a sharded checkpoint resumes at any world size, its state bit for bit") {
  // The run every subcase starts from, made once (doctest enters the test case once per subcase).
  static const testing::TempDir dir;
  const std::vector<std::string> common{"--model", "mlp-ln", "--batch", "4", "--accum", "2", "--precision", "fp16master",
                                        "--bucket-bytes", "256", "--overflow-rank", "0", "--overflow-window", "2"};
  const std::string a = dir / "a.ckpt";
  static const auto saved = [&] {
    run_ranks(2, dir / "a", with(common, {"--steps", "5", "--sharding", "1", "--save", a}));
    return records(a, kState);
  }();
  // Loaded and saved again without a step: the same records, whatever the world size and stage.
  SUBCASE("2 -> 1") {
    run_one(dir / "b", with(common, {"--steps", "5", "--load", a, "--save", dir / "b.ckpt"}));
    CHECK(equal_records(records(dir / "b.ckpt", kState), saved));
  }
  SUBCASE("2 -> 3, stage 2") {
    run_ranks(3, dir / "c", with(common, {"--steps", "5", "--sharding", "2", "--load", a, "--save", dir / "c.ckpt"}));
    CHECK(equal_records(records(dir / "c.ckpt", kState), saved));
  }
  SUBCASE("1 -> 2") { one_process_to(dir, common, 2, "1"); }
  SUBCASE("the loss scale and the skip counter come along") {
    const auto s = summary(dir / "a", 0);
    CHECK(s["skipped"] == 1);
    run_ranks(3, dir / "f", with(common, {"--steps", "5", "--sharding", "1", "--load", a}));
    CHECK(summary(dir / "f", 2)["skipped"] == 1);
    CHECK(summary(dir / "f", 2)["scale"] == s["scale"]);
  }
  SUBCASE("resumed at the same world size, training goes on as if it never stopped") {
    for (const char* stage : {"1", "2"}) {
      CAPTURE(stage);
      const std::string ckpt = dir / (std::string("mid") + stage + ".ckpt");
      run_ranks(2, dir / "straight", with(common, {"--steps", "8", "--sharding", stage}));
      run_ranks(2, dir / "first", with(common, {"--steps", "4", "--sharding", stage, "--save", ckpt}));
      run_ranks(2, dir / "resumed", with(common, {"--steps", "8", "--sharding", stage, "--load", ckpt}));
      for (int r = 0; r < 2; ++r) CHECK(torch::equal(params(dir / "resumed", r), params(dir / "straight", r)));
    }
  }
}

TEST_CASE("a checkpoint set: each rank writes its own slices, and any world size and stage loads it bit for bit") {
  static const testing::TempDir dir;  // (the run every subcase loads, made once: below)
  const std::vector<std::string> common{"--model", "mlp-ln", "--batch", "4", "--accum", "2", "--precision", "fp16master",
                                        "--bucket-bytes", "256", "--overflow-rank", "0", "--overflow-window", "2"};
  const std::string single = dir / "a.ckpt", set = dir / "set/set-0000.ckpt";
  static const auto saved = [&] {
    run_ranks(2, dir / "a", with(common, {"--steps", "5", "--sharding", "2", "--save", single, "--save-set", dir / "set"}));
    return records(single, kState);
  }();
  // The same records as the file gathered on rank 0; rank 1's file holds its share of them.
  CHECK(equal_records(records(set, kState), saved));
  const auto size = [](const std::string& p) { return static_cast<double>(testing::read_text(p).size()); };
  const double rank0 = size(set + ".00000-of-00002.safetensors"), rank1 = size(set + ".00001-of-00002.safetensors");
  CHECK(rank1 > 0.3 * (rank0 + rank1));
  CHECK(rank1 < 0.7 * (rank0 + rank1));
  CHECK(testing::file_exists(set + ".records"));
  for (const auto& [world, stage] : std::vector<std::pair<int, std::string>>{{1, "0"}, {2, "0"}, {3, "1"}, {4, "2"}}) {
    SUBCASE(("loaded by " + std::to_string(world) + " rank(s), stage " + stage).c_str()) {
      reloads_to(dir, common, world, stage, set, saved);
    }
  }
  SUBCASE("a damaged piece that one rank alone reads: every rank's load fails, none waits") {
    damaged_piece_fails_alike(dir, common, set, "2");
  }
  SUBCASE("a flipped byte in a rank's file, or in the index, is refused, naming the file") {
    for (const std::string& damaged : {set + ".00001-of-00002.safetensors", set}) {
      CAPTURE(damaged);
      const std::string bytes = testing::read_text(damaged);
      {
        std::string flipped = bytes;
        const auto at = damaged == set ? flipped.find("\"offset\"") + 10 : flipped.size() - 3;
        flipped[at] = static_cast<char>(flipped[at] ^ 0x01);
        std::ofstream(damaged, std::ios::binary | std::ios::trunc) << flipped;
      }
      auto c = spawn(driver_args(dir / "bad", with(common, {"--steps", "5", "--load", set})), {}, dir / "bad.log");
      CHECK(wait_exit(c, 120) != 0);
      const std::string err = slurp(c.err);
      INFO(err);
      CHECK(err.find("checkpoint '" + damaged + "' is damaged") != std::string::npos);
      std::ofstream(damaged, std::ios::binary | std::ios::trunc) << bytes;
    }
  }
}

TEST_CASE("stage 3 checkpoints: a file and a set with the same records, loaded bit for bit at any world size and "
          "stage, and a resume that goes on as if never stopped") {
  static const testing::TempDir dir;  // (the run every subcase loads, made once: below)
  const std::vector<std::string> common{"--model", "mlp-ln", "--batch", "4", "--accum", "2", "--precision", "fp16",
                                        "--overflow-rank", "0", "--overflow-window", "2"};
  const std::string single = dir / "a.ckpt", set = dir / "set/set-0000.ckpt";
  static const auto saved = [&] {
    run_ranks(2, dir / "a", with(common, {"--steps", "5", "--sharding", "3", "--save", single, "--save-set", dir / "set"}));
    return records(single, kState);
  }();
  CHECK(summary(dir / "a", 0)["skipped"] == 1);
  CHECK(equal_records(records(set, kState), saved));
  for (const auto& [world, stage] :
       std::vector<std::pair<int, std::string>>{{1, "0"}, {2, "0"}, {2, "2"}, {3, "3"}, {4, "3"}}) {
    SUBCASE(("loaded by " + std::to_string(world) + " rank(s), stage " + stage).c_str()) {
      for (const auto& from : {single, set}) {
        CAPTURE(from);
        reloads_to(dir, common, world, stage, from, saved);
      }
    }
  }
  SUBCASE("a damaged piece that one rank alone reads: every rank's load fails alike, before the root unit's gather") {
    damaged_piece_fails_alike(dir, common, set, "3");
  }
  SUBCASE("stage 0 -> stage 3") { one_process_to(dir, common, 3, "3"); }
  SUBCASE("a load while every unit is held gathered is refused on every rank (the held copies would be stale)") {
    run_ranks(2, dir / "held", with(common, {"--steps", "5", "--sharding", "3", "--save", dir / "held.ckpt",
                                             "--load-held", "1"}));
    for (int r = 0; r < 2; ++r) {
      const std::string said = slurp(dir / ("held.log" + std::to_string(r) + ".out"));
      CAPTURE(said);
      CHECK(said.find("load while held: load('" + (dir / "held.ckpt") + "'): every unit is held gathered") !=
            std::string::npos);
    }
  }
  SUBCASE("resumed at the same world size, training goes on as if it never stopped") {
    const std::string mid = dir / "mid.ckpt", straight = dir / "straight.ckpt", resumed = dir / "resumed.ckpt";
    run_ranks(2, dir / "straight", with(common, {"--steps", "8", "--sharding", "3", "--save", straight}));
    run_ranks(2, dir / "first", with(common, {"--steps", "4", "--sharding", "3", "--save", mid}));
    run_ranks(2, dir / "resumed", with(common, {"--steps", "8", "--sharding", "3", "--load", mid, "--save", resumed}));
    CHECK(equal_records(records(resumed, kState), records(straight, kState)));
  }
}

TEST_CASE("a checkpoint set needs one directory that every rank shares: ranks naming different ones stop alike, "
          "saying so") {
  testing::TempDir dir;
  // (--fit without --resume: each rank's own OUTPUT_PATH, dir/out/rank<r>)
  auto ranks = spawn_ranks(2, dir / "apart", std::to_string(free_port()),
                           {"--fit", dir / "out", "--steps", "0", "--checkpoint-format", "sharded"});
  for (auto& c : ranks) {
    CHECK(wait_exit(c, 120) == 1);
    CHECK(slurp(c.err).find("the ranks name different output directories") != std::string::npos);
  }
}

TEST_CASE("a checkpoint that one rank fails to write in the background stops every rank at the next agreement, "
          "each saying why") {
  // The file a rank writes in the background of epoch 0's checkpoint cannot take its name (a
  // directory is there). Both ranks learn it at the next agreement (a log window, in epoch 1)
  // and stop alike: the rank that failed with its own error, naming its file, the other saying
  // which checkpoint was not written, not torn down by its peer.
  testing::TempDir dir;
  const std::string out = dir / "out";
  REQUIRE(::mkdir(out.c_str(), 0755) == 0);
  const auto launch = [&](const std::string& stage) {
    auto ranks = spawn_ranks(2, dir / "failed", std::to_string(free_port()),
                             {"--fit", out, "--steps", "0", "--batch", "4", "--accum", "2", "--model", "mlp-ln",
                              "--sharding", stage, "--timeout", "60"});
    for (auto& c : ranks) CHECK(wait_exit(c, 60) == 1);
    return std::vector<std::string>{slurp(ranks[0].err), slurp(ranks[1].err)};
  };
  SUBCASE("a set (stage 2): rank 1's part, while the main rank's writer waits for it to write the index") {
    const std::string set = out + "/model-0000.ckpt";
    REQUIRE(::mkdir((set + ".00001-of-00002.safetensors").c_str(), 0755) == 0);
    const auto err = launch("2");
    CAPTURE(err[0]);
    CAPTURE(err[1]);
    CHECK(err[1].find("error: at epoch 1 (optimizer step ") != std::string::npos);
    CHECK(err[1].find("to '" + set + ".00001-of-00002.safetensors'") != std::string::npos);  // (its file, named)
    CHECK(err[0].find("error: at epoch 1 (optimizer step ") != std::string::npos);
    CHECK(err[0].find("checkpoint '" + set + "' was not written: 1 other rank(s) could not write their part in "
                      "the background") != std::string::npos);
    CHECK(err[0].find("left with an error") == std::string::npos);  // (agreed, not the peer's teardown)
    CHECK_FALSE(testing::file_exists(set));  // (no index: the set is not there)
    CHECK_FALSE(testing::file_exists(out + "/model-0001.ckpt"));
  }
  SUBCASE("one file (stage 0): the main rank's") {
    const std::string file = out + "/rank0/model-0000.ckpt";  // (the driver's rank 0 writes into out/rank0)
    REQUIRE(::mkdir((out + "/rank0").c_str(), 0755) == 0);
    REQUIRE(::mkdir(file.c_str(), 0755) == 0);
    const auto err = launch("0");
    CAPTURE(err[0]);
    CAPTURE(err[1]);
    CHECK(err[0].find("error: at epoch 1 (optimizer step ") != std::string::npos);
    CHECK(err[0].find("to '" + file + "'") != std::string::npos);
    CHECK(err[1].find("error: at epoch 1 (optimizer step ") != std::string::npos);
    CHECK(err[1].find("the main rank could not write its checkpoint in the background") != std::string::npos);
    CHECK(err[1].find("left with an error") == std::string::npos);
  }
}

TEST_CASE("a sharded fit killed with SIGKILL resumes from its last checkpoint as if never stopped") {
  // Stage 3 validates after each epoch, rank r with r + 1 forwards: every unit held gathered for
  // the validation (--validate 1), or with master weights unit by unit (--validate 2, the rank
  // done first joining the other).
  const auto run = [](bool stage3, const std::string& precision) {
  testing::TempDir dir;
  const std::vector<std::string> fit{"--steps", "0", "--batch", "4", "--accum", "2", "--bucket-bytes", "256",
                                     "--model", "mlp-ln", "--precision", precision,
                                     "--sharding", stage3 ? "3" : "2",
                                     "--validate", !stage3 ? "0" : precision == "fp16master" ? "2" : "1"};
  auto with_fit = [&](const std::string& out, std::vector<std::string> extra) {
    extra.insert(extra.begin(), {"--fit", dir / out});
    extra.insert(extra.end(), fit.begin(), fit.end());
    return extra;
  };
  run_ranks(2, dir / "straight", with_fit("straight-out", {}));
  // Stage 3 in FP16 without master weights says at start what autocast's half copies will hold.
  const std::string said = slurp(dir / "straight.log0.err");
  CAPTURE(said);
  CHECK((said.find("more for autocast's half copies of every unit's weights") != std::string::npos) ==
        (stage3 && precision == "fp16"));
  // Slowed down, killed in epoch 1 once epoch 0's checkpoint is there; then run again.
  auto ranks = spawn_ranks(2, dir / "killed", std::to_string(free_port()),
                           with_fit("killed-out", {"--sleep-ms", "40", "--resume", "1"}));
  const std::string first = dir / "killed-out/model-0000.ckpt";
  const auto start = std::chrono::steady_clock::now();
  while (!testing::file_exists(first) && std::chrono::steady_clock::now() - start < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(testing::file_exists(first));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // into epoch 1
  for (auto& c : ranks) ::kill(c.pid, SIGKILL);
  for (auto& c : ranks) wait_exit(c, 30);
  CHECK_FALSE(testing::file_exists(dir / "killed-out/model-0001.ckpt"));
  run_ranks(2, dir / "resumed", with_fit("killed-out", {"--resume", "1"}));
  CHECK(slurp(dir / "resumed.log0.out").find("fit wrote 1 checkpoints") != std::string::npos);
  // Checkpoint sets (stage 2): every file of one belongs to a set whose index is in place (the
  // killed run's half-written set of epoch 1, if any, was written again or removed).
  int members = 0;
  DIR* out = ::opendir((dir / "killed-out").c_str());
  REQUIRE(out != nullptr);
  while (const dirent* e = ::readdir(out)) {
    const std::string name = e->d_name;
    const auto at = name.find(".ckpt.");
    if (at == std::string::npos) continue;
    CAPTURE(name);
    CHECK(testing::file_exists(dir / ("killed-out/" + name.substr(0, at + 5))));
    ++members;
  }
  ::closedir(out);
  CHECK(members == 6);  // (2 sets: 2 ranks' files and the records each)
  for (int r = 0; r < 2; ++r) CHECK(torch::equal(params(dir / "resumed", r), params(dir / "straight", r)));
  CHECK(equal_records(records(dir / "killed-out/model-0001.ckpt", kState), records(dir / "straight-out/model-0001.ckpt", kState)));
  };
  SUBCASE("stage 2, FP16 master weights") { run(false, "fp16master"); }
  SUBCASE("stage 3, FP16, uneven validation") { run(true, "fp16"); }
  SUBCASE("stage 3, FP16 master weights, uneven validation") { run(true, "fp16master"); }
}

}  // namespace test_sharded_checkpoints

#endif
