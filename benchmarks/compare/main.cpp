// compare: one implementation on one configuration, one JSON line on stdout (driver.py runs
// the processes, interleaved, and prints the tables; loop.py is the Python side).
//
//   build/benchmarks/compare/compare --impl trainkit|branching|libtorch|fwdbwd --model bert-tiny
//       --precision fp32|bf16|fp16|fp16master|bf16master --accum 4 [--micro-batch B] [--seq S]
//       [--windows 5] [--warmup 2] [--threads 2] [--bandwidth 0|1] [--count-ops 0|1] [--interleave-fwdbwd 0|1]
//
// Figures: the time of each window (its N micro-steps and the optimizer phase), the optimizer
// phase alone (from the end of the window's last backward to the end of zeroing), peak resident
// memory (VmHWM, read before the bandwidth test allocates), and the copy bandwidth over as many
// floats as the model has parameters, from which the optimizer phase's floor follows. With
// --count-ops 1 (a separate run: counting costs time), the ATen operator calls of each phase.
// --impl fwdbwd times the windows' micro-steps alone (no optimizer phase) and, after the
// bandwidth test, one at::_fused_adamw_ step + zeroing over the model's parameter count.
// --interleave-fwdbwd 1 (trainkit): after each window, its forward + backward alone, timed in
// the same process (fwdbwd_ms), so that window / (fwdbwd + floor) pairs neighbouring windows.
#include "harness.hpp"

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <stdexcept>

namespace {

bench::Settings parse(int argc, char** argv, bool& bandwidth, bool& count_ops) {
  bench::Settings s;
  if (const char* t = std::getenv("TRAINKIT_BENCH_THREADS")) s.threads = std::atoi(t);
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(key + " needs a value");
    const std::string value = argv[++i];
    if (key == "--impl") s.impl = value;
    else if (key == "--model") s.model = value;
    else if (key == "--precision") s.precision = value;
    else if (key == "--accum") s.accum = std::stoll(value);
    else if (key == "--micro-batch") s.micro_batch = std::stoll(value);
    else if (key == "--seq") s.seq = std::stoll(value);
    else if (key == "--windows") s.windows = std::stoll(value);
    else if (key == "--warmup") s.warmup = std::stoll(value);
    else if (key == "--threads") s.threads = std::stoi(value);
    else if (key == "--bandwidth") bandwidth = value != "0";
    else if (key == "--count-ops") count_ops = value != "0";
    else if (key == "--interleave-fwdbwd") s.interleave_fwdbwd = value != "0";
    else throw std::invalid_argument("unknown option " + key);
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) try {
  bool bandwidth = true, count_ops = false;
  auto s = parse(argc, argv, bandwidth, count_ops);
  torch::set_num_threads(s.threads);
  if (count_ops) bench::count_ops();
  const auto rss_start = bench::status_kib("VmRSS");
  auto task = bench::make_task(s.model, s.micro_batch, s.seq, s.device);
  const auto params = bench::parameter_count(*task.module);
  const auto tensors = task.module->parameters().size();

  bench::Result r;
  if (s.impl == "trainkit") r = bench::run_trainkit(s, task);
  else if (s.impl == "branching") r = bench::run_branching(s, task);
  else if (s.impl == "libtorch") r = bench::run_libtorch(s, task);
  else if (s.impl == "fwdbwd") r = bench::run_fwdbwd(s, task);
  else throw std::invalid_argument("unknown --impl " + s.impl + " (trainkit, branching, libtorch, fwdbwd)");
  const auto hwm = bench::status_kib("VmHWM");

  std::vector<double> losses;
  for (auto& l : r.losses) losses.push_back(l());
  const double gbs = bandwidth ? bench::copy_bandwidth_gbs(params, s.device) : 0.0;
  const double floor_ms = gbs > 0 ? bench::kFloorBytesPerParameter * params / (gbs * 1e6) : 0.0;
  const double adamw_ms = bandwidth && s.impl == "fwdbwd" ? bench::fused_adamw_ms(params, s.device) : 0.0;
  std::printf(
      "{\"impl\": \"%s\", \"model\": \"%s\", \"precision\": \"%s\", \"accum\": %lld, "
      "\"micro_batch\": %lld, \"seq\": %lld, \"threads\": %d, \"params\": %lld, \"tensors\": %zu, "
      "\"window_ms\": %s, \"phase_ms\": %s, \"phase_ops\": %s, \"losses\": %s, \"skipped\": %lld, "
      "\"vmhwm_kib\": %lld, \"rss_start_kib\": %lld, \"copy_gbs\": %.3f, \"floor_ms\": %.4f, "
      "\"adamw_ms\": %.4f, \"fwdbwd_ms\": %s}\n",
      s.impl.c_str(), s.model.c_str(), s.precision.c_str(), static_cast<long long>(s.accum),
      static_cast<long long>(task.pool.front().first.size(0)), static_cast<long long>(task.seq),
      torch::get_num_threads(),
      static_cast<long long>(params), tensors, bench::json_list(r.window_ms).c_str(),
      bench::json_list(r.phase_ms).c_str(), bench::json_list(r.phase_ops, 0).c_str(),
      bench::json_list(losses, 7).c_str(),
      static_cast<long long>(r.skipped), static_cast<long long>(hwm),
      static_cast<long long>(rss_start), gbs, floor_ms, adamw_ms, bench::json_list(r.fwdbwd_ms).c_str());
  return 0;
} catch (const std::exception& e) {
  std::cerr << "compare: " << e.what() << "\n";
  return 2;
}
