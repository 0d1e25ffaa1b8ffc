// The progress line: h:mm:ss, the plain periodic lines of a log file, the redrawn line of a
// terminal (throttled, cut to its width), rate smoothing, messages and epoch changes. The
// clock, the stream and the terminal flag are injected.
#include "../support/helpers.hpp"

#include <trainkit/log/progress.hpp>

#include <sstream>

namespace test_progress {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

struct Fixture {
  double now = 0;
  std::ostringstream out;
  tk::ProgressOptions options(bool terminal) {
    tk::ProgressOptions o;
    o.out = &out;
    o.terminal = terminal;
    o.clock = [this] { return now; };
    return o;
  }
};

tk::ProgressState state_at(std::int64_t epoch, std::int64_t step, std::int64_t samples) {
  tk::ProgressState s;
  s.epoch = epoch;
  s.step = step;
  s.total = 100;
  s.samples = samples;
  s.loss = 0.5;
  s.lr = 1e-3;
  s.loss_scale = 1024;
  return s;
}

}  // namespace

TEST_CASE("progress: durations as h:mm:ss") {
  using tk::detail::format_hms;
  CHECK(format_hms(0) == "0:00:00");
  CHECK(format_hms(59.6) == "0:01:00");
  CHECK(format_hms(3725) == "1:02:05");
  CHECK(format_hms(360000) == "100:00:00");
  CHECK(format_hms(-1) == "-:--:--");
  CHECK(format_hms(std::numeric_limits<double>::quiet_NaN()) == "-:--:--");
  CHECK(format_hms(std::numeric_limits<double>::infinity()) == "-:--:--");
}

TEST_CASE("progress: not a terminal, a plain line every every_steps steps, smoothed rates") {
  Fixture f;
  auto options = f.options(false);
  options.every_steps = 10;
  options.every_seconds = 0;
  options.smoothing = 0.5;
  {
    tk::ProgressLine progress(options);
    CHECK_FALSE(progress.is_terminal());
    progress.update(state_at(1, 0, 0));  // the epoch's start: nothing printed
    CHECK(f.out.str().empty());
    for (int step = 1; step <= 10; ++step) {
      f.now = 0.1 * step;  // 1 s for 10 steps of 32 samples
      progress.update(state_at(1, step, 32 * step));
    }
    CHECK(f.out.str() ==
          "Epoch 1  10%  10/100 | 0:00:01 epoch ETA 0:00:09 | 100 ms/step | 320.0 samples/s | loss 0.5 lr 0.001 scale 1024\n");
    f.out.str("");
    for (int step = 11; step <= 20; ++step) {
      f.now = 1 + 0.2 * (step - 10);  // 2 s for the next 10: averages 1.5 s per 10 steps
      progress.update(state_at(1, step, 32 * step));
    }
    CHECK(f.out.str() ==
          "Epoch 1  20%  20/100 | 0:00:03 epoch ETA 0:00:12 | 150 ms/step | 213.3 samples/s | loss 0.5 lr 0.001 scale 1024\n");
    f.out.str("");
    f.now = 4;
    progress.update(state_at(1, 25, 800));  // not due
    CHECK(f.out.str().empty());
    progress.message("checkpoint written");
    CHECK(f.out.str() == "checkpoint written\n");
    f.out.str("");
    progress.finish();  // prints the latest state
    CHECK(f.out.str().find("Epoch 1  25%  25/100 | 0:00:04") == 0);
    f.out.str("");
  }
  CHECK(f.out.str().empty());  // finished: the destructor adds nothing
}

TEST_CASE("progress: not a terminal, a line every every_seconds; unknown fields left out") {
  Fixture f;
  auto options = f.options(false);
  options.every_seconds = 30;
  tk::ProgressLine progress(options);
  tk::ProgressState state;
  state.epoch = 2;
  progress.update(state);
  f.now = 29;
  state.step = 5;
  progress.update(state);
  CHECK(f.out.str().empty());
  f.now = 30;
  state.step = 6;
  state.samples = 60;
  state.unit = "micro-batches";  // (a task without item counts: the fit loop counts micro-batches)
  progress.update(state);
  CHECK(f.out.str() == "Epoch 2 step 6 | 0:00:30 | 5 s/step | 2.0 micro-batches/s\n");  // no total: no percentage, no ETA
}

