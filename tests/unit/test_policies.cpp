// Every policy combination compiles, names itself, re-exports its policies, and trains.
#include "../support/helpers.hpp"

#include <tuple>

namespace test_policies {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;

namespace {

// The Cartesian product of the policy lists, as a std::tuple of Trainer types.
template <class... Ts>
struct List {};
template <class... Tuples>
using tuple_cat_t = decltype(std::tuple_cat(std::declval<Tuples>()...));

template <class P, class A, class Cs>
struct WithClips;
template <class P, class A, class... Cs>
struct WithClips<P, A, List<Cs...>> {
  using type = std::tuple<tk::Trainer<P, A, Cs>...>;
};
template <class P, class As, class Cs>
struct WithAccs;
template <class P, class... As, class Cs>
struct WithAccs<P, List<As...>, Cs> {
  using type = tuple_cat_t<typename WithClips<P, As, Cs>::type...>;
};
template <class Ps, class As, class Cs>
struct Product;
template <class... Ps, class As, class Cs>
struct Product<List<Ps...>, As, Cs> {
  using type = tuple_cat_t<typename WithAccs<Ps, As, Cs>::type...>;
};

using Precisions = List<tk::PrecisionPolicy<tk::FP32>, tk::PrecisionPolicy<tk::BF16>,
                        tk::PrecisionPolicy<tk::FP16Static>, tk::PrecisionPolicy<tk::FP16Dynamic>>;
using Accumulations =
    List<tk::AccumulationPolicy<1>, tk::AccumulationPolicy<3>, tk::AccumulationPolicy<tk::Dynamic>>;
using Clips = List<tk::ClipPolicy<tk::NoClip>, tk::ClipPolicy<tk::ClipNorm>,
                   tk::ClipPolicy<tk::ClipValue>>;
using AllTrainers = Product<Precisions, Accumulations, Clips>::type;
static_assert(std::tuple_size_v<AllTrainers> == 36);

}  // namespace

TEST_CASE_TEMPLATE_DEFINE("every policy combination trains a tiny model", T, every_combination) {
  static_assert(tk::is_precision_policy<typename T::precision>::value);
  static_assert(tk::is_accumulation_policy<typename T::accumulation>::value);
  static_assert(tk::is_clip_policy<typename T::clip>::value);
  const auto expected_n = T::accumulation_steps == tk::Dynamic ? 2 : T::accumulation_steps;
  auto model = make_mlp(1, 8, 16, 4);
  auto data = testing::clusters(256);
  T trainer(model, tk::AdamW{1e-2, 0.0},
            tk::TrainerOptions().accumulation_steps(2).max_grad_norm(5.0).clip_value(1.0)
                .loss_scale(tk::LossScaleOptions().init_scale(1024.0)));
  CHECK(trainer.name().find(T::precision_mode::name) != std::string::npos);
  CHECK(trainer.name().find(T::clip_mode::name) != std::string::npos);

  double first = 0, last = 0;
  int windows = 0;
  for (int epoch = 0; epoch < 6; ++epoch) {
    for (int i = 0; i < 256; i += 32) {
      auto x = data.x.narrow(0, i, 32), y = data.y.narrow(0, i, 32);
      auto r = trainer.micro_step([&] { return torch::cross_entropy_loss(model(x), y); });
      if (r.window_closed) {
        ++windows;
        CHECK(r.report.micro_batches() == expected_n);
        CHECK(r.report.applied());
        CHECK(std::isfinite(r.report.grad_norm()));
        if (windows == 1) first = r.report.loss();
        last = r.report.loss();
      }
    }
    trainer.flush();
  }
  CHECK(trainer.skipped_steps().template item<std::int64_t>() == 0);
  CHECK(trainer.applied_steps().template item<std::int64_t>() == trainer.windows());
  // The loss must fall clearly: a broken update, scale or weighting would not.
  CHECK(last < 0.5 * first);
  CHECK(testing::accuracy(model, data) > 0.9);
}
TEST_CASE_TEMPLATE_APPLY(every_combination, AllTrainers);

TEST_CASE("policies are re-exported and the name is readable") {
  using T = tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::AccumulationPolicy<4>,
                        tk::ClipPolicy<tk::ClipNorm>>;
  static_assert(std::is_same_v<T::precision, tk::PrecisionPolicy<tk::FP16Dynamic>>);
  static_assert(std::is_same_v<T::accumulation, tk::AccumulationPolicy<4>>);
  static_assert(std::is_same_v<T::clip, tk::ClipPolicy<tk::ClipNorm>>);
  static_assert(T::accumulation_steps == 4 && T::scales_loss);
  CHECK(T::name() == "Trainer<FP16Dynamic, Accumulate<4>, ClipNorm>");
  CHECK(tk::Trainer<>::name() == "Trainer<FP32, Accumulate<1>, NoClip>");
  CHECK(tk::Trainer<tk::PrecisionPolicy<tk::BF16>, tk::AccumulationPolicy<tk::Dynamic>>::name() ==
        "Trainer<BF16, Accumulate<Dynamic>, NoClip>");
  static_assert(!tk::Trainer<>::scales_loss);
}

TEST_CASE("a report costs no sync until a value is asked for, then one copy") {
  auto model = make_mlp(2);
  auto data = testing::regression(64);
  tk::Trainer<> trainer(model, tk::SGD{0.1});
  auto r = trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  REQUIRE(r.window_closed);
  CHECK(r.report.window() == 1);  // host-known
  CHECK(r.report.step() == 1);
  CHECK(r.report.loss_scale() == 1.0);
  CHECK(r.report.lr() == doctest::Approx(0.1));
  CHECK(r.report.skipped_steps() == 0);
  auto r2 = trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  CHECK(r2.report.step() == 2);
  CHECK(r.report.step() == 1);  // each report keeps its own window's values
}

}  // namespace test_policies
