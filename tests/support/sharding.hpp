#pragma once
// What the sharded data-parallel tests share (tests/unit/test_sharded_*.cpp, test_unit_gathers.cpp):
// a checkpoint's records read back and compared, the runs the sharded stages are compared with the
// replicated one on, and checkpoints loaded again at another world size and stage.
#include "dist_driver.hpp"
#include "helpers.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace trainkit_testing::sharding {

using namespace trainkit_testing::dist_driver;

// The tensor records of a checkpoint (a file or a set) whose key starts with one of `prefixes`.
inline std::map<std::string, torch::Tensor> records(const std::string& path, const std::vector<std::string>& prefixes) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [key, t] : testing::checkpoint_tensors(path))
    for (const auto& p : prefixes)
      if (key.rfind(p, 0) == 0) out[key] = t;
  return out;
}

inline const std::vector<std::string> kState{"model.param.", "optim.", "counters.", "precision."};

// Every record of `a` is in `b` with the same shape; returns the largest relative difference
// (max |a - b| / max |b| per record). Never compares nothing.
inline double compare(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  REQUIRE(a.size() >= 6);
  CHECK(a.size() == b.size());
  double worst = 0;
  for (const auto& [key, t] : a) {
    CAPTURE(key);
    const auto it = b.find(key);
    REQUIRE(it != b.end());
    REQUIRE(t.sizes() == it->second.sizes());
    const auto x = t.to(torch::kDouble), y = it->second.to(torch::kDouble);
    const double scale = std::max(y.abs().max().item<double>(), 1e-30);
    worst = std::max(worst, (x - y).abs().max().item<double>() / scale);
  }
  return worst;
}
inline bool equal_records(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  REQUIRE(a.size() >= 6);
  if (a.size() != b.size()) return false;
  for (const auto& [key, t] : a) {
    const auto it = b.find(key);
    if (it == b.end() || !torch::equal(t, it->second)) {
      MESSAGE("record " << key << " differs");
      return false;
    }
  }
  return true;
}

inline std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& more) {
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

// The runs the sharded stages are compared with the replicated one on. 60 samples: 2 ranks x 4
// -> 8 micro-batches per epoch, 3 ranks -> 5: with 3 per window every epoch ends with a partial
// window (flushed). Item counts differ between ranks; ClipNorm at 0.05 clips; 256-byte buckets
// cut the storage in several buckets, so every rank owns several slices, and padding is needed
// for 3 ranks.
inline const std::vector<std::string> kCompared{"--model", "mlp-ln", "--batch", "4", "--samples", "60", "--flush", "1",
                                         "--items", "1", "--steps", "21", "--bucket-bytes", "256"};
struct Case {
  const char* name;
  std::vector<std::string> args;
};

// A run of the driver at `world` ranks that saved its checkpoint: the records, rank 0's summary,
// the checkpoint's path.
struct SavedRun {
  std::map<std::string, torch::Tensor> state;
  nlohmann::json s;
  std::string ckpt;
};

// The runs the tests compare, each made once per process (doctest enters a test case once per
// subcase, and several subcases compare against one run), in a directory that lives as long.
inline std::map<std::string, SavedRun>& saved_runs() {
  static std::map<std::string, SavedRun> runs;
  return runs;
}
inline std::string run_key(int world, const std::vector<std::string>& args) {
  std::string key = std::to_string(world);
  for (const auto& a : args) key += '\x1f' + a;
  return key;
}

// The runs of `configs` (each the driver's arguments but --out and --save) at `world` ranks that
// were not made yet, made in one launch (a chain); every rank of each ends with the same
// parameters, bit for bit (stage 3: its root unit).
inline void make_runs(int world, const std::vector<std::vector<std::string>>& configs) {
  static const testing::TempDir dir;
  auto& saved = saved_runs();
  Runs chain;
  std::vector<std::string> keys;
  for (const auto& args : configs) {
    const auto key = run_key(world, args);
    if (saved.count(key) || std::find(keys.begin(), keys.end(), key) != keys.end()) continue;
    const std::string out = dir / ("run" + std::to_string(saved.size() + keys.size()));
    chain.push_back({out, with(args, {"--save", out + ".ckpt"})});
    keys.push_back(key);
  }
  if (chain.empty()) return;
  run_chain(world, chain);
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string& out = chain[i].first;
    for (int r = 1; r < world; ++r) CHECK(torch::equal(params(out, r), params(out, 0)));  // bit for bit
    saved[keys[i]] = {records(out + ".ckpt", kState), summary(out, 0), out + ".ckpt"};
  }
}
inline const SavedRun& saved_run(int world, const std::vector<std::string>& args) {
  make_runs(world, {args});
  return saved_runs().at(run_key(world, args));
}

