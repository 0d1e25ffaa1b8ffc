// Parameters replaced after the trainer is built (issue 14, item 7): torch::load(model, file)
// swaps each parameter's storage, and the trainer would go on updating its own copy while the
// model reads the loaded one (before: 50 windows, no change, no error). The next optimizer
// phase refuses, naming the parameter and what to do; copying loads (tk::load_weights,
// Trainer::load) keep working.
#include "helpers.hpp"

#include <trainkit/trainer.hpp>
#include <trainkit/weights.hpp>

#include <torch/serialize.h>

TEST_CASE("torch::load after the trainer is built is refused at the next optimizer phase, naming the parameter") {
  testing::TempDir dir;
  auto source = testing::make_mlp(11);
  torch::save(source, dir / "weights.pt");

  auto model = testing::make_mlp(12);
  tk::Trainer<> trainer(model, tk::SGD{0.1});
  const auto data = testing::regression(16);
  auto loss = [&] { return torch::mse_loss(model(data.x), data.y); };
  trainer.micro_step(loss);  // the storage contract holds
  torch::load(model, dir / "weights.pt");
  CHECK_THROWS_WITH_AS(trainer.micro_step(loss), doctest::Contains("no longer lives in the trainer's storage"),
                       std::logic_error);
  CHECK(trainer.windows() == 1);  // nothing applied after the replacement
}

TEST_CASE("loading by copy after the trainer is built keeps training the model") {
  testing::TempDir dir;
  auto source = testing::make_mlp(11);
  tk::Trainer<> writer(source, tk::SGD{0.1});
  writer.save(dir / "source.ckpt");

  auto model = testing::make_mlp(12);
  tk::Trainer<> trainer(model, tk::SGD{0.1});
  const auto report = tk::load_weights(*model, dir / "source.ckpt");
  CHECK(report.not_loaded.empty());
  const auto data = testing::regression(16);
  const auto before = testing::flat(*model);
  trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  CHECK_FALSE(torch::equal(testing::flat(*model), before));  // the update reached the model
}
