// The bytes per rank predicted before launch (storage/held_bytes.hpp): ZeRO's formulas by stage
// and world size, and, in one process, a trainer's prediction equal to what it measures it holds
// after its first optimizer steps, for every precision, window and optimizer kind (the stages
// over several ranks: test_sharded_memory's "the bytes per rank each stage holds are predicted").
#include "../support/helpers.hpp"

#include <trainkit/storage/held_bytes.hpp>

#include <string>
#include <type_traits>

namespace test_held_bytes {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

// Two trained layers and a frozen one, every parameter a multiple of 16 elements (no gaps in
// the flat layout, so the prediction is exact).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(3);
    a = register_module("a", torch::nn::Linear(32, 64));
    b = register_module("b", torch::nn::Linear(64, 32));
    frozen = register_module("frozen", torch::nn::Linear(32, 32));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) { return frozen(b(torch::tanh(a(x)))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, frozen{nullptr};
};
TORCH_MODULE(Net);

template <class P, int N>
struct Combo {
  using trainer = tk::Trainer<tk::PrecisionPolicy<P>, tk::AccumulationPolicy<N>, tk::ClipPolicy<tk::ClipNorm>>;
  static constexpr int n = N;
};

}  // namespace

TEST_CASE("predict_held: ZeRO's bytes per parameter by stage and world size") {
  const tk::ModelSize model{1000, 0, 100, 0};  // (units of at most 100 parameters, none in the root unit)
  const tk::StorageShape fp32{false, 2, false}, master{true, 2, false};
  auto per_param = [&](const tk::StorageShape& shape, int stage, std::int64_t world) {
    return tk::predict_held(model, shape, stage, world).total() / 1000.0;
  };
  for (const std::int64_t w : {2, 4}) {
    const double d = static_cast<double>(w);
    CHECK(per_param(fp32, 0, w) == doctest::Approx(16));
    CHECK(per_param(fp32, 1, w) == doctest::Approx(8 + 8 / d));
    CHECK(per_param(fp32, 2, w) == doctest::Approx(4 + 8 / d));
    CHECK(per_param(fp32, 3, w) == doctest::Approx(12 / d));
    CHECK(per_param(master, 0, w) == doctest::Approx(16));
    CHECK(per_param(master, 1, w) == doctest::Approx(4 + 12 / d));
    CHECK(per_param(master, 2, w) == doctest::Approx(2 + 12 / d));
    // Stage 3 with master weights: the half slices (2), the masters (4), the moments (8).
    CHECK(per_param(master, 3, w) == doctest::Approx(14 / d));
  }
  // A world of one cut as several (DataParallel::shard_at_world_size_one) holds stage 3's 12 / 1.
  CHECK(per_param(fp32, 3, 1) == doctest::Approx(12));
  // The root unit and frozen parameters are whole on every rank; inside a step the largest unit
  // and those gathered ahead, or with reshard_after_forward false every unit.
  const tk::HeldBytes three = tk::predict_held({1000, 200, 300, 100}, fp32, 3, 4);
  CHECK(three.parameters == doctest::Approx(4.0 * (1000 / 4 + 200 + 100)));
  CHECK(three.gradients == 0);
  CHECK(three.gathered == doctest::Approx(4.0 * 300 * 2));  // (unit_prefetch 1: two units)
  CHECK(tk::predict_held({1000, 200, 300, 100}, {false, 2, false, 0, true}, 3, 4).gathered == doctest::Approx(4.0 * 300));
  CHECK(tk::predict_held({1000, 200, 300, 100}, {false, 2, false, 1, false}, 3, 4).gathered == doctest::Approx(4.0 * 800));
  // Inside a backward the units' fp32 gradients until reduce-scattered: the one filled and two in
  // flight, at most every unit's; without the overlap every unit's (half units' too: in fp32).
  CHECK(three.unit_gradients == doctest::Approx(4.0 * 800));  // (3 x 300 > the units' 800)
  CHECK(tk::predict_held({4000, 200, 300, 100}, fp32, 3, 4).unit_gradients == doctest::Approx(4.0 * 300 * 3));
  tk::StorageShape after = fp32;
  after.overlap_reduction = false;
  CHECK(tk::predict_held({4000, 200, 300, 100}, after, 3, 4).unit_gradients == doctest::Approx(4.0 * 3800));
  CHECK(tk::predict_held({4000, 200, 300, 100}, master, 3, 4).unit_gradients == doctest::Approx(4.0 * 300 * 3));
  CHECK(tk::predict_held({4000, 200, 300, 100}, fp32, 2, 4).unit_gradients == 0);
  CHECK(tk::held_summary({4000, 200, 300, 100}, fp32, 3, 4).find(", and 3.5 KiB more for the units' fp32 gradients "
                                                                  "inside a backward, until each is reduce-scattered") !=
        std::string::npos);
  // With master weights the root unit, the frozen parameters and the gathered units are half.
  const tk::HeldBytes half = tk::predict_held({1000, 200, 300, 100}, master, 3, 4);
  CHECK(half.parameters == doctest::Approx(2.0 * (1000 / 4 + 200 + 100)));
  CHECK(half.masters == doctest::Approx(4.0 * 1000 / 4));
  CHECK(half.gradients == 0);
  CHECK(half.gathered == doctest::Approx(2.0 * 300 * 2));
  // Stage 3 needs the units.
  CHECK_THROWS_WITH(tk::predict_held({1000, 0, 0, 0}, fp32, 3, 4), doctest::Contains("needs the model's units"));
  CHECK_THROWS_WITH(tk::predict_held({1000, 0, 0, 0}, master, 3, 4), doctest::Contains("needs the model's units"));
  // Master weights with several micro-batches keep an fp32 sum of the window's gradient.
  CHECK(tk::predict_held(model, {true, 2, true}, 0, 1).total() / 1000.0 == doctest::Approx(20));
  CHECK(tk::predict_held(model, {true, 2, true}, 1, 2).total() / 1000.0 == doctest::Approx(4 + 4 + 6));
  CHECK_THROWS_WITH(tk::predict_held(model, fp32, 4, 2), doctest::Contains("stage must be 0-3"));
  CHECK(tk::StorageShape::optimizer_values_of(tk::OptimizerSettings{"SGD", 0.1, 0, 0.0}) == 0);
  CHECK(tk::StorageShape::optimizer_values_of(tk::OptimizerSettings{"SGD", 0.1, 0, 0.9}) == 1);
  CHECK(tk::StorageShape::optimizer_values_of(tk::OptimizerSettings{"AdamW"}) == 2);
  const auto lines = tk::held_table({110'000'000, 0, 7'000'000, 0}, fp32, 4);
  REQUIRE(lines.size() == 4);  // 1, 2, 4, 8 ranks
  CHECK(lines[0] == "  1 rank:  every stage 1.64 GiB");
  CHECK(lines[2] == "  4 ranks: stage 0 1.64 GiB, 1 1.02 GiB, 2 629.4 MiB, 3 314.7 MiB (+ 53.4 MiB gathered, + 80.1 MiB "
                    "gradients)");
  CHECK(tk::held_table({110'000'000, 0, 0, 0}, fp32, 4)[2] == "  4 ranks: stage 0 1.64 GiB, 1 1.02 GiB, 2 629.4 MiB, 3 needs the units");
  const std::string said = tk::held_summary({110'000'000, 0, 0, 0}, master, 2, 4);
  CHECK(said.find("each rank will hold 524.5 MiB") == 0);  // (2 + 12 / 4 bytes per parameter)
  CHECK(said.find("(3: name the units to see it)") != std::string::npos);
  // With the units known, stage 3 with master weights too: 14 / 4 bytes per parameter.
  CHECK(tk::held_summary({110'000'000, 0, 7'000'000, 0}, master, 2, 4).find(", 3 367.2 MiB") != std::string::npos);
}