TEST_CASE("progress: on a terminal, one line redrawn in place, throttled, cut to the width") {
  Fixture f;
  auto options = f.options(true);
  options.refresh_seconds = 0.2;
  options.smoothing = 1;
  tk::ProgressLine progress(options);
  CHECK(progress.is_terminal());
  progress.update(state_at(0, 0, 0));  // drawn at once, no rate yet
  CHECK(f.out.str() ==
        "\rEpoch 0 [>                   ]   0%   0/100 | 0:00:00 epoch ETA -:--:-- | - s/step | - samples/s | loss 0.5 lr 0.001 "
        "scale 1024\x1b[K");
  f.out.str("");
  f.now = 0.1;
  progress.update(state_at(0, 1, 10));  // within refresh_seconds: not drawn
  CHECK(f.out.str().empty());
  f.now = 0.5;
  progress.update(state_at(0, 5, 50));
  CHECK(f.out.str() ==
        "\rEpoch 0 [=>                  ]   5%   5/100 | 0:00:01 epoch ETA 0:00:10 | 100 ms/step | 100.0 samples/s | loss 0.5 lr 0.001 "
        "scale 1024\x1b[K");
  f.out.str("");
  progress.message("saved");  // its own line, then the progress line again below it
  CHECK(f.out.str() == "\r\x1b[Ksaved\n\r" + progress.line() + "\x1b[K");
  f.out.str("");
  f.now = 0.6;
  progress.update(state_at(0, 6, 60));
  progress.finish();  // the latest state, and the line's newline
  CHECK(f.out.str() ==
        "\rEpoch 0 [=>                  ]   6%   6/100 | 0:00:01 epoch ETA 0:00:09 | 100 ms/step | 100.0 samples/s | loss 0.5 lr 0.001 "
        "scale 1024\x1b[K\n");

  Fixture narrow;
  auto cut = narrow.options(true);
  cut.columns = 21;
  tk::ProgressLine line(cut);
  line.update(state_at(3, 0, 0));
  CHECK(narrow.out.str() == "\rEpoch 3 [>          \x1b[K");  // 20 = columns - 1 characters
}

TEST_CASE("progress: a new epoch ends the previous line; the rates carry over, the pause between epochs does not count") {
  Fixture f;
  auto options = f.options(true);
  options.refresh_seconds = 0;
  options.smoothing = 1;
  tk::ProgressLine progress(options);
  progress.update(state_at(0, 0, 0));
  f.now = 1;
  progress.update(state_at(0, 100, 1000));  // 1000 samples/s
  f.out.str("");
  f.now = 2;  // a second of validation
  progress.update(state_at(1, 0, 0));
  CHECK(f.out.str() == "\n\rEpoch 1 [>                   ]   0%   0/100 | 0:00:02 epoch ETA 0:00:01 | 10 ms/step | 1000.0 samples/s | "
                       "loss 0.5 lr 0.001 scale 1024\x1b[K");
  f.out.str("");
  f.now = 3;  // 100 steps in 1 s again: the epoch boundary's second is not in the rate
  progress.update(state_at(1, 100, 1000));
  CHECK(f.out.str().find("100% 100/100 | 0:00:03 epoch ETA 0:00:00 | 10 ms/step | 1000.0 samples/s") != std::string::npos);
}

TEST_CASE("progress: std::cout and std::cerr are asked whether they are terminals") {
  tk::ProgressOptions options;
  options.out = &std::cout;
  tk::ProgressLine progress(options);
  CHECK(progress.is_terminal() == (::isatty(STDOUT_FILENO) == 1));
  std::ostringstream other;
  options.out = &other;
  CHECK_FALSE(tk::ProgressLine(options).is_terminal());
}

TEST_CASE("progress: a non-finite loss is shown as such, not left out") {
  Fixture f;
  auto options = f.options(false);
  options.every_steps = 1;
  options.every_seconds = 0;
  tk::ProgressLine progress(options);
  progress.update(state_at(1, 0, 0));  // the epoch's start: nothing printed
  auto s = state_at(1, 1, 32);
  s.loss = std::numeric_limits<double>::quiet_NaN();
  f.now = 0.1;
  progress.update(s);
  CHECK(f.out.str().find(" | loss nan lr 0.001") != std::string::npos);
  f.out.str("");
  s.step = 2, s.loss = std::numeric_limits<double>::infinity();
  f.now = 0.2;
  progress.update(s);
  CHECK(f.out.str().find(" | loss inf lr 0.001") != std::string::npos);
}

TEST_CASE("progress: the whole run's ETA and the epoch count, when the state has them") {
  Fixture f;
  auto options = f.options(false);
  options.every_steps = 10;
  options.every_seconds = 0;
  options.smoothing = 1;
  tk::ProgressLine progress(options);
  auto s = state_at(1, 0, 0);
  s.epochs = 3;
  s.run_total = 300;  // three epochs of 100 steps; this run started at epoch 0
  s.run_step = 100;
  progress.update(s);
  f.now = 1;
  s.step = 10, s.run_step = 110, s.samples = 320;
  progress.update(s);
  CHECK(f.out.str() == "Epoch 1/3  10%  10/100 | 0:00:01 ETA 0:00:19 | 100 ms/step | 320.0 samples/s | loss 0.5 lr 0.001 scale 1024\n");
}

}  // namespace test_progress
