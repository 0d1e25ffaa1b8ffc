// Stage 3's gathers (storage/unit_gathers.hpp) over Gloo ranks: units gathered ahead or kept
// until their backward, in step when the order changes, every unit held for a weights export,
// an evaluation by unit with uneven forwards.
#if __has_include(<gloo/algorithm.h>)

#include "../support/helpers.hpp"
#include "../support/dist_driver.hpp"
#include "../support/sharding.hpp"

#include <trainkit/io/weights.hpp>
#include <trainkit/run/plan.hpp>
#include <trainkit/storage/unit_gathers.hpp>

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

namespace test_unit_gathers {  // this file's names, apart from those of the files it shares a unity batch with

using namespace trainkit_testing::dist_driver;
using namespace trainkit_testing::sharding;

// Two ranks' replicas of which only the unit gathers exist: each writes its bucket, and its
// wait fails (a peer gone in the middle of the collective).
class FailingGathers final : public tk::Replicas {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  void attach(torch::nn::Module&, const torch::Tensor&, const torch::Tensor&) override { unused(); }
  void check_same_state(const std::vector<torch::Tensor>&, const std::string&) override { unused(); }
  void all_reduce(std::vector<double>&, tk::Reduce) override { unused(); }
  std::unique_ptr<tk::Reduction> start_reduction(torch::Tensor&, torch::Tensor, const tk::detail::Partition&,
                                                 const tk::WindowWeights&, bool) override {
    unused();
  }
  torch::Tensor global_norm(const torch::Tensor&) override { unused(); }
  void sum(torch::Tensor&) override { unused(); }
  void all_gather(torch::Tensor&, const tk::detail::Partition&) override { unused(); }
  torch::Tensor gather_to_main(const torch::Tensor&, const tk::detail::Partition&) override { unused(); }
  std::function<void()> start_gather_bucket(const torch::Tensor&, const torch::Tensor& bucket,
                                            const std::string& what) override {
    bucket.fill_(1);
    return [what] { throw std::runtime_error("the wait for the " + what + " failed"); };
  }