TEST_CASE("predict_held: stage 3 without master weights counts autocast's half copies of every unit, and says so") {
  // Autocast saves each unit's half copy of its weights for the backward: the units' whole model
  // at 2 bytes a parameter from the forward to the backward, on top of the units gathered.
  const tk::ModelSize model{1000, 200, 300, 100};
  tk::StorageShape fp32{false, 2, false}, bf16{false, 2, false}, master{true, 2, false};
  bf16.autocast_copies = master.autocast_copies = true;  // (master weights: the weights are half, no copies)
  CHECK(tk::predict_held(model, bf16, 3, 4).autocast == doctest::Approx(2.0 * 800));
  CHECK(tk::predict_held(model, bf16, 3, 4).total() == tk::predict_held(model, fp32, 3, 4).total());  // (inside a step)
  CHECK(tk::predict_held(model, bf16, 3, 4).gathered == tk::predict_held(model, fp32, 3, 4).gathered);
  CHECK(tk::predict_held(model, fp32, 3, 4).autocast == 0);
  CHECK(tk::predict_held(model, master, 3, 4).autocast == 0);
  for (const int stage : {0, 1, 2}) CHECK(tk::predict_held(model, bf16, stage, 4).autocast == 0);
  const std::string said = tk::held_summary({110'000'000, 0, 7'000'000, 0}, bf16, 3, 4);
  CHECK(said.find(", and 209.8 MiB more for autocast's half copies of every unit's weights, which live from each "
                  "unit's forward to its backward") != std::string::npos);
  CHECK(said.find("with tk::MasterWeights the units are gathered as half copies") != std::string::npos);
  CHECK(tk::held_summary({110'000'000, 0, 7'000'000, 0}, fp32, 3, 4).find("autocast") == std::string::npos);
  CHECK(tk::held_table({110'000'000, 0, 7'000'000, 0}, bf16, 4)[2] ==
        "  4 ranks: stage 0 1.64 GiB, 1 1.02 GiB, 2 629.4 MiB, 3 314.7 MiB (+ 53.4 MiB gathered, + 80.1 MiB gradients, "
        "+ 209.8 MiB autocast's copies)");
}

