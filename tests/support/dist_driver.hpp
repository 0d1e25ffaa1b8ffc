#pragma once
// The data-parallel tests' launches of tests/dist/driver.cpp (trainkit_dist_driver, next to the
// test binary): W ranks on loopback (rank 0 hosts the store), each a separate process, so that
// no LibTorch thread pool is ever forked; and what they write (parameters, summaries).
#include "processes.hpp"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace trainkit_testing::dist_driver {

using namespace trainkit_testing::processes;

inline std::string driver() { return here() + "/trainkit_dist_driver"; }

inline std::vector<std::string> driver_args(const std::string& out, const std::vector<std::string>& extra) {
  std::vector<std::string> a{driver(), "--out", out};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// `world` ranks on loopback, launched by the harness (rank r logs to out.log<r>).
inline std::vector<Child> spawn_ranks(int world, const std::string& out, const std::string& port,
                                      const std::vector<std::string>& extra) {
  std::vector<Child> ranks;
  for (int r = 0; r < world; ++r)
    ranks.push_back(spawn(driver_args(out, extra),
                          {{"RANK", std::to_string(r)}, {"WORLD_SIZE", std::to_string(world)},
                           {"LOCAL_RANK", std::to_string(r)}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}},
                          out + ".log" + std::to_string(r)));
  return ranks;
}

// `world` ranks run to completion; none may report a silent rank (every rank beats).
inline void run_ranks(int world, const std::string& out, const std::vector<std::string>& extra, double seconds = 120) {
  std::vector<Child> ranks = spawn_ranks(world, out, std::to_string(free_port()), extra);
  for (auto& c : ranks) expect_success(c, wait_exit(c, seconds));
  for (auto& c : ranks) CHECK(slurp(c.err).find("heartbeat") == std::string::npos);
}

// A chain of runs (the driver's --then): each {out, arguments}, one after another in one launch
// of `world` ranks (rank r of the chain logs to the first out's .log<r>); a launch, its start and
// its process group, is what a test run costs most.
using Runs = std::vector<std::pair<std::string, std::vector<std::string>>>;
inline std::vector<std::string> chained(const Runs& runs) {
  std::vector<std::string> extra = runs.at(0).second;
  for (size_t i = 1; i < runs.size(); ++i) {
    extra.insert(extra.end(), {"--then", "--out", runs[i].first});
    extra.insert(extra.end(), runs[i].second.begin(), runs[i].second.end());
  }
  return extra;
}
inline void run_chain(int world, const Runs& runs, double seconds = 120) {
  run_ranks(world, runs.at(0).first, chained(runs), seconds);
}

// One process, no launcher variables.
inline void run_one(const std::string& out, const std::vector<std::string>& extra) {
  auto c = spawn(driver_args(out, extra), {}, out + ".log");
  expect_success(c, wait_exit(c, 120));
}

// Rank r's parameters as the driver wrote them (out.rank<r>.bin).
inline torch::Tensor params(const std::string& out, int rank) {
  const std::string bytes = slurp(out + ".rank" + std::to_string(rank) + ".bin");
  REQUIRE(!bytes.empty());
  return torch::from_blob(const_cast<char*>(bytes.data()),
                          {static_cast<std::int64_t>(bytes.size() / sizeof(float))}, torch::kFloat)
      .clone();
}
inline nlohmann::json summary(const std::string& out, int rank) {
  return nlohmann::json::parse(slurp(out + ".rank" + std::to_string(rank) + ".json"));
}
inline double max_relative(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max()).item<double>();
}

}  // namespace trainkit_testing::dist_driver