 private:
  [[noreturn]] static void unused() { throw std::logic_error("FailingGathers: not used here"); }
};

TEST_CASE("stage 3: a unit whose all-gather's wait fails hands its buffer's memory to the replicas, kept until the "
          "communicator is gone (the collective may still write it), and the unit counts as released") {
  FailingGathers replicas;
  const auto buffer = torch::zeros({8});
  const auto param = buffer.view({2, 4});
  tk::detail::release_storage(buffer);
  tk::detail::UnitGathers::Unit unit;
  unit.name = "block";
  unit.buffer = buffer;
  unit.members = 1;
  tk::detail::UnitGathers gathers({unit}, {param}, {0}, {0}, replicas, tk::detail::Partition({{0, 8}}, 2, 0),
                                  torch::zeros({4}));
  CHECK_THROWS_WITH_AS(gathers.before_forward(0), "the wait for the all-gather of unit 'block' (1/1) failed",
                       std::runtime_error);
  CHECK(replicas.kept_after_failure() == 8 * 4);
  CHECK(tk::detail::is_released(buffer));
  // Gathered again (a load's refresh, another forward): new memory; the kept one stays kept.
  CHECK_THROWS(gathers.before_forward(0));
  CHECK(replicas.kept_after_failure() == 2 * 8 * 4);
}

TEST_CASE("stage 3: the model's weights written while every unit is held are the checkpoint's parameters, bit for "
          "bit; written without the hold, they are refused, naming a parameter") {
  testing::TempDir dir;
  const std::string ckpt = dir / "s.ckpt", weights = dir / "w.safetensors";
  const auto args = with(kCompared, {"--precision", "fp32", "--sharding", "3", "--save", ckpt});
  run_ranks(2, dir / "e", with(args, {"--export", weights}));
  const auto saved = records(ckpt, {"model.param."});
  const auto written = tk::read_weights(weights);
  REQUIRE(written.size() == saved.size());
  for (const auto& [name, t] : written) {
    CAPTURE(name);
    const auto it = saved.find("model.param." + name);
    REQUIRE(it != saved.end());
    CHECK(torch::equal(t, it->second.reshape(t.sizes())));
  }
  auto ranks = spawn_ranks(2, dir / "unheld", std::to_string(free_port()),
                           with(args, {"--export", dir / "unheld.safetensors", "--export-hold", "0", "--timeout", "10"}));
  CHECK(wait_exit(ranks[0], 120) == 1);
  const std::string err = slurp(ranks[0].err);
  CHECK(err.find("writing the model's weights") != std::string::npos);
  CHECK(err.find("fc1.weight") != std::string::npos);
  CHECK(wait_exit(ranks[1], 120) != 0);  // (its peer is gone)
  CHECK(!testing::file_exists(dir / "unheld.safetensors"));
}

TEST_CASE("stage 3 gathers ahead (unit_prefetch) or keeps units until their backward (reshard_after_forward false): "
          "the same state bit for bit, with as many units gathered at once as each says") {
  testing::TempDir dir;
  // Linear(8, 64), 4 x Linear(64, 64), Linear(64, 4): 6 units, the 4 mids the largest (4160
  // elements); 2 ranks, 2 micro-batches a window, uneven item counts.
  const std::vector<std::string> common{"--model", "deep", "--width", "64", "--layers", "4", "--batch", "4",
                                        "--samples", "40", "--steps", "8", "--accum", "2", "--items", "1",
                                        "--flush", "1", "--precision", "fp32", "--sharding", "3"};
  struct Run {
    const char* name;
    std::vector<std::string> args;
  };
  const std::vector<Run> runs = {{"none ahead", {"--prefetch", "0"}},
                                 {"1 ahead", {"--prefetch", "1"}},
                                 {"3 ahead", {"--prefetch", "3"}},
                                 {"1 ahead, reduced after the backward", {"--prefetch", "1", "--overlap", "0"}},
                                 {"kept until the backward", {"--prefetch", "0", "--reshard", "0"}},
                                 {"kept, 2 ahead", {"--prefetch", "2", "--reshard", "0"}}};
  std::map<std::string, nlohmann::json> s;
  std::map<std::string, torch::Tensor> reference;
  const auto out_of = [&](size_t i) { return dir / ("p" + std::to_string(i)); };
  Runs chain;  // (the six runs in one launch)
  for (size_t i = 0; i < runs.size(); ++i)
    chain.push_back({out_of(i), with(common, with(runs[i].args, {"--save", out_of(i) + ".ckpt"}))});
  run_chain(2, chain);
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& r = runs[i];
    const std::string name = r.name;
    CAPTURE(name);
    const auto state = records(out_of(i) + ".ckpt", kState);
    if (reference.empty()) reference = state;
    else CHECK(equal_records(state, reference));
    s[r.name] = summary(out_of(i), 0);
    MESSAGE(name << ": " << s[r.name]["unit_gathers"] << " gathers, " << s[r.name]["unit_gathers_ahead"]
                   << " ahead, peak " << s[r.name]["unit_peak"] << " elements gathered");
  }
  const std::int64_t mid = 64 * 64 + 64, all = 8 * 64 + 64 + 4 * mid + 64 * 4 + 4;
  auto at = [&](const char* run, const char* key) { return s[run][key].get<std::int64_t>(); };
  CHECK(at("none ahead", "unit_gathers_ahead") == 0);
  CHECK(at("none ahead", "unit_peak") == mid);
  CHECK(at("1 ahead", "unit_gathers_ahead") > 0);
  // Ahead in the forward and in the backward: from the second micro-batch on, every unit but
  // the first of each pass (5 + 5 a micro-batch).
  CHECK(at("1 ahead", "unit_gathers_ahead_in_backward") > 0);
  CHECK(at("1 ahead", "unit_gathers_ahead") == 2 * at("1 ahead", "unit_gathers_ahead_in_backward"));
  CHECK(at("kept, 2 ahead", "unit_gathers_ahead_in_backward") == 0);  // (every unit is gathered still)
  CHECK(at("1 ahead", "unit_gathers") == at("none ahead", "unit_gathers"));  // (launched earlier, not more)
  CHECK(at("1 ahead", "unit_peak") == 2 * mid);
  CHECK(at("3 ahead", "unit_peak") == 4 * mid);
  CHECK(at("1 ahead, reduced after the backward", "unit_peak") == 2 * mid);
  // Kept: no gather in the backward, every unit whole at the forward's end.
  CHECK(at("kept until the backward", "unit_gathers") < at("none ahead", "unit_gathers") * 2 / 3);
  CHECK(at("kept until the backward", "unit_peak") >= all);
  CHECK(at("kept, 2 ahead", "unit_gathers") == at("kept until the backward", "unit_gathers"));
}

