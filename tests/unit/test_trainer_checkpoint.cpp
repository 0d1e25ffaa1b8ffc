// Trainer::save / load: resume equals never stopping (bit for bit, dropout's RNG included);
// the file is written atomically; a mismatching checkpoint is refused, changing nothing.
#include "../support/helpers.hpp"

#include <dirent.h>
#include <unistd.h>

namespace test_trainer_checkpoint {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;
using testing::TempDir;

namespace {

using T = tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::AccumulationPolicy<2>,
                      tk::ClipPolicy<tk::ClipNorm>>;

tk::TrainerOptions options() {
  return tk::TrainerOptions()
      .partial_window(tk::PartialWindow::span)
      .loss_scale(tk::LossScaleOptions().init_scale(1024).growth_interval(3));
}

// Micro-batches [from, to) of a fixed data set; every 7th window overflows on purpose.
void run(T& trainer, testing::TinyMlp& model, const testing::Regression& data, int from, int to) {
  for (int i = from; i < to; ++i) {
    auto x = data.x.narrow(0, (i % 16) * 8, 8), y = data.y.narrow(0, (i % 16) * 8, 8);
    const double factor = i % 14 == 13 ? INFINITY : 1.0;
    trainer.micro_step([&] { return torch::mse_loss(model(x), y) * factor; });
  }
}

}  // namespace

TEST_CASE("resume equals never stopping, also from inside a window (span)") {
  TempDir dir;
  const auto data = testing::regression(128);
  const auto path = dir / "ckpt.pt";
  for (int stop : {20, 21}) {  // a window boundary, and the middle of a window
    CAPTURE(stop);
    auto straight = make_mlp(70, 8, 16, 3, 0.2);
    torch::manual_seed(123);
    T a(straight, tk::AdamW{1e-2}, options());
    run(a, straight, data, 0, 40);

    auto first = make_mlp(70, 8, 16, 3, 0.2);
    torch::manual_seed(123);
    T b(first, tk::AdamW{1e-2}, options());
    run(b, first, data, 0, stop);
    b.save(path);

    auto resumed = make_mlp(99, 8, 16, 3, 0.2);  // other weights and RNG: all must come back
    T c(resumed, tk::AdamW{1e-2}, options());
    c.load(path);
    CHECK(c.window_position() == stop % 2);
    run(c, resumed, data, stop, 40);

    CHECK(torch::equal(testing::flat(*straight), testing::flat(*resumed)));
    CHECK(torch::equal(a.loss_scale(), c.loss_scale()));
    CHECK(torch::equal(a.applied_steps(), c.applied_steps()));
    CHECK(torch::equal(a.skipped_steps(), c.skipped_steps()));
    CHECK(a.skipped_steps().item<std::int64_t>() > 0);
    CHECK(a.windows() == c.windows());
    auto& ma = dynamic_cast<tk::detail::FusedAdam<tk::AdamW, true>&>(a.update_rule());
    auto& mc = dynamic_cast<tk::detail::FusedAdam<tk::AdamW, true>&>(c.update_rule());
    CHECK(torch::equal(ma.exp_avg()[0], mc.exp_avg()[0]));
    CHECK(torch::equal(ma.step_count(), mc.step_count()));
  }
}

TEST_CASE("the checkpoint is written atomically: no temporary file is left behind") {
  TempDir dir;
  auto model = make_mlp(71);
  T trainer(model, tk::AdamW{1e-2}, options());
  const auto path = dir / "ckpt.pt";
  trainer.save(path);
  trainer.save(path);  // overwrite in place
  int files = 0;
  DIR* d = ::opendir(dir.path.c_str());
  REQUIRE(d != nullptr);
  while (auto* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    ++files;
    CHECK(name == "ckpt.pt");
  }
  ::closedir(d);
  CHECK(files == 1);
  CHECK_THROWS_WITH(trainer.save(dir / "missing/ckpt.pt"),
                    doctest::Contains("does not exist"));
}

TEST_CASE("a mismatching or damaged checkpoint is refused and changes nothing") {
  TempDir dir;
  const auto path = dir / "ckpt.pt";
  auto model = make_mlp(72);
  T trainer(model, tk::AdamW{1e-2}, options());
  trainer.save(path);

  SUBCASE("another trainer type") {
    auto other = make_mlp(73);
    tk::Trainer<> plain(other, tk::AdamW{1e-2});
    const auto before = testing::flat(*other);
    CHECK_THROWS_WITH(plain.load(path),
                      doctest::Contains("written by Trainer<FP16Dynamic, Accumulate<2>, ClipNorm>, "
                                        "this trainer is Trainer<FP32, Accumulate<1>, NoClip>"));
    CHECK(torch::equal(testing::flat(*other), before));
  }
  SUBCASE("other shapes") {
    auto wider = make_mlp(74, 8, 32, 3);
    T t(wider, tk::AdamW{1e-2}, options());
    const auto before = testing::flat(*wider);
    CHECK_THROWS_WITH(t.load(path), doctest::Contains("'fc1.weight' has shape [16, 8], the model's is [32, 8]"));
    CHECK(torch::equal(testing::flat(*wider), before));
  }
  SUBCASE("a truncated file") {
    REQUIRE(::truncate(path.c_str(), testing::file_size(path) / 2) == 0);
    auto m = make_mlp(75);
    T t(m, tk::AdamW{1e-2}, options());
    CHECK_THROWS_WITH(t.load(path), doctest::Contains(("checkpoint '" + path + "' is damaged: truncated").c_str()));
  }
}

}  // namespace test_trainer_checkpoint
