// Writes a TensorBoard event file and, alongside, what it wrote as JSON lines: the input of
// read_back.py, which reads the event file with TensorBoard's own reader and compares.
// Includes only trainkit's log headers and is built without LibTorch's include path: it also
// checks that these headers stand alone.
//   write_scalars <dir>    ->  <dir>/run/events.out.tfevents.*, <dir>/expected.jsonl, and a
//                              resumed run: <dir>/resumed/ (two event files), <dir>/resumed.jsonl
#include <trainkit/log/progress.hpp>
#include <trainkit/log/scalars.hpp>
#include <trainkit/log/tensorboard.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include <unistd.h>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  namespace tags = trainkit::scalar_tags;
  try {
    trainkit::TensorBoardOptions options;
    options.flush.every_records = 7;  // several buffered writes
    trainkit::TensorBoardWriter events(dir + "/run", options);
    trainkit::TextLogOptions text;
    text.append = false;
    trainkit::JsonlScalarWriter expected(dir + "/expected.jsonl", text);
    const auto add = [&](const std::string& tag, double value, std::int64_t step) {
      const double wall_time = 1.7e9 + 0.001 * static_cast<double>(step);
      events.add_scalar(tag, value, step, wall_time);
      expected.add_scalar(tag, value, step, wall_time);
    };

    // A training run's scalars: every tag the fit loop logs, values over many magnitudes.
    std::uint64_t state = 12345;
    const auto uniform = [&] {  // deterministic, in [0, 1)
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<double>(state >> 11) / 9007199254740992.0;
    };
    const std::vector<std::string> run_tags = {
        tags::train_loss,         tags::lr_group(0),   tags::lr_group(1),
        tags::grad_norm,          tags::loss_scale,    tags::skipped_steps,
        tags::samples_per_second, tags::validation("Acc"), tags::validation("précision")};
    for (std::int64_t step = 0; step < 300; step += 3) {
      for (const auto& tag : run_tags) {
        add(tag, std::ldexp(uniform() - 0.3, static_cast<int>(uniform() * 80) - 40), step);
      }
    }
    // Edge values and steps: float32's limits and beyond, non-finite values, signed zero, a
    // 10-byte (negative) and a large step varint, a tag longer than 127 bytes.
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    const std::vector<double> edges = {0.0,     -0.0, 0.1, 1e-45, 1.17549435e-38, 3.4028234e38,
                                       1e39,    -1e39, nan, inf, -inf, 123456789.123};
    std::int64_t step = 1000;
    for (const double value : edges) add("edge/values", value, step++);
    add("edge/steps", 1.0, -5);
    add("edge/steps", 2.0, std::int64_t{1} << 40);
    add("edge/steps", 3.0, std::numeric_limits<std::int64_t>::max());
    add(std::string(150, 'T'), 4.0, 1);
    events.close();
    expected.close();
    std::printf("wrote %s\n", events.path().c_str());

    // A run stopped after step 23 whose last checkpoint was at step 14, then resumed there, as
    // the fit loop does it: each run starts its event file with a session start at the step it
    // continues from, and the JSON-lines log is cut back to the checkpoint before the second run
    // appends. What TensorBoard shows must be that log: each (tag, step) once.
    const std::string log = dir + "/resumed.jsonl";
    ::unlink(log.c_str());
    const auto run = [&](std::int64_t first, std::int64_t last) {
      trainkit::TensorBoardWriter resumed(dir + "/resumed", options);
      resumed.session_start(first);
      trainkit::JsonlScalarWriter text_log(log);  // appends, as the fit loop's
      for (std::int64_t step = first; step <= last; ++step) {
        for (const char* tag : {tags::train_loss, "Val-Acc"}) {
          const double value = 1.0 / static_cast<double>(step + 1) + (first > 0 ? 0.5 : 0.0);
          const double wall_time = 1.7e9 + static_cast<double>(step) + (first > 0 ? 100.0 : 0.0);
          resumed.add_scalar(tag, value, step, wall_time);
          text_log.add_scalar(tag, value, step, wall_time);
        }
      }
    };
    run(1, 23);
    const std::size_t dropped = trainkit::drop_points_after(log, 14);
    if (dropped != 2 * 9) {
      std::fprintf(stderr, "write_scalars: drop_points_after dropped %zu lines, expected 18\n", dropped);
      return 1;
    }
    run(15, 30);
    std::printf("wrote %s/resumed (two runs, resumed at step 15)\n", dir.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "write_scalars: %s\n", e.what());
    return 1;
  }
  return 0;
}