// `args` at each of `stages` (--sharding), made in one launch where not made already.
inline std::vector<std::vector<std::string>> at_stages(const std::vector<std::string>& args, const std::vector<int>& stages) {
  std::vector<std::vector<std::string>> out;
  for (const int stage : stages) out.push_back(with(args, {"--sharding", std::to_string(stage)}));
  return out;
}

// One run of `args` per stage at `world` ranks, each saving its checkpoint: the records, rank 0's
// summary and the checkpoint per stage.
struct StageRuns {
  std::map<int, std::map<std::string, torch::Tensor>> state;
  std::map<int, nlohmann::json> s;
  std::map<int, std::string> ckpt;
};
inline StageRuns run_stages(int world, const std::vector<std::string>& args, const std::vector<int>& stages) {
  make_runs(world, at_stages(args, stages));
  StageRuns runs;
  for (const int stage : stages) {
    const auto& r = saved_run(world, with(args, {"--sharding", std::to_string(stage)}));
    runs.state[stage] = r.state;
    runs.s[stage] = r.s;
    runs.ckpt[stage] = r.ckpt;
  }
  return runs;
}

// `from` loaded by `world` rank(s) at `stage` and saved again without a step: the records of
// `saved`, bit for bit.
inline void reloads_to(const testing::TempDir& dir, const std::vector<std::string>& common, int world, const std::string& stage,
                const std::string& from, const std::map<std::string, torch::Tensor>& saved) {
  const std::string again = dir / "again.ckpt";
  const auto args = with(common, {"--steps", "5", "--sharding", stage, "--load", from, "--save", again});
  if (world == 1) run_one(dir / "b", args);
  else run_ranks(world, dir / "b", args);
  CHECK(equal_records(records(again, kState), saved));
}

// A checkpoint of one process loaded by `world` ranks at `stage` and saved again: its records.
inline void one_process_to(const testing::TempDir& dir, const std::vector<std::string>& common, int world,
                    const std::string& stage) {
  run_one(dir / "d", with(common, {"--steps", "5", "--save", dir / "d.ckpt"}));
  const auto one = records(dir / "d.ckpt", kState);
  run_ranks(world, dir / "e", with(common, {"--steps", "5", "--sharding", stage, "--load", dir / "d.ckpt", "--save", dir / "e.ckpt"}));
  CHECK(equal_records(records(dir / "e.ckpt", kState), one));
}

// Rank 1's last slice of the 2-rank set `set` damaged, loaded at `stage` by 2 ranks: both exit
// 1 (none waits for the other), rank 1 naming the file, rank 0 the rank that found it. The set is
// whole again after.
inline void damaged_piece_fails_alike(const testing::TempDir& dir, const std::vector<std::string>& common,
                               const std::string& set, const std::string& stage) {
  const std::string damaged = set + ".00001-of-00002.safetensors";
  std::string bytes = testing::read_text(damaged);
  bytes[bytes.size() - 3] = static_cast<char>(bytes[bytes.size() - 3] ^ 0x01);
  std::ofstream(damaged, std::ios::binary | std::ios::trunc) << bytes;
  auto ranks = spawn_ranks(2, dir / "split", std::to_string(free_port()),
                           with(common, {"--steps", "5", "--sharding", stage, "--load", set, "--timeout", "20"}));
  for (auto& c : ranks) CHECK(wait_exit(c, 120) == 1);
  CHECK(slurp(ranks[1].err).find("checkpoint '" + damaged + "' is damaged") != std::string::npos);
  CHECK(slurp(ranks[0].err).find("1 rank(s) found their part of it damaged") != std::string::npos);
  bytes[bytes.size() - 3] = static_cast<char>(bytes[bytes.size() - 3] ^ 0x01);
  std::ofstream(damaged, std::ios::binary | std::ios::trunc) << bytes;
}

}  // namespace trainkit_testing::sharding