TEST_CASE_TEMPLATE("a trainer in one process holds what it predicts, once its optimizer's state exists", T,
                   Combo<tk::FP32, 1>, Combo<tk::BF16, 2>, Combo<tk::MasterWeights<tk::FP16Dynamic>, 1>,
                   Combo<tk::MasterWeights<tk::BF16>, 2>) {
  for (const std::string optimizer : {"AdamW", "SGD momentum", "SGD"}) {
    CAPTURE(optimizer);
    Net model;
    auto make = [&]() -> typename T::trainer {
      if (optimizer == "AdamW") return typename T::trainer(model, tk::AdamW{1e-3});
      return typename T::trainer(model, tk::SGD{0.1, optimizer == "SGD" ? 0.0 : 0.9});
    };
    typename T::trainer trainer = make();
    const tk::ModelSize size = trainer.model_size();
    CHECK(size.trained == 32 * 64 + 64 + 64 * 32 + 32);
    CHECK(size.frozen == 32 * 32 + 32);
    CHECK(size.root == size.trained);  // (no units)
    CHECK(trainer.storage_shape().optimizer_values == (optimizer == "AdamW" ? 2 : optimizer == "SGD" ? 0 : 1));
    // Autocast copies fp32 weights to half where the model is fp32 and the forward half (BF16).
    CHECK(trainer.storage_shape().autocast_copies == std::is_same_v<T, Combo<tk::BF16, 2>>);
    const auto x = torch::randn({4, 32});
    for (int step = 0; step < 2 * T::n; ++step) trainer.micro_step([&] { return model->forward(x).square().mean(); });
    const double predicted = trainer.predicted_held().total();
    MESSAGE(T::trainer::name() << " " << optimizer << ": held " << trainer.held_bytes() << " bytes, predicted "
                               << predicted);
    CHECK(static_cast<double>(trainer.held_bytes()) == predicted);
  }
}

TEST_CASE("a stage-3 trainer holds the model once until its replicas are attached; in one process it then trains as "
          "stage 0, holding what it predicts (FP32 and master weights)") {
  Net model;
  tk::Trainer<> trainer(model, tk::AdamW{1e-3}, tk::TrainerOptions().sharding(tk::Sharding::parameters).units({"a", "b"}));
  const tk::ModelSize size = trainer.model_size();
  CHECK(size.root == 0);
  CHECK(size.largest_unit == 32 * 64 + 64);
  // The parameters alone (the flat copy and the frozen layer): no gradient, no optimizer state yet.
  CHECK(trainer.held_bytes() == 4 * (size.trained + size.frozen));
  const auto x = torch::randn({4, 32});
  for (int step = 0; step < 2; ++step) trainer.micro_step([&] { return model->forward(x).square().mean(); });
  CHECK(trainer.sharding_stage() == 0);  // (one process shards nothing)
  CHECK(static_cast<double>(trainer.held_bytes()) == trainer.predicted_held().total());
  CHECK(trainer.held_bytes() == 16 * size.trained + 4 * size.frozen);

  // With master weights: the fp32 masters and the half model (the frozen layer half too), the
  // half gradient released until a backward needs it.
  Net half_model;
  tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::BF16>>> master(
      half_model, tk::AdamW{1e-3}, tk::TrainerOptions().sharding(tk::Sharding::parameters).units({"a", "b"}));
  CHECK(master.held_bytes() == 6 * size.trained + 2 * size.frozen);
  for (int step = 0; step < 2; ++step) master.micro_step([&] { return half_model->forward(x).square().mean(); });
  CHECK(static_cast<double>(master.held_bytes()) == master.predicted_held().total());
  CHECK(master.held_bytes() == 16 * size.trained + 2 * size.frozen);
}

}  // namespace test_held_bytes
