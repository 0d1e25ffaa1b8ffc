// LR schedules against VL-BERT's closed forms at chosen steps. The expected values come from
// VL-BERT's WarmupMultiStepLR and pytorch_pretrained_bert's WarmupLinearSchedule /
// WarmupCosineSchedule, driven as VL-BERT's common/trainer.py drives them (scheduler.step()
// before optimizer.step(), so update k runs at position k + 1), and from
// torch.optim.lr_scheduler.ReduceLROnPlateau with VL-BERT's arguments.
#include <trainkit/config/config.hpp>
#include <trainkit/run/plan.hpp>

#include <doctest/doctest.h>

#include <limits>

#include <vector>

namespace test_schedule {  // this file's names, apart from those of the files it shares a unity batch with

namespace tk = trainkit;
using doctest::Approx;

namespace {
tk::Warmup linear_warmup(double factor, std::int64_t steps) { return {tk::WarmupMethod::linear, factor, steps}; }
}  // namespace

TEST_CASE("EpochClock converts epochs with the real windows per epoch") {
  // 1001 micro-batches, 4 per window.
  CHECK(tk::EpochClock::flush(1001, 4).windows_per_epoch() == 251);  // the partial window is flushed
  CHECK(tk::EpochClock::drop(1001, 4).windows_per_epoch() == 250);   // ... or dropped
  CHECK(tk::EpochClock::span(1001, 4).windows_per_epoch() == Approx(250.25));
  CHECK(tk::EpochClock::flush(1001, 4).step_at(14) == 14 * 251);
  CHECK(tk::EpochClock::drop(1001, 4).step_at(14) == 14 * 250);
  CHECK(tk::EpochClock::span(1001, 4).step_at(14) == 3503);  // VL-BERT: int(14 * 1001 / 4)
  CHECK(tk::EpochClock::flush(1001, 4).step_at(14.5) == 3639);  // LR_STEP epochs may be fractional
  CHECK(tk::EpochClock::windows(100).step_at(3) == 300);
  // An epoch whose step is past int64 is never reached (found by the fuzz target: LR_STEP
  // [7, 1.9e105] was a float-to-integer overflow, undefined behaviour).
  CHECK(tk::EpochClock::flush(1001, 4).step_at(1.9e105) == std::numeric_limits<std::int64_t>::max());
  CHECK(tk::EpochClock::flush(1001, 4).step_at(std::numeric_limits<double>::infinity()) == std::numeric_limits<std::int64_t>::max());
  CHECK(tk::EpochClock::flush(1001, 4).step_at(3.7e16) == std::numeric_limits<std::int64_t>::max());  // 251 x 3.7e16 > 2^63
  CHECK_THROWS_AS(tk::EpochClock::flush(0, 4), std::invalid_argument);
}

TEST_CASE("step: VL-BERT's WarmupMultiStepLR, linear and constant warmup") {
  // 1000 micro-batches per epoch, 4 per window -> 250 windows; LR_STEP 14,18 -> 3500, 4500.
  const tk::EpochClock clock = tk::EpochClock::flush(1000, 4);
  tk::ScheduleOptions o;
  o.name = "step";
  o.warmup = linear_warmup(1.0 / 3, 1000);
  o.factor = 0.1;
  o.milestones = {14, 18};
  const auto s = tk::make_schedule(o, clock);
  CHECK(s->factor(0) == Approx(0.334));                 // warmup start: position 1 of 1000
  CHECK(s->factor(499) == Approx(0.6666666666666666));  // half way
  CHECK(s->factor(998) == Approx(0.9993333333333333));  // last warmup update
  CHECK(s->factor(999) == 1.0);                         // warmup end
  CHECK(s->factor(3498) == 1.0);
  CHECK(s->factor(3499) == Approx(0.1));                // first milestone (position 3500)
  CHECK(s->factor(4498) == Approx(0.1));
  CHECK(s->factor(4499) == Approx(0.01));               // second milestone
  CHECK(s->factor(4999) == Approx(0.01));               // the last step of 20 epochs
  CHECK(s->describe() == "step(warmup linear 1000 steps from 0.333333; x0.1 at steps [3500, 4500])");

  o.warmup.method = tk::WarmupMethod::constant;
  const auto c = tk::make_schedule(o, clock);
  CHECK(c->factor(0) == Approx(1.0 / 3));
  CHECK(c->factor(998) == Approx(1.0 / 3));
  CHECK(c->factor(999) == 1.0);
  CHECK(c->factor(3499) == Approx(0.1));

  o.warmup.steps = 0;  // WARMUP: false
  const auto n = tk::make_schedule(o, clock);
  CHECK(n->factor(0) == 1.0);
  CHECK(n->factor(3499) == Approx(0.1));
}

TEST_CASE("triangle: VL-BERT's WarmupLinearSchedule, linear to 0 at the last update") {
  // END_EPOCH 5, 1000 windows per epoch -> t_total 5000; WARMUP_STEPS 500 from 0.
  tk::ScheduleOptions o;
  o.name = "triangle";
  o.warmup = linear_warmup(0.0, 500);
  o.end_epoch = 5;
  const auto s = tk::make_schedule(o, tk::EpochClock::windows(1000));
  CHECK(s->factor(0) == Approx(0.002));  // warmup start
  CHECK(s->factor(249) == Approx(0.5));
  CHECK(s->factor(499) == Approx(1.0));  // warmup end
  CHECK(s->factor(500) == Approx(0.9997777777777778));
  CHECK(s->factor(2749) == Approx(0.5));
  CHECK(s->factor(4998) == Approx(0.00022222222222222223));
  CHECK(s->factor(4999) == 0.0);  // the last optimizer step
  CHECK(s->factor(5000) == 0.0);
  CHECK(s->describe() == "triangle(warmup linear 500 steps from 0; linear to 0 at step 5000)");

  o.end_epoch = 0;
  CHECK_THROWS_AS(tk::make_schedule(o, tk::EpochClock::windows(1000)), std::invalid_argument);
}

TEST_CASE("cosine: half a cosine to 0 at the last update") {
  tk::ScheduleOptions o;
  o.name = "cosine";
  o.warmup = linear_warmup(0.0, 500);
  o.end_epoch = 5;
  const auto s = tk::make_schedule(o, tk::EpochClock::windows(1000));
  CHECK(s->factor(0) == Approx(0.002));
  CHECK(s->factor(499) == Approx(1.0));
  CHECK(s->factor(1624) == Approx(0.8535533905932737));
  CHECK(s->factor(2749) == Approx(0.5));
  CHECK(s->factor(4999) == Approx(0.0));
  CHECK(s->factor(7000) == Approx(0.0));
}

TEST_CASE("constant: warmup, then 1") {
  tk::ScheduleOptions o;
  o.name = "constant";
  CHECK(tk::make_schedule(o, tk::EpochClock::windows(10))->factor(12345) == 1.0);
  CHECK(tk::make_schedule(o, tk::EpochClock::windows(10))->describe() == "constant");
  o.warmup = linear_warmup(0.5, 4);
  const auto s = tk::make_schedule(o, tk::EpochClock::windows(10));
  CHECK(s->factor(0) == Approx(0.625));
  CHECK(s->factor(2) == Approx(0.875));
  CHECK(s->factor(3) == 1.0);
}

TEST_CASE("plateau: ReduceLROnPlateau(mode max, patience 1, cooldown 2), state round-trips") {
  tk::ScheduleOptions o;
  o.name = "plateau";
  o.factor = 0.1;
  auto s = tk::make_schedule(o, tk::EpochClock::windows(10));
  // torch.optim.lr_scheduler.ReduceLROnPlateau with VL-BERT's arguments, same metrics.
  const std::vector<double> metrics = {0.5, 0.5, 0.4, 0.3, 0.3, 0.3, 0.3, 0.6, 0.6, 0.6, 0.6};
  const std::vector<double> expected = {1.0, 1.0, 0.1, 0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.01, 0.001};
  std::string saved;
  for (std::size_t e = 0; e < metrics.size(); ++e) {
    const double before = s->factor(0);
    const bool changed = s->on_epoch_end(static_cast<std::int64_t>(e), metrics[e]);
    CAPTURE(e);
    CHECK(s->factor(0) == Approx(expected[e]));
    CHECK(changed == (s->factor(0) != before));
    if (e == 4) saved = s->state();
  }
  // Resuming after epoch 4 and seeing the same metrics gives the same factors.
  auto resumed = tk::make_schedule(o, tk::EpochClock::windows(10));
  resumed->load_state(saved);
  CHECK(resumed->state() == saved);
  for (std::size_t e = 5; e < metrics.size(); ++e) {
    resumed->on_epoch_end(static_cast<std::int64_t>(e), metrics[e]);
    CHECK(resumed->factor(0) == Approx(expected[e]));
  }
  CHECK(resumed->state() == s->state());
  CHECK_THROWS_AS(resumed->load_state("step 1 2 3"), std::invalid_argument);

  // A NaN metric is never an improvement.
  auto n = tk::make_schedule(o, tk::EpochClock::windows(10));
  n->on_epoch_end(0, 1.0);
  n->on_epoch_end(1, std::nan(""));
  CHECK(n->on_epoch_end(2, std::nan("")));
  CHECK(n->factor(0) == Approx(0.1));
}

TEST_CASE("schedules are pure functions of the applied step") {
  tk::ScheduleOptions o;
  o.name = "step";
  o.warmup = linear_warmup(0.1, 10);
  o.milestones = {1, 2};
  const auto s = tk::make_schedule(o, tk::EpochClock::windows(20));
  // The same step gives the same value whatever was asked before (the trainer evaluates a
  // table; skipped steps do not move the applied-step position it is indexed with).
  const double at_25 = s->factor(25);
  for (std::int64_t k = 0; k < 60; ++k) s->factor(k);
  CHECK(s->factor(25) == at_25);
  CHECK(s->factor(18) == 1.0);
  CHECK(s->factor(19) == Approx(0.1));
}

TEST_CASE("RunPlan::make_schedule uses TRAIN's keys and the real windows per epoch") {
  tk::Config c;
  c.load_string(R"({"TRAIN": {"LR_SCHEDULE": "step", "LR_STEP": "2,3", "WARMUP": true,
                               "WARMUP_STEPS": 5, "WARMUP_FACTOR": 0.0, "GRAD_ACCUMULATE_STEPS": 4,
                               "END_EPOCH": 4}})",
                tk::Config::Format::json);
  // 41 micro-batches per epoch: flush -> 11 windows per epoch, milestones at 22 and 33.
  auto s = tk::RunPlan::from(c, 1).make_schedule(41);
  CHECK(s->factor(0) == Approx(0.2));
  CHECK(s->factor(4) == 1.0);
  CHECK(s->factor(20) == 1.0);
  CHECK(s->factor(21) == Approx(0.1));
  CHECK(s->factor(32) == Approx(0.01));
  c.set("TRAIN.PARTIAL_WINDOW=span");  // VL-BERT's own behaviour: int(2 * 41 / 4) = 20
  CHECK(tk::RunPlan::from(c, 1).make_schedule(41)->factor(19) == Approx(0.1));
  c.set("TRAIN.PARTIAL_WINDOW=drop");  // 10 windows per epoch
  CHECK(tk::RunPlan::from(c, 1).make_schedule(41)->factor(19) == Approx(0.1));
  CHECK(tk::RunPlan::from(c, 1).make_schedule(41)->factor(18) == 1.0);

  c.set("TRAIN.LR_SCHEDULE=triangle");
  c.set("TRAIN.END_EPOCH=0");
  try {
    tk::RunPlan::from(c, 1).make_schedule(41);
    FAIL("expected a ConfigError");
  } catch (const tk::ConfigError& e) {
    CHECK(e.path() == "TRAIN.END_EPOCH");
  }
  CHECK(tk::describe(tk::RunPlan::from(c, 1).schedule) == "triangle(warmup linear 5 steps from 0; linear to 0 at epoch 0)");
}

}  // namespace test_schedule