TEST_CASE("stage 3 gathering ahead stays in step when the units' order changes between forwards and a unit's "
          "parameter gets no gradient on one rank: the same state as gathering none ahead, bit for bit") {
  testing::TempDir dir;
  // Every other forward runs the 4 mids in reverse (the recorded order is then stale: what was
  // gathered ahead is not what is called next), and rank 1 never uses the first mid's bias (that
  // unit is still held on rank 1 when rank 0 has released it). What each rank gathers ahead may
  // depend only on what every rank shares; otherwise the ranks' all-gathers pair wrongly or hang.
  const auto args = std::vector<std::string>{"--model", "deep", "--width", "64", "--layers", "4", "--batch", "4",
                                             "--samples", "40", "--steps", "8", "--accum", "2", "--items", "1",
                                             "--flush", "1", "--precision", "fp32", "--alternate-order", "1",
                                             "--unused-bias-rank", "1", "--timeout", "30", "--sharding", "3"};
  // (tk::recompute around each mid's tk::unit call too, at 2 ranks: the recomputation in the
  // backward is gathered by the step's schedule, and the state is the same, bit for bit.)
  const std::string around = dir / "around.ckpt", plain = dir / "plain.ckpt";
  const auto name = [&](const std::string& prefetch, int world) { return "p" + prefetch + "w" + std::to_string(world); };
  for (const int world : {2, 3}) {
    Runs chain;  // (one launch per world size)
    for (const std::string prefetch : {"0", "1", "2"})
      chain.push_back({dir / name(prefetch, world), with(args, {"--prefetch", prefetch, "--save", dir / (name(prefetch, world) + ".ckpt")})});
    if (world == 2) {
      chain.push_back({dir / "plain", with(args, {"--prefetch", "1", "--save", plain})});
      chain.push_back({dir / "around", with(args, {"--prefetch", "1", "--recompute-around", "1", "--save", around})});
    }
    run_chain(world, chain, 120);
    std::map<std::string, torch::Tensor> none_ahead;
    for (const std::string prefetch : {"0", "1", "2"}) {
      CAPTURE(world);
      CAPTURE(prefetch);
      const auto state = records(dir / (name(prefetch, world) + ".ckpt"), kState);
      if (prefetch == "0") {
        none_ahead = state;
        continue;
      }
      CHECK(summary(dir / name(prefetch, world), 0)["unit_gathers_ahead"].get<std::int64_t>() > 0);
      CHECK(equal_records(state, none_ahead));
    }
  }
  CHECK(equal_records(records(around, kState), records(plain, kState)));
}

TEST_CASE("stage 3 validates unit by unit: a rank whose forwards end sooner gathers with the others until every "
          "rank is done, and each holds one unit at a time") {
  testing::TempDir dir;
  // tk::fit with a validation by unit (FitOptions::validate_by_unit: --validate 2) after each
  // epoch, in which rank r runs r + 1 forwards. No unit is gathered ahead (--prefetch 0), so
  // that training holds one unit at a time too.
  const std::vector<std::string> fit{"--steps", "0", "--batch", "4", "--accum", "2", "--bucket-bytes", "256",
                                     "--model", "mlp-ln", "--precision", "fp32", "--validate", "2", "--prefetch", "0"};
  const auto run = [&](const std::string& name, const std::string& stage,
                       const std::vector<std::string>& extra = {"--validate", "2"}) {
    run_ranks(2, dir / name, with(with({"--fit", dir / (name + "-out"), "--sharding", stage}, fit), extra));
    return std::vector<nlohmann::json>{summary(dir / name, 0), summary(dir / name, 1)};
  };
  const auto replicated = run("replicated", "0"), sharded = run("sharded", "3");
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto& s = sharded[static_cast<size_t>(r)];
    // The replicated run's validation (the same model, but for the summation order's rounding).
    CHECK(s["validation"].get<double>() ==
          doctest::Approx(replicated[static_cast<size_t>(r)]["validation"].get<double>()).epsilon(1e-5));
    // Never more than one unit gathered: the validation gathers each unit for its call alone
    // (holding every unit, the default, gathers both: below).
    CHECK(s["unit_largest"].get<std::int64_t>() < s["unit_total"].get<std::int64_t>());
    CHECK(s["unit_peak"] == s["unit_largest"]);
  }
  const auto held = run("held", "3", {"--validate", "1"});
  CHECK(held[0]["unit_peak"] == held[0]["unit_total"]);
  CHECK(held[0]["validation"].get<double>() == doctest::Approx(sharded[0]["validation"].get<double>()).epsilon(1e-5));
  // A validate that averages its loss over the ranks (Replicas::all_reduce) after its uneven
  // forwards: the rank done first joins the other there, and both come to the average together.
  // (With one unit gathered ahead, as by default: the evaluation drops what training launched.)
  const auto averaged = run("averaged", "3", {"--validate", "3", "--prefetch", "1"}),
             averaged_replicated = run("averaged-replicated", "0", {"--validate", "3"});
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto& s = averaged[static_cast<size_t>(r)];
    CHECK(s["validation"].get<double>() == doctest::Approx(averaged_replicated[0]["validation"].get<double>()).epsilon(1e-5));
    CHECK(s["unit_gathers_ahead"].get<std::int64_t>() > 0);  // (training gathered ahead)
  }
  CHECK(averaged[0]["unit_gathers"] == averaged[1]["unit_gathers"]);
  // Rank 0, done after one forward, gathered each unit of rank 1's second one with it.
  CHECK(sharded[0]["unit_gathers"] == sharded[1]["unit_gathers"]);
  CHECK(slurp(dir / "sharded.log0.out").find("fit wrote 2 checkpoints") != std::string::npos);
}

