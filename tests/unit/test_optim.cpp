// The fused optimizers match torch::optim on the same gradients over 20 steps; any
// torch::optim::Optimizer can be given instead (the unfused path).
#include "../support/helpers.hpp"

namespace test_optim {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;

namespace {

constexpr int kSteps = 20;

// kSteps micro-steps on the same batches: `trainer` on model a, and `reference` (when given) on b.
template <class Trainer>
void train_both(Trainer& trainer, testing::TinyMlp& a, torch::optim::Optimizer* reference, testing::TinyMlp& b) {
  const auto data = testing::regression(kSteps * 16);
  for (int k = 0; k < kSteps; ++k) {
    auto x = data.x.narrow(0, k * 16, 16), y = data.y.narrow(0, k * 16, 16);
    trainer.micro_step([&] { return torch::mse_loss(a(x), y); });
    if (reference == nullptr) continue;
    reference->zero_grad();
    torch::mse_loss(b(x), y).backward();
    reference->step();
  }
}

// Trains model `a` with a trainkit trainer and `b` with torch::optim on the same batches.
template <class Spec, class TorchOptimizer, class TorchOptions>
double compare(const Spec& spec, const TorchOptions& torch_options) {
  auto a = make_mlp(40), b = make_mlp(40);
  tk::Trainer<> trainer(a, spec);
  TorchOptimizer reference(b->parameters(), torch_options);
  train_both(trainer, a, &reference, b);
  const auto moved = testing::relative_error(testing::flat(*make_mlp(40)), testing::flat(*b));
  REQUIRE(moved > 1e-3);  // the comparison is not vacuous
  return testing::relative_error(testing::flat(*a), testing::flat(*b));
}

}  // namespace

TEST_CASE("fused SGD matches torch::optim::SGD (momentum, Nesterov, weight decay)") {
  using O = torch::optim::SGDOptions;
  CHECK(compare<tk::SGD, torch::optim::SGD>(tk::SGD{0.1}, O(0.1)) <= 1e-6);
  CHECK(compare<tk::SGD, torch::optim::SGD>(tk::SGD{0.05, 0.9, 1e-2},
                                            O(0.05).momentum(0.9).weight_decay(1e-2)) <= 1e-6);
  CHECK(compare<tk::SGD, torch::optim::SGD>(tk::SGD{0.05, 0.9, 0.0, true},
                                            O(0.05).momentum(0.9).nesterov(true)) <= 1e-6);
}

TEST_CASE("fused Adam matches torch::optim::Adam") {
  using O = torch::optim::AdamOptions;
  CHECK(compare<tk::Adam, torch::optim::Adam>(tk::Adam{1e-2}, O(1e-2)) <= 1e-6);
  CHECK(compare<tk::Adam, torch::optim::Adam>(tk::Adam{1e-2, 1e-2}.betas(0.8, 0.99).eps(1e-6),
                                              O(1e-2).weight_decay(1e-2).betas({0.8, 0.99}).eps(1e-6)) <= 1e-6);
}

TEST_CASE("fused AdamW matches torch::optim::AdamW") {
  using O = torch::optim::AdamWOptions;
  CHECK(compare<tk::AdamW, torch::optim::AdamW>(tk::AdamW{1e-2}, O(1e-2)) <= 1e-6);
  CHECK(compare<tk::AdamW, torch::optim::AdamW>(tk::AdamW{1e-2, 0.1}.eps(1e-6),
                                                O(1e-2).weight_decay(0.1).eps(1e-6)) <= 1e-6);
}

TEST_CASE("any torch::optim::Optimizer runs on the unfused path, skips included") {
  auto a = make_mlp(41), b = make_mlp(41);
  const auto data = testing::regression(64);
  auto optimizer = std::make_shared<torch::optim::Adagrad>(a->parameters(),
                                                           torch::optim::AdagradOptions(0.1));
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::AccumulationPolicy<2>,
              tk::ClipPolicy<tk::ClipNorm>>
      trainer(a, optimizer, tk::TrainerOptions().max_grad_norm(1e6));
  CHECK_FALSE(trainer.update_rule().fused());
  torch::optim::Adagrad reference(b->parameters(), torch::optim::AdagradOptions(0.1));
  for (int k = 0; k < 3; ++k) {
    for (int half = 0; half < 2; ++half) {
      auto x = data.x.narrow(0, half * 32, 32), y = data.y.narrow(0, half * 32, 32);
      trainer.micro_step([&] { return torch::mse_loss(a(x), y); });
    }
    reference.zero_grad();
    torch::mse_loss(b(data.x), data.y).backward();
    reference.step();
  }
  CHECK(testing::relative_error(testing::flat(*a), testing::flat(*b)) <= 2e-3);  // fp16 forward
  const auto params = testing::flat(*a);
  for (int half = 0; half < 2; ++half)
    trainer.micro_step([&] { return torch::mse_loss(a(data.x), data.y) * INFINITY; });
  CHECK(torch::equal(testing::flat(*a), params));
  CHECK(trainer.skipped_steps().item<std::int64_t>() == 1);
}

TEST_CASE("LR multipliers make parameter groups (VL-BERT's LR_MULT)") {
  auto model = make_mlp(42);
  const auto data = testing::regression(32);
  tk::Trainer<> trainer(model, tk::SGD{0.1}, tk::TrainerOptions().lr_mult({{"fc2", 0.0}}));
  CHECK(trainer.groups().size() == 2);
  const auto fc2_before = model->fc2->weight.clone();
  const auto fc1_before = model->fc1->weight.clone();
  trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  CHECK(torch::equal(model->fc2->weight, fc2_before));        // multiplier 0: frozen
  CHECK_FALSE(torch::equal(model->fc1->weight, fc1_before));  // multiplier 1: trained
}

TEST_CASE("no_decay: parameters named so get no weight decay (BERT's rule), matching torch::optim with two groups") {
  auto a = make_mlp(43), b = make_mlp(43);
  tk::Trainer<> trainer(a, tk::AdamW{1e-2, 0.5}, tk::TrainerOptions().no_decay({"bias"}).lr_mult({{"fc2", 0.5}}));
  // (LR multiplier, decay) groups in order of first appearance: fc1.weight, fc1.bias, fc2.weight, fc2.bias.
  REQUIRE(trainer.groups().size() == 4);
  CHECK(trainer.groups()[0].decay);
  CHECK_FALSE(trainer.groups()[1].decay);
  CHECK(trainer.groups()[2].lr_mult == 0.5);
  CHECK_FALSE(trainer.groups()[3].decay);
  using O = torch::optim::AdamWOptions;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{b->fc1->weight}, std::make_unique<O>(O(1e-2).weight_decay(0.5)));
  groups.emplace_back(std::vector<torch::Tensor>{b->fc1->bias}, std::make_unique<O>(O(1e-2).weight_decay(0.0)));
  groups.emplace_back(std::vector<torch::Tensor>{b->fc2->weight}, std::make_unique<O>(O(0.5e-2).weight_decay(0.5)));
  groups.emplace_back(std::vector<torch::Tensor>{b->fc2->bias}, std::make_unique<O>(O(0.5e-2).weight_decay(0.0)));
  torch::optim::AdamW reference(std::move(groups), O(1e-2));
  train_both(trainer, a, &reference, b);
  CHECK(testing::relative_error(testing::flat(*a), testing::flat(*b)) <= 1e-6);
  // The same run with decay everywhere ends elsewhere: the rule is not vacuous.
  auto c = make_mlp(43);
  tk::Trainer<> everywhere(c, tk::AdamW{1e-2, 0.5}, tk::TrainerOptions().lr_mult({{"fc2", 0.5}}));
  train_both(everywhere, c, nullptr, c);
  CHECK(testing::relative_error(testing::flat(*c), testing::flat(*b)) > 1e-4);

  auto d = make_mlp(43);
  CHECK_THROWS_WITH(tk::Trainer<>(d, tk::AdamW{1e-2}, tk::TrainerOptions().no_decay({"LayerNorm.weight"})),
                    doctest::Contains("no_decay (TRAIN.NO_DECAY) 'LayerNorm.weight' is in no trainable parameter's name"));
  auto e = make_mlp(43);
  auto sgd = std::make_shared<torch::optim::SGD>(e->parameters(), torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH(tk::Trainer<>(e, sgd, tk::TrainerOptions().no_decay({"bias"})),
                    doctest::Contains("applies to trainkit's optimizers"));
}

}  // namespace test_optim
