// ZeRO stages 1 and 2 (storage/sharded_update.hpp: the modes ShardedUpdate and ShardedGradients)
// over 2 and 3 Gloo ranks: the sharded update equals the replicated one, the overflow diagnosis
// counts each rank's slices, the reduction overlaps the backward, TRAIN.ZERO_STAGE reaches the
// trainer and one process shards nothing.
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

namespace test_sharded_update {  // this file's names, apart from those of the files it shares a unity batch with

using namespace trainkit_testing::dist_driver;
using namespace trainkit_testing::sharding;

TEST_CASE("sharded updates (stages 1 and 2) equal the replicated one over 2 and 3 ranks") {
  testing::TempDir dir;
  const auto& common = kCompared;  // (rank 1 overflows in window 2 with FP16)
  const std::vector<Case> cases = {
      {"FP32, N = 3", {"--precision", "fp32", "--accum", "3"}},
      {"FP16 master weights, N = 3, overflow", {"--precision", "fp16master", "--accum", "3", "--overflow-rank", "1",
                                                "--overflow-window", "1"}},
      // One micro-batch per window: FP16 master weights reduce the half gradient.
      {"FP16 master weights, N = 1, half reduction", {"--precision", "fp16master", "--accum", "1"}},
  };
  // Every case's runs in one launch per world size (the subcases read them); at 3 ranks also the
  // half reduction's replicated run with other buckets.
  const auto reordered = with(with(common, cases[2].args), {"--bucket-bytes", "1024", "--sharding", "0"});
  for (const int world : {2, 3}) {
    std::vector<std::vector<std::string>> all;
    for (const auto& c : cases)
      for (auto& args : at_stages(with(common, c.args), {0, 1, 2})) all.push_back(std::move(args));
    if (world == 3) all.push_back(reordered);
    make_runs(world, all);
  }
  for (const auto& c : cases) {
    for (const int world : {2, 3}) {
      SUBCASE((std::string(c.name) + ", " + std::to_string(world) + " ranks").c_str()) {
        auto [state, s, ckpt] = run_stages(world, with(common, c.args), {0, 1, 2});
        for (const int stage : {0, 1, 2}) {
          // Stage 0 all-reduces; stages 1 and 2 reduce-scatter and all-gather (stage 2 also inside windows).
          CHECK((s[stage]["reduce_scatter_calls"].get<int>() > 0) == (stage > 0));
          CHECK((s[stage]["all_gather_calls"].get<int>() > 0) == (stage > 0));
          // Stage 2 keeps no model gradient between windows; stages 0 and 1 do.
          CHECK((s[stage]["gradient_bytes"].get<std::int64_t>() == 0) == (stage == 2));
        }
        // Two ranks sum a + b, the same number in any order; three ranks sum in the order of the
        // collective's algorithm, which differs between an all-reduce and a reduce-scatter (and
        // between two bucket sizes of the same all-reduce). In fp32 that is rounding; with master
        // weights the model's half parameters round the masters again and the difference grows
        // (the half reduction rounds each partial sum to fp16). There the bound is the replicated
        // run's own difference under another summation order, measured here.
        // (Measured: 1.5e-6 with fp32 sums, 1.4e-3 with the half reduction, whose replicated run
        // differs from itself by 1.6e-3 when its buckets are cut otherwise.)
        double tolerance = 1e-6;
        if (world == 3 && std::string(c.name).find("master") != std::string::npos) {
          tolerance = 1e-5;
          if (std::string(c.name).find("half") != std::string::npos) {
            const double floor = compare(saved_run(world, reordered).state, state[0]);
            MESSAGE(std::string(c.name) << ", 3 ranks, replicated against itself with other buckets: " << floor);
            CHECK(floor > 1e-4);  // the half sums' order shows
            tolerance = 3 * floor;
          }
        }
        for (const int stage : {1, 2}) {
          CAPTURE(stage);
          CHECK(s[stage]["applied"] == s[0]["applied"]);
          CHECK(s[stage]["skipped"] == s[0]["skipped"]);
          CHECK(s[stage]["scale"] == s[0]["scale"]);
          const double diff = compare(state[stage], state[0]);
          MESSAGE(std::string(c.name) << ", " << world << " ranks, stage " << stage << ": largest relative difference " << diff);
          CHECK(diff <= tolerance);
        }
        if (std::string(c.name).find("overflow") != std::string::npos) CHECK(s[0]["skipped"] == 1);
      }
    }
  }
}

TEST_CASE("the overflow diagnosis counts each rank's slices; combined by their maximum they name every parameter") {
  // Rank 1's loss is infinite in window 2: the reduced gradient is non-finite in every
  // parameter. Replicated, every rank counts every parameter once; sharded (stage 2; 256-byte
  // buckets, so a parameter is cut into slices on both ranks and several on one), each counts
  // its slices, a parameter once per window however many slices it has here, and the maximum
  // over the ranks (what RunLog combines at a check) is every parameter. FP16 master weights
  // count the masters' slices alike.
  testing::TempDir dir;
  const std::vector<std::string> args{"--model", "mlp-ln", "--batch", "4", "--samples", "32", "--steps", "4",
                                      "--bucket-bytes", "256", "--overflow-rank", "1", "--overflow-window", "2",
                                      "--watch-nonfinite", "1"};
  struct Case {
    const char* precision;
    int stage;
  };
  for (const Case c : {Case{"fp32", 0}, Case{"fp32", 2}, Case{"fp16master", 2}}) {
    CAPTURE(c.precision);
    CAPTURE(c.stage);
    const std::string out = dir / (std::string(c.precision) + std::to_string(c.stage));
    run_ranks(2, out, with(args, {"--precision", c.precision, "--sharding", std::to_string(c.stage)}));
    const auto a = summary(out, 0)["nonfinite"].get<std::vector<std::int64_t>>();
    const auto b = summary(out, 1)["nonfinite"].get<std::vector<std::int64_t>>();
    REQUIRE(a.size() == b.size());
    REQUIRE(a.size() >= 6);
    CHECK(summary(out, 0)["skipped"] == 1);
    std::vector<std::int64_t> most(a.size());
    for (size_t i = 0; i < a.size(); ++i) most[i] = std::max(a[i], b[i]);
    CHECK(most == std::vector<std::int64_t>(a.size(), 1));
    if (c.stage == 0) {
      CHECK(a == b);
    } else {  // each rank counted its own slices only
      CHECK((a != most || b != most));
    }
  }
}

TEST_CASE("tk::fit sharded: a rank that overflows stops both ranks alike, naming every module from both ranks' slices") {
  // Stage 2 and one bucket: rank 0 holds the first half of the flat buffer (fc1), rank 1 the
  // rest (fc2, ln). Rank 1's gradient is NaN from micro-batch 1 on, its loss finite. LOG_FREQUENT
  // 4 and patience 3: the check at window 4 reaches the patience unwatched on both ranks, window
  // 5 is a log window on both (its collective agrees), watched, and both stop there naming the
  // modules combined over the ranks (rank 0's slices alone hold fc1 only). Then rank 1's loss
  // itself infinite: the forward's case on both ranks, no gradient ranking, and the forward's
  // peaks (the infinite loss after the model: the model's own) named on rank 0 as well.
  testing::TempDir dir;
  for (const bool in_gradient : {true, false}) {
    CAPTURE(in_gradient);
    const std::string out = in_gradient ? "overflow-gradient" : "overflow-loss";
    auto ranks = spawn_ranks(2, dir / out, std::to_string(free_port()),
                             {"--fit", dir / (out + "-out"), "--model", "mlp-ln", "--sharding", "2", "--overflow-rank",
                              "1", "--overflow-window", "1", "--overflow-gradient", in_gradient ? "1" : "0",
                              "--log-frequent", "4", "--patience", "3", "--forward-peaks", "1"});
    for (auto& c : ranks) {
      CHECK(wait_exit(c, 120) == 1);
      const std::string err = slurp(c.err);
      INFO(err);
      CHECK(err.find("optimizer step 4: 4 of the last 4 optimizer steps were skipped") != std::string::npos);
      if (in_gradient) {
        CHECK(err.find("non-finite gradients in 3 modules (windows, nearest the loss first): fc2 (1)") != std::string::npos);
        CHECK(err.find("fc1 (1)") != std::string::npos);
        CHECK(err.find("the forward's output is first not finite") == std::string::npos);
      } else {
        CHECK(err.find("the training loss itself is not finite") != std::string::npos);
        CHECK(err.find("non-finite gradients in") == std::string::npos);
        CHECK(err.find("; the forward's output is first not finite in (model); the checkpoints") != std::string::npos);
      }
    }
  }
}

TEST_CASE("the reduction overlaps the backward: the same result, buckets sent during it") {
  testing::TempDir dir;
  const std::vector<std::string> common{"--model", "mlp-ln", "--batch", "4", "--accum", "2", "--items", "1",
                                        "--steps", "9", "--bucket-bytes", "256"};
  for (const std::string stage : {"0", "1", "2"}) {
    CAPTURE(stage);
    const std::string on = dir / ("on" + stage), off = dir / ("off" + stage);
    run_ranks(2, on, with(common, {"--sharding", stage, "--overlap", "1"}));
    run_ranks(2, off, with(common, {"--sharding", stage, "--overlap", "0"}));
    for (int r = 0; r < 2; ++r) CHECK(torch::equal(params(on, r), params(off, r)));  // bit for bit
    const auto s_on = summary(on, 0), s_off = summary(off, 0);
    MESSAGE("stage " << stage << ": " << s_on["overlapped_buckets"] << " buckets sent during the backward");
    CHECK(s_on["overlapped_buckets"].get<int>() > 0);
    CHECK(s_off["overlapped_buckets"].get<int>() == 0);
    // The same collectives either way: only when they start differs.
    CHECK(s_on["allreduce_calls"] == s_off["allreduce_calls"]);
    CHECK(s_on["reduce_scatter_calls"] == s_off["reduce_scatter_calls"]);
  }
}

TEST_CASE("sharding: TRAIN.ZERO_STAGE in the plan, one process unsharded, a torch::optim optimizer refused") {
  tk::Config config;
  config.load_string(R"({"TRAIN": {"ZERO_STAGE": 2}})", tk::Config::Format::json);
  CHECK(tk::RunPlan::from(config, 2).trainer_options.sharding() == tk::Sharding::gradients);
  config.load_string(R"({"TRAIN": {"ZERO_STAGE": 1}})", tk::Config::Format::json);
  CHECK(tk::RunPlan::from(config, 2).trainer_options.sharding() == tk::Sharding::optimizer);
  CHECK(tk::RunPlan::from(tk::Config(), 2).trainer_options.sharding() == tk::Sharding::none);
  config.load_string(R"({"TRAIN": {"ZERO_STAGE": 3, "UNITS": ["vlbert.encoder.*", "head"]}})", tk::Config::Format::json);
  CHECK(tk::RunPlan::from(config, 2).trainer_options.sharding() == tk::Sharding::parameters);
  CHECK(tk::RunPlan::from(config, 2).trainer_options.units() == std::vector<std::string>{"vlbert.encoder.*", "head"});
  CHECK_THROWS_WITH_AS(config.load_string(R"({"TRAIN": {"ZERO_STAGE": 4}})", tk::Config::Format::json), doctest::Contains("TRAIN.ZERO_STAGE"),
                       tk::ConfigError);
  config.load_string(R"({"TRAIN": {"ZERO_STAGE": 3, "FP16": true, "MASTER_WEIGHTS": true}})", tk::Config::Format::json);
  CHECK(tk::RunPlan::from(config, 2).trainer_options.sharding() == tk::Sharding::parameters);  // (master weights too)

  // One process: nothing to shard; the trainer trains as the replicated one, bit for bit.
  torch::manual_seed(3);
  auto make = [] {
    torch::manual_seed(3);
    return torch::nn::Linear(4, 2);
  };
  auto sharded_model = make(), plain_model = make();
  using T = tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<2>, tk::ClipPolicy<tk::ClipNorm>>;
  T sharded(sharded_model, tk::AdamW{1e-2}, tk::TrainerOptions().sharding(tk::Sharding::gradients));
  T plain(plain_model, tk::AdamW{1e-2}, tk::TrainerOptions());
  const auto x = torch::randn({8, 4});
  for (int i = 0; i < 6; ++i) {
    const auto rows = x.narrow(0, i % 4 * 2, 2);
    sharded.micro_step([&] { return sharded_model(rows).square().mean(); });
    plain.micro_step([&] { return plain_model(rows).square().mean(); });
  }
  CHECK_FALSE(sharded.saves_collectively());
  CHECK(torch::equal(sharded.parameters(), plain.parameters()));

  // Stage 3's units are resolved at construction, one process or not.
  torch::nn::ModuleList net(torch::nn::Linear(4, 4), torch::nn::ModuleList(torch::nn::Linear(4, 4), torch::nn::Tanh()));
  const auto units = [&](std::vector<std::string> paths) {
    T(net, tk::AdamW{1e-2}, tk::TrainerOptions().sharding(tk::Sharding::parameters).units(std::move(paths)));
  };
  CHECK_NOTHROW(units({"0", "1"}));
  CHECK_NOTHROW(units({"1.*"}));
  CHECK_THROWS_WITH_AS(units({"2"}), doctest::Contains("'2' names no module of the model; its modules are named '0', '1', "
                                                       "'1.0', '1.1'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(units({"1", "1.0"}), doctest::Contains("are one inside the other"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(units({"0", "0"}), doctest::Contains("names unit '0' again"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(units({"0.*"}), doctest::Contains("module '0' has no children"), std::invalid_argument);
  using Master = tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::FP16Dynamic>>, tk::AccumulationPolicy<2>,
                             tk::ClipPolicy<tk::ClipNorm>>;
  const auto stage3 = tk::TrainerOptions().sharding(tk::Sharding::parameters).units({"0"});
  CHECK_NOTHROW(Master(net, tk::AdamW{1e-2}, stage3));
  CHECK_THROWS_WITH_AS(Master(net, tk::AdamW{1e-2}, tk::TrainerOptions(stage3).reduce_precision(tk::ReducePrecision::half)),
                       doctest::Contains("reduce_precision half with ZeRO stage 3"),
                       std::invalid_argument);

  auto model = torch::nn::Linear(4, 2);
  auto sgd = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH_AS(T(model, sgd, tk::TrainerOptions().sharding(tk::Sharding::optimizer)),
                       doctest::Contains("fused optimizers"), std::invalid_argument);
}

}  // namespace test_sharded_update

#endif