TEST_CASE("stage 3 validating unit by unit announces each batch's units once, stays paired when their order changes "
          "alike on every rank, and stops every rank when one rank's order differs") {
  testing::TempDir dir;
  // Linear(8, 16), 4 x Linear(16, 16), Linear(16, 4): 6 units. Rank r runs 4 + r validation
  // forwards after each of the 2 epochs.
  const std::vector<std::string> common{"--steps", "0", "--batch", "4", "--accum", "2", "--model", "deep", "--width",
                                        "16", "--layers", "4", "--precision", "fp32", "--validate", "2",
                                        "--validate-forwards", "4", "--prefetch", "0", "--timeout", "30"};
  const auto run = [&](const std::string& name, const std::string& stage, const std::vector<std::string>& extra = {}) {
    return Runs::value_type{dir / name, with(with(common, {"--fit", dir / (name + "-out"), "--sharding", stage}), extra)};
  };
  run_chain(2, {run("replicated", "0"), run("sharded", "3"), run("alternating-replicated", "0", {"--alternate-order", "1"}),
                run("alternating", "3", {"--alternate-order", "1"})});
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto sharded = summary(dir / "sharded", r), alternating = summary(dir / "alternating", r);
    CHECK(sharded["validation"].get<double>() ==
          doctest::Approx(summary(dir / "replicated", r)["validation"].get<double>()).epsilon(1e-5));
    CHECK(alternating["validation"].get<double>() ==
          doctest::Approx(summary(dir / "alternating-replicated", r)["validation"].get<double>()).epsilon(1e-5));
    // Each validation: the first batch unit by unit (6), one announcement a batch after it (4,
    // rank 0 joining rank 1's last), the end (1). One a unit made 5 x 6 + 1.
    CHECK(sharded["unit_announcements"] == 2 * (6 + 4 + 1));
    CHECK(sharded["unit_peak"] == sharded["unit_largest"]);  // (still one unit at a time)
    // Every other forward in reverse (alike on both ranks): from the first change on, a unit an
    // announcement; the followed batch's rest (5 units after fc1) gathered for nothing, once a
    // validation.
    CHECK(alternating["unit_announcements"] > sharded["unit_announcements"]);
    CHECK(alternating["unit_gathers"].get<std::int64_t>() == sharded["unit_gathers"].get<std::int64_t>() + 2 * 5);
  }
  // Rank 1 alone runs its second validation forward in reverse: it gathers the rest of the
  // batch with rank 0, then names its unit where rank 0 names its next batch's first. Both stop.
  auto ranks = spawn_ranks(2, dir / "differ", std::to_string(free_port()),
                           with(run("differ", "3").second, {"--validate-reverse-rank", "1"}));
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(wait_exit(ranks[static_cast<size_t>(r)], 120) == 1);
    const auto err = slurp(ranks[static_cast<size_t>(r)].err);
    CHECK(err.find("the ranks called different units at once (units 'fc1' and 'mids.3')") != std::string::npos);
  }
}

}  // namespace test_unit_gathers

#endif
