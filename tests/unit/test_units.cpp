// The boundary of a unit of a sharded model (tk::unit, trainer/unit.hpp): without a schedule
// the call alone; with one, before_forward / after_forward around the unit's forward and
// before_backward before its backward, in the order a stage-3 storage needs them (units
// reached in reverse in the backward, a recomputed unit gathered before its recomputation),
// and gradients equal to the plain call's.
#include "../support/helpers.hpp"

#include <trainkit/trainer/recompute.hpp>
#include <trainkit/trainer/unit.hpp>

#include <map>
#include <string>
#include <vector>

namespace test_units {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

// The events in order; "run <name>" when a layer's forward runs.
std::vector<std::string> events;

struct LayerImpl : torch::nn::Module {
  explicit LayerImpl(std::string name) : name(std::move(name)) { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(const torch::Tensor& x) {
    events.push_back("run " + name);
    return torch::tanh(fc(x));
  }
  std::string name;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Layer);

// embed -> layer0 -> layer1 (recomputed when asked) -> head; layer0 and layer1 are units.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(4);
    embed = register_module("embed", torch::nn::Linear(4, 4));
    layer0 = register_module("layer0", Layer("layer0"));
    layer1 = register_module("layer1", Layer("layer1"));
    head = register_module("head", torch::nn::Linear(4, 1));
  }
  torch::Tensor forward(const torch::Tensor& x, bool recompute) {
    auto h = tk::unit(layer0, embed(x));
    h = recompute ? tk::unit(layer1, [l = layer1](const torch::Tensor& y) { return tk::recompute(l, y); }, h)
                  : tk::unit(layer1, h);
    return head(h);
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  Layer layer0{nullptr}, layer1{nullptr};
};
TORCH_MODULE(Net);

struct Recorder : tk::detail::UnitSchedule {
  std::map<const torch::nn::Module*, std::int64_t> units;
  std::int64_t unit_of(const torch::nn::Module& m) const override {
    const auto it = units.find(&m);
    return it == units.end() ? -1 : it->second;
  }
  void before_forward(std::int64_t u) override { events.push_back("gather " + std::to_string(u)); }
  void after_forward(std::int64_t u) override { events.push_back("release " + std::to_string(u)); }
  void before_backward(std::int64_t u) override { events.push_back("gather for backward " + std::to_string(u)); }
};

std::vector<torch::Tensor> gradients(Net& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.grad().clone());
  return out;
}

}  // namespace

TEST_CASE("without a schedule a unit is its call; with one, gathered around its forward and before its backward") {
  const auto x = torch::randn({3, 4});
  Net plain;
  events.clear();
  plain->forward(x, false).sum().backward();
  CHECK(events == std::vector<std::string>{"run layer0", "run layer1"});
  const auto expected = gradients(plain);

  for (const bool recompute : {false, true}) {
    CAPTURE(recompute);
    Net net;
    auto schedule = std::make_shared<Recorder>();
    schedule->units = {{net->layer0.get(), 0}, {net->layer1.get(), 1}};
    events.clear();
    {
      tk::detail::UnitScheduleScope scope(schedule);
      net->forward(x, recompute).sum().backward();
    }
    std::vector<std::string> want{"gather 0", "run layer0", "release 0", "gather 1", "run layer1", "release 1",
                                  "gather for backward 1"};
    if (recompute) want.push_back("run layer1");  // (the recomputation, with the unit gathered)
    want.push_back("gather for backward 0");
    CHECK(events == want);
    const auto got = gradients(net);
    REQUIRE(got.size() == expected.size());
    for (size_t i = 0; i < got.size(); ++i) CHECK(torch::equal(got[i], expected[i]));
    CHECK(tk::detail::active_unit_schedule() == nullptr);  // (the scope put the previous one back)
  }
}

TEST_CASE("tk::recompute around a unit: the recomputation in the backward is gathered by the forward's schedule") {
  const auto x = torch::randn({3, 4});
  Net plain;
  plain->forward(x, false).sum().backward();
  const auto expected = gradients(plain);
  Net net;
  auto schedule = std::make_shared<Recorder>();
  schedule->units = {{net->layer0.get(), 0}, {net->layer1.get(), 1}};
  events.clear();
  {
    tk::detail::UnitScheduleScope scope(schedule);
    auto h = tk::unit(net->layer0, net->embed(x));
    h = tk::recompute([l = net->layer1](const torch::Tensor& y) mutable { return tk::unit(l, y); }, h);
    net->head(h).sum().backward();  // (the backward runs on autograd's thread: no schedule active there)
  }
  // The first forward records no graph (no hook); the recomputation is gathered and hooked.
  CHECK(events == std::vector<std::string>{"gather 0", "run layer0", "release 0", "gather 1", "run layer1", "release 1",
                                           "gather 1", "run layer1", "release 1", "gather for backward 1",
                                           "gather for backward 0"});
  const auto got = gradients(net);
  REQUIRE(got.size() == expected.size());
  for (size_t i = 0; i < got.size(); ++i) CHECK(torch::equal(got[i], expected[i]));
}

TEST_CASE("a module that is no unit of the schedule, and a forward without a graph, make no call of it") {
  Net net;
  auto schedule = std::make_shared<Recorder>();
  schedule->units = {{net->layer1.get(), 1}};
  tk::detail::UnitScheduleScope scope(schedule);
  events.clear();
  {
    torch::NoGradGuard no_grad;
    net->forward(torch::randn({2, 4}), false);
  }
  // layer0 is no unit: called alone; layer1 gathered and released, no hook without a graph.
  CHECK(events == std::vector<std::string>{"run layer0", "gather 1", "run layer1", "release 1"});
}

TEST_CASE("outside a step, a unit of a live stage-3 schedule runs only while its units are held gathered") {
  // (The mode ShardedUnits registers its UnitGathers so; a Recorder stands for it here.)
  struct Held : Recorder {
    bool on = false;
    bool held() const override { return on; }
  };
  Net net;
  auto schedule = std::make_shared<Held>();
  schedule->units[net->layer0.get()] = 0;
  tk::detail::UnitRegistry::get().add(schedule);
  const auto x = torch::randn({3, 4});
  events.clear();
  torch::NoGradGuard no_grad;
  CHECK_THROWS_WITH_AS(net->forward(x, false), doctest::Contains("trainer.hold_parameters(true)"), std::logic_error);
  schedule->on = true;
  CHECK_NOTHROW(net->forward(x, false));
  CHECK(events == std::vector<std::string>{"run layer0", "run layer1"});  // (held: no gather per call)
  tk::detail::UnitRegistry::get().remove(schedule.get());
  schedule->on = false;
  CHECK_NOTHROW(net->forward(x, false));  // (no live schedule: the call alone)
}

}  // namespace test_units
