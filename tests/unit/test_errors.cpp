// Bad input gets an exception that names the problem.
#include "../support/helpers.hpp"

namespace test_errors {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;

TEST_CASE("the closure must return a scalar loss with a gradient") {
  auto model = make_mlp(60);
  const auto data = testing::regression(16);
  tk::Trainer<> trainer(model, tk::SGD{0.1});
  CHECK_THROWS_WITH_AS(trainer.micro_step([&] { return model(data.x); }),
                       doctest::Contains("scalar loss (one element), got a tensor of shape [16, 3]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(trainer.micro_step([&] {
    torch::NoGradGuard no_grad;
    return torch::mse_loss(model(data.x), data.y);
  }),
                       doctest::Contains("does not require grad"), std::invalid_argument);
  // Nothing was counted by the failed calls.
  CHECK(trainer.window_position() == 0);
  CHECK(trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); }).window_closed);
}

TEST_CASE("a model with no trainable parameters is refused") {
  auto model = make_mlp(61);
  for (auto& p : model->parameters()) p.set_requires_grad(false);
  CHECK_THROWS_WITH_AS(tk::Trainer<>(model, tk::SGD{0.1}),
                       doctest::Contains("no trainable parameters"), std::invalid_argument);
}

TEST_CASE("options out of range name the option") {
  auto model = make_mlp(62);
  auto make = [&](tk::TrainerOptions o) { tk::Trainer<> t(model, tk::SGD{0.1}, o); };
  CHECK_THROWS_WITH_AS(make(tk::TrainerOptions().max_grad_norm(-1)),
                       doctest::Contains("max_grad_norm must be > 0"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(make(tk::TrainerOptions().accumulation_steps(0)),
                       doctest::Contains("accumulation_steps must be >= 1"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      make(tk::TrainerOptions().loss_scale(tk::LossScaleOptions().backoff_factor(2))),
      doctest::Contains("loss_scale.backoff_factor must be in (0, 1)"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      make(tk::TrainerOptions().loss_scale(tk::LossScaleOptions().growth_interval(0))),
      doctest::Contains("loss_scale.growth_interval"), std::invalid_argument);
  CHECK_THROWS_WITH(tk::Trainer<>(model, tk::SGD{-0.1}),
                    doctest::Contains("SGD: the learning rate must be finite and > 0"));
  CHECK_THROWS_WITH(tk::Trainer<>(model, tk::AdamW{1e-3}.betas(1.0, 0.9)),
                    doctest::Contains("betas must be in [0, 1)"));
}

TEST_CASE("parameters must be fp32 and on one device") {
  auto model = make_mlp(63);
  model->fc2->to(torch::kDouble);
  CHECK_THROWS_WITH(tk::Trainer<>(model, tk::SGD{0.1}),
                    doctest::Contains("parameter 'fc2.weight' is Double"));
}

TEST_CASE("replacing the trainer's gradients is caught") {
  auto model = make_mlp(64);
  const auto data = testing::regression(16);
  tk::Trainer<> trainer(model, tk::SGD{0.1});
  model->zero_grad();  // sets every .grad to undefined
  CHECK_THROWS_WITH_AS(trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); }),
                       doctest::Contains("the .grad of parameter 'fc1.weight' was replaced"),
                       std::logic_error);
}

}  // namespace test_errors
