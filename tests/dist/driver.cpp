// The worker of the distributed tests (tests/unit/test_distributed.cpp), also run under
// torchrun: trains a tiny MLP data-parallel on a synthetic regression set and writes its final
// parameters and a summary. Launched without launcher variables it is one process.
//
//   trainkit_dist_driver --out PREFIX [--steps K] [--batch B] [--accum N]
//       [--precision fp32|fp16|fp16master|bf16master] [--reduce auto|fp32|half] (master weights)
//       [--model mlp|mlp-ln|affine] [--bucket-bytes X] [--timeout S] [--heartbeat S] [--sleep-ms M] [--samples M]
//       [--overflow-rank R --overflow-window W]   inject an inf loss on rank R in window W (1-based)
//       [--overflow-gradient 1]                    with --fit: inject a NaN gradient there instead, the loss finite
//       [--items 1]                                 item-weighted windows (uneven counts per rank; with
//                                                  --fit each odd rank's micro-batches keep half their samples)
//       [--load PATH] [--load-rank1 PATH]          every rank loads PATH (rank 1 the other one)
//       [--save PATH]                              a checkpoint at the end (rank 0 writes it; sharded,
//                                                  every rank sends its slices)
//       [--save-set DIR]                           also a checkpoint set at the end, DIR/set-0000.ckpt
//                                                  (CheckpointFormat::sharded: every rank writes its file)
//       [--checkpoint-format auto|single|sharded]  with --fit: FitOptions::checkpoint_format
//       [--sharding 0|1|2|3]                       TrainerOptions::sharding (none, optimizer, gradients,
//                                                  parameters: every Linear a unit, tk::unit)
//       [--overlap 0|1]                            TrainerOptions::overlap_reduction (default 1)
//       [--flush 1]                                windows may end with the epoch (a partial window,
//                                                  trainer.flush()): --samples/--batch/--accum need not divide
//       [--fit DIR]                                train 2 epochs with tk::fit, output DIR/rank<r> (sharded: DIR)
//       [--resume 1]                               with --fit: every rank's output is DIR itself (rank 0
//                                                  writes), resumed from its newest checkpoint
//                                                  (AUTO_RESUME); --sleep-ms slows each micro-batch
//       [--oom-backward-rank R]                    with --fit: rank R runs out of memory once in the
//                                                  backward of epoch 0's micro-batch 1, after the last
//                                                  layer's gradients were accumulated
//       [--oom-rank R [--oom-index I]]             with --fit: rank R runs out of memory once, in
//                                                  epoch 0's micro-batch I (default 1; a c10::OutOfMemoryError
//                                                  from the loss), and replays its window in pieces
//       [--cap-rank R --cap F]                     with --fit: a real allocation failure. Rank R measures
//                                                  the peak of epoch 0's micro-batch 1, caps its address
//                                                  space (RLIMIT_AS) at what it has plus F times that peak
//                                                  for micro-batch 2 (F < 1: LibTorch's allocator fails
//                                                  part way, where F says), and lifts the cap at
//                                                  micro-batch 4; one intra-op thread
//       [--cap-mib M]                              every rank's address space (RLIMIT_AS) capped at what it
//                                                  holds once its process group is formed, before the
//                                                  model is built, plus M MiB (one arena, one intra-op
//                                                  thread: the cap then follows the tensors)
//       [--model deep --width H --layers L]       Linear(8, H), L times tanh(Linear(H, H)), Linear(H, 4),
//                                                  every Linear a unit with --sharding 3
//       [--units P1,P2,...]                        stage 3's units (default: the model's own, below)
//       [--alternate-order 1] [--unused-bias-rank R]  --model deep: every other forward runs the mids
//                                                  in reverse (training's and each validation's counted
//                                                  apart); rank R leaves the first mid's bias unused
//       [--recompute-around 1]                     --model deep: each mid's tk::unit call inside tk::recompute
//       [--prefetch N] [--reshard 0|1]             stage 3: TrainerOptions::unit_prefetch (default 1) and
//                                                  reshard_after_forward (default 1)
//       [--model wide --width H --dropout P]       three H-wide layers with dropout: activations
//                                                  dominate the memory (--model wide)
//       [--watch-nonfinite 1]                      the overflow diagnosis on from the start; the
//                                                  summary's "nonfinite": this rank's counts
//       [--stop-rank R --stop-window W]            with --fit: rank R alone asks to stop (BatchEnd::
//                                                  request_stop) once window W closed; prints "fit stopped
//                                                  at ..."; with --fit, each epoch's means ("fit epoch")
//       [--main-writes 1]                          with --fit: FitOptions::write_files(false) on every
//                                                  rank but 0 (its documented use)
//       [--log-frequent K] [--patience P]          with --fit: LOG_FREQUENT (default 1) and
//                                                  NONFINITE_PATIENCE (default 20); with --fit,
//                                                  --overflow-rank R --overflow-window W makes rank R's
//                                                  loss infinite from epoch 0's micro-batch W (1-based) on
//       [--forward-peaks 1]                        with --fit: FitOptions::forward_peaks (TRAIN.FORWARD_PEAKS)
//       [--export PATH [--export-hold 0]]          after training, the model's weights written by rank 0
//                                                  (tk::write_weights), every unit held gathered meanwhile
//                                                  (--export-hold 0: not held)
//       [--memory-budget B] [--piece-items N]      with --fit: FitOptions::memory_budget (bytes, or a fraction
//                                                  of the device's memory) and piece_items
//       [--memory-over-mib M]                      with --fit: the budget what this rank holds before fit
//                                                  (VmRSS) plus M MiB, over the plan's margin
//       [--row-mib M]                              --model mlp/mlp-ln: each row's forward keeps M MiB more
//                                                  of activations for its backward (activations dominate)
//       [--zero-items-rank R]                      with --fit: task.items counts 0 in rank R's micro-batches
//                                                  of even index (their rows weigh nothing)
//       [--load-held 1]                            after --save: every unit held (hold_parameters), the
//                                                  checkpoint loaded again; prints what load said
//       [--count-rows 1]                           --model deep: a buffer counts the rows of training forwards
//                                                  (the summary's rows_seen, this rank's)
//       [--validate 1|2|3]                         with --fit: a validation after each epoch (2: by unit; 3: by unit,
//                                                  its loss averaged over the ranks after its forwards) in which rank r
//                                                  runs r + 1 forwards (shards of different sizes)
//       [--validate-forwards F]                    --validate: rank r runs F + r forwards instead
//       [--validate-reverse-rank R]                --validate, --model deep: rank R's second validation
//                                                  forward runs the mids in reverse (its units' order alone)
//   ... --then --out PREFIX2 ...                 another run after this one, in the same process and
//                                                  process group (the test suite's launches are its
//                                                  cost: a chain makes one); not with --cap-*, --resume
// Writes PREFIX.rank<r>.bin (the flat fp32 parameters) and PREFIX.rank<r>.json; prints
// "window k" after each optimizer step; exits 1 with "error: ..." on stderr on failure.
#include <trainkit/parallel/data_parallel.hpp>
#include <trainkit/fit/fit.hpp>
#include <trainkit/io/weights.hpp>
#include <trainkit/parallel/sampler.hpp>
#include <trainkit/trainer/trainer.hpp>
#include <trainkit/trainer/recompute.hpp>
#include <trainkit/trainer/unit.hpp>

#include "../support/counting_backend.hpp"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <cstdio>
#include <malloc.h>
#include <sys/resource.h>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

namespace tk = trainkit;

namespace {

struct Args {
  std::string out, load, load_rank1, save, save_set, fit, precision = "fp32", model = "mlp", reduce = "auto";
  std::string checkpoint_format = "auto", units = "model", export_weights;
  std::int64_t steps = 6, batch = 4, accum = 1, samples = 64, bucket_bytes = 25 << 20;
  int overflow_gradient = 0;
  int overflow_rank = -1, overflow_window = -1, sleep_ms = 0, items = 0, oom_rank = -1, sharding = 0, flush = 0, overlap = 1;
  int oom_backward_rank = -1, resume = 0, cap_rank = -1, oom_index = 1, watch_nonfinite = 0, forward_peaks = 0;
  int validate = 0, prefetch = 1, reshard = 1, export_hold = 1, alternate_order = 0, unused_bias_rank = -1,
      recompute_around = 0, count_rows = 0, load_held = 0, zero_items_rank = -1, validate_forwards = 1,
      validate_reverse_rank = -1;
  std::int64_t log_frequent = 1, patience = 20;
  int stop_rank = -1;
  int main_writes = 0;
  std::int64_t stop_window = 0;
  std::int64_t width = 512, layers = 8;
  double timeout = 60, heartbeat = -1;  // heartbeat < 0: the library's default
  double cap = 0, dropout = 0, cap_mib = 0, memory_budget = 0, memory_over_mib = 0;
  std::int64_t row_mib = 0;
  std::int64_t piece_items = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  std::map<std::string, std::string> kv;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k.rfind("--", 0) != 0 || i + 1 >= argc) throw std::invalid_argument("bad argument " + k);
    kv[k.substr(2)] = argv[++i];
  }
  auto take = [&](const char* k, auto& v) {
    auto it = kv.find(k);
    if (it == kv.end()) return;
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::string>) v = it->second;
    else if constexpr (std::is_same_v<std::decay_t<decltype(v)>, double>) v = std::stod(it->second);
    else v = static_cast<std::decay_t<decltype(v)>>(std::stoll(it->second));
    kv.erase(it);
  };
  take("out", a.out), take("load", a.load), take("load-rank1", a.load_rank1), take("save", a.save), take("fit", a.fit);
  take("precision", a.precision), take("model", a.model), take("steps", a.steps), take("batch", a.batch);
  take("accum", a.accum), take("samples", a.samples), take("bucket-bytes", a.bucket_bytes);
  take("overflow-rank", a.overflow_rank), take("overflow-window", a.overflow_window);
  take("overflow-gradient", a.overflow_gradient);
  take("sleep-ms", a.sleep_ms), take("items", a.items), take("timeout", a.timeout);
  take("heartbeat", a.heartbeat), take("oom-rank", a.oom_rank), take("reduce", a.reduce);
  take("sharding", a.sharding), take("flush", a.flush), take("overlap", a.overlap);
  take("oom-backward-rank", a.oom_backward_rank), take("resume", a.resume), take("oom-index", a.oom_index);
  take("cap-rank", a.cap_rank), take("cap", a.cap), take("cap-mib", a.cap_mib), take("width", a.width), take("layers", a.layers), take("dropout", a.dropout);
  take("watch-nonfinite", a.watch_nonfinite), take("log-frequent", a.log_frequent), take("patience", a.patience);
  take("forward-peaks", a.forward_peaks), take("validate", a.validate), take("validate-forwards", a.validate_forwards),
      take("validate-reverse-rank", a.validate_reverse_rank), take("save-set", a.save_set), take("checkpoint-format", a.checkpoint_format);
  take("units", a.units), take("prefetch", a.prefetch), take("reshard", a.reshard);
  take("memory-budget", a.memory_budget), take("memory-over-mib", a.memory_over_mib), take("row-mib", a.row_mib), take("piece-items", a.piece_items), take("export", a.export_weights),
      take("export-hold", a.export_hold), take("alternate-order", a.alternate_order);
  take("unused-bias-rank", a.unused_bias_rank), take("recompute-around", a.recompute_around);
  take("count-rows", a.count_rows), take("load-held", a.load_held), take("zero-items-rank", a.zero_items_rank);
  take("stop-rank", a.stop_rank), take("stop-window", a.stop_window), take("main-writes", a.main_writes);
  if (!kv.empty()) throw std::invalid_argument("unknown option --" + kv.begin()->first);
  if (a.out.empty()) throw std::invalid_argument("--out PREFIX is required");
  return a;
}

// "a,b.*" -> {"a", "b.*"}.
std::vector<std::string> split_units(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream in(list);
  for (std::string path; std::getline(in, path, ',');) out.push_back(path);
  return out;
}

// `mlp`: Linear(8, 16), tanh, Linear(16, 4). `affine`: elementwise only (no op that autocast
// runs in fp16), for comparisons that fp16 rounding of batch-size-dependent matmuls would blur.
// `wide`: Linear(8, H), three times ReLU and dropout with Linear(H, H) between, Linear(H, 4).
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const std::string& kind, std::int64_t width = 16, double dropout = 0, std::int64_t layers = 0)
      : affine(kind == "affine"),
        wide(kind == "wide"),
        deep(kind == "deep"),
        p(dropout),
        fc1(register_module("fc1", torch::nn::Linear(8, width))),
        fc2(register_module("fc2", torch::nn::Linear(width, 4))) {
    // `mlp-ln`: a LayerNorm between them (master weights keep it fp32).
    if (kind == "mlp-ln") ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    if (wide) {
      mid1 = register_module("mid1", torch::nn::Linear(width, width));
      mid2 = register_module("mid2", torch::nn::Linear(width, width));
    }
    if (deep) {
      mids = register_module("mids", torch::nn::ModuleList());
      for (std::int64_t i = 0; i < layers; ++i) mids->push_back(torch::nn::Linear(width, width));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (deep) {
      if (rows_seen.defined() && is_training()) rows_seen += x.size(0);
      auto h = torch::relu(tk::unit(fc1, x));
      // --alternate-order: every other forward runs the mids in reverse; --unused-bias: the first
      // mid's bias is not used on this rank (its gradient never comes here).
      std::vector<size_t> order(mids->size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      const bool alternate = alternate_order && (is_training() ? forwards++ : eval_forwards++) % 2 == 1;
      if (alternate || std::exchange(reverse_once, false)) std::reverse(order.begin(), order.end());
      for (const size_t i : order) {
        auto* mid = mids[i]->as<torch::nn::LinearImpl>();
        const bool no_bias = unused_bias && i == 0;
        auto call = [mid, no_bias](const torch::Tensor& in) {
          return tk::unit(mid, [&](const torch::Tensor& y) {
            return no_bias ? torch::nn::functional::linear(y, mid->weight) : mid->forward(y);
          }, in);
        };
        h = torch::tanh(recompute_around ? tk::recompute(call, h) : call(h));
      }
      return tk::unit(fc2, h);
    }
    if (wide) {
      auto h = torch::dropout(torch::relu(tk::unit(fc1, x)), p, is_training());
      h = torch::dropout(torch::relu(tk::unit(mid1, h)), p, is_training());
      h = torch::dropout(torch::relu(tk::unit(mid2, h)), p, is_training());
      return tk::unit(fc2, h);
    }
    if (affine) {  // 8 inputs -> 4 outputs from the same 212 parameters, elementwise
      const auto w = fc1->weight.reshape({-1}).narrow(0, 0, 8), b = fc1->bias.narrow(0, 0, 8);
      const auto h = torch::tanh(x * w + b).reshape({-1, 4, 2}).sum(2);
      return h * fc2->weight.reshape({-1}).narrow(0, 0, 4) + fc2->bias;
    }
    auto h = torch::tanh(ln ? ln(tk::unit(fc1, x)) : tk::unit(fc1, x));
    if (row_mib > 0)  // (--row-mib: an [n, M x 2^18] intermediate each row, kept for the backward)
      h = h + torch::tanh(h.sum(1, true) * torch::ones({1, row_mib << 18}, h.options())).mean(1, true);
    if (oom_in_backward) {  // --oom-backward-rank: thrown when the gradient reaches h, after fc2's
      oom_in_backward = false;
      h.register_hook([](const torch::Tensor&) -> torch::Tensor {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory (the driver's --oom-backward-rank)");
      });
    }
    return tk::unit(fc2, h);
  }
  bool affine, wide, deep, oom_in_backward = false, alternate_order = false, unused_bias = false, recompute_around = false,
      reverse_once = false;
  std::int64_t forwards = 0, eval_forwards = 0, row_mib = 0;  // (--alternate-order: training's, this validation's)
  torch::nn::ModuleList mids{nullptr};
  torch::Tensor rows_seen;  // (--count-rows)
  double p;
  torch::nn::Linear fc1, fc2, mid1{nullptr}, mid2{nullptr};
  torch::nn::LayerNorm ln{nullptr};
};
TORCH_MODULE(Mlp);

tk::ReducePrecision reduce_precision(const Args& a) {
  if (a.reduce == "auto") return tk::ReducePrecision::automatic;
  if (a.reduce == "fp32") return tk::ReducePrecision::fp32;
  if (a.reduce == "half") return tk::ReducePrecision::half;
  throw std::invalid_argument("--reduce must be auto, fp32 or half");
}

// Bytes the model's flat gradient holds now (0: released between windows, Sharding::gradients).
template <class Trainer>
std::int64_t gradient_bytes(const Trainer& trainer) {
  if constexpr (Trainer::precision::master_weights) {
    const auto& half = trainer.storage().half_gradients();  // (stage 3: none, a gradient per unit)
    return half.defined() ? static_cast<std::int64_t>(half.storage().nbytes()) : 0;
  }
  else
    return static_cast<std::int64_t>(trainer.storage().gradients().storage().nbytes());
}

// Bytes the model's parameters hold now, each storage once (stage 3 releases its units').
std::int64_t parameter_bytes(torch::nn::Module& model) {
  std::set<const void*> seen;
  std::int64_t bytes = 0;
  for (const auto& p : model.parameters())
    if (seen.insert(p.storage().unsafeGetStorageImpl()).second) bytes += static_cast<std::int64_t>(p.storage().nbytes());
  return bytes;
}

// --cap: a real out-of-memory error, LibTorch's CPU allocator failing under RLIMIT_AS. Big
// allocations are mmap'ed (and given back) so that the address space follows the tensors.
class AddressCap {
 public:
  AddressCap() { ::mallopt(M_MMAP_THRESHOLD, 64 << 10); }
  ~AddressCap() { lift(); }
  // Before micro-batch `index`'s loss: 1 starts measuring, 2 caps, 4 lifts.
  void at(std::int64_t index, double fraction) {
    if (index == 1 && !measuring_) {
      measuring_ = true;
      std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM := VmRSS
      resident_ = status("VmRSS");
    } else if (index == 2 && !capped_) {
      capped_ = true;
      const double peak = status("VmHWM") - resident_;
      const auto limit = static_cast<rlim_t>(status("VmSize") + fraction * peak);
      rlimit r{};
      ::getrlimit(RLIMIT_AS, &r);
      saved_ = r;
      r.rlim_cur = limit;
      if (::setrlimit(RLIMIT_AS, &r) != 0) throw std::runtime_error("setrlimit(RLIMIT_AS) failed");
      std::cout << "address space capped: micro-batch 1 peaked " << static_cast<long>(peak / 1024) << " KiB over "
                << "its start; the cap leaves " << fraction << " of it" << std::endl;
    } else if (index == 4) {
      lift();
    }
  }

 private:
  void lift() {
    if (capped_ && !lifted_) ::setrlimit(RLIMIT_AS, &saved_), lifted_ = true;
  }
  static double status(const char* name) {
    const double bytes = tk::detail::proc_status_bytes(name);
    if (bytes < 0) throw std::runtime_error(std::string("no ") + name + " in /proc/self/status");
    return bytes;
  }
  bool measuring_ = false, capped_ = false, lifted_ = false;
  double resident_ = 0;
  rlimit saved_{};
};

// One run over `base` (the process's group; a run of a chain counts its own collectives).
template <class Trainer>
int run(const Args& a, tk::ProcessGroup& base) {
  auto counter = c10::make_intrusive<trainkit_testing::CountingBackend>(base.backend());
  tk::ProcessGroup group = base.over(counter);  // (its heartbeat too: store_gone())
  const int rank = group.rank(), world = group.world_size();
  if (a.cap_mib > 0) {
    ::mallopt(M_ARENA_MAX, 1);
    ::mallopt(M_MMAP_THRESHOLD, 64 << 10);
    const double held = tk::detail::proc_status_bytes("VmSize");
    rlimit r{};
    ::getrlimit(RLIMIT_AS, &r);
    r.rlim_cur = static_cast<rlim_t>(held + a.cap_mib * 1024 * 1024);
    if (::setrlimit(RLIMIT_AS, &r) != 0) throw std::runtime_error("setrlimit(RLIMIT_AS) failed");
    std::cout << "address space capped at " << static_cast<long>(held / 1048576) << " MiB held + " << a.cap_mib
              << " MiB" << std::endl;
  }

  // Every rank starts from other weights: the broadcast at attach makes them rank 0's.
  torch::manual_seed(1000 + rank);
  if (a.model != "mlp" && a.model != "affine" && a.model != "mlp-ln" && a.model != "wide" && a.model != "deep")
    throw std::invalid_argument("--model must be mlp, mlp-ln, affine, wide or deep");
  Mlp model(a.model, a.model == "wide" || a.model == "deep" ? a.width : 16, a.dropout, a.layers);
  model->alternate_order = a.alternate_order != 0;
  model->unused_bias = a.unused_bias_rank == rank;
  model->recompute_around = a.recompute_around != 0;
  model->row_mib = a.row_mib;
  if (a.count_rows) model->rows_seen = model->register_buffer("rows_seen", torch::zeros({}, torch::kLong));
  auto data_gen = at::make_generator<at::CPUGeneratorImpl>(42);
  const auto x = torch::randn({a.samples, 8}, data_gen);
  const auto y = torch::sin(x.matmul(torch::randn({8, 4}, data_gen)));

  Trainer trainer(model, tk::AdamW{1e-2, 1e-2},
                  tk::TrainerOptions()
                      .accumulation_steps(a.accum)
                      .max_grad_norm(0.05)
                      .reduce_precision(reduce_precision(a))
                      .overlap_reduction(a.overlap != 0)
                      .unit_prefetch(a.prefetch)
                      .reshard_after_forward(a.reshard != 0)
                      .sharding(a.sharding == 3   ? tk::Sharding::parameters
                                : a.sharding == 2 ? tk::Sharding::gradients
                                : a.sharding == 1 ? tk::Sharding::optimizer
                                                  : tk::Sharding::none)
                      // (`affine` reads its weights outside any call: nothing to make a unit)
                      .units(a.units != "model" ? split_units(a.units)
                             : a.model == "affine" ? std::vector<std::string>{}
                             : a.model == "wide" ? std::vector<std::string>{"fc1", "mid1", "mid2", "fc2"}
                             : a.model == "deep" ? std::vector<std::string>{"fc1", "mids.*", "fc2"}
                                                 : std::vector<std::string>{"fc1", "fc2"}));
  auto replicas = std::make_shared<tk::DataParallel>(group, a.bucket_bytes);
  trainer.set_replicas(replicas);
  if (a.watch_nonfinite) trainer.watch_nonfinite(true);
  const std::string load = rank == 1 && !a.load_rank1.empty() ? a.load_rank1 : a.load;
  if (!load.empty()) trainer.load(load);

  double last_validation = 0;  // (--validate: this rank's last validation loss)
  std::int64_t fit_piece_items = 0, stand_in_pieces = 0;  // (--fit: FitResult's)
  tk::DistributedSampler sampler(a.samples, a.batch, rank, world, /*seed*/ 7);
  const auto per_epoch = sampler.batches_per_epoch();
  if (per_epoch % a.accum != 0 && !a.flush)
    throw std::invalid_argument("choose --samples, --batch and --accum so that windows do not span epochs, or --flush 1");
  if (!a.fit.empty()) {  // tk::fit: only the main rank may write into its directory
    tk::Task<std::vector<std::int64_t>> task;
    std::int64_t at_epoch = -1, at_index = -1;
    bool oom_thrown = false;
    task.batches_per_epoch = [&](std::int64_t) { return per_epoch; };
    task.batch = [&](std::int64_t epoch, std::int64_t index) {
      at_epoch = epoch, at_index = index;
      auto b = sampler.batch(epoch, index);
      if (a.items && rank % 2 == 1) b.resize(std::max<size_t>(1, b.size() / 2));  // (uneven item counts)
      return b;
    };
    AddressCap cap;
    task.loss = [&](const std::vector<std::int64_t>& b, tk::Metrics&) {
      if (rank == a.cap_rank && at_epoch == 0) cap.at(at_index, a.cap);
      if (a.sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a.sleep_ms));
      if (rank == a.oom_rank && !oom_thrown && at_epoch == 0 && at_index == a.oom_index &&
          static_cast<std::int64_t>(b.size()) == a.batch) {
        oom_thrown = true;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory (the driver's --oom-rank)");
      }
      if (rank == a.oom_backward_rank && !oom_thrown && at_epoch == 0 && at_index == 1 &&
          static_cast<std::int64_t>(b.size()) == a.batch) {
        oom_thrown = true;
        model->oom_in_backward = true;
      }
      const auto idx = torch::tensor(b, torch::kLong);
      const auto loss = torch::mse_loss(model(x.index_select(0, idx)), y.index_select(0, idx));
      const bool inject = rank == a.overflow_rank && at_epoch == 0 && at_index + 1 >= a.overflow_window;
      if (!inject) return loss;
      // (sqrt's gradient at 0 is infinite, times 0: NaN in every gradient, the loss itself finite)
      return a.overflow_gradient ? loss + torch::sqrt(torch::relu(loss) * 0) : loss * std::numeric_limits<float>::infinity();
    };
    // Pieces for a replay: the loss is the mean over the batch's samples.
    task.items = [&](const std::vector<std::int64_t>& b) {
      // (at_index: the micro-batch task.batch made last, the one counted: no workers, no held window)
      return rank == a.zero_items_rank && at_index % 2 == 0 ? std::int64_t{0} : static_cast<std::int64_t>(b.size());
    };
    if (a.validate)
      task.validate = [&](std::int64_t) {
        torch::Tensor loss;
        const auto region = trainer.precision_region();  // (master weights: a half model, fp32 inputs)
        model->eval_forwards = 0;
        for (int i = 0; i < a.validate_forwards + rank; ++i) {
          model->reverse_once = i == 1 && rank == a.validate_reverse_rank;
          loss = torch::mse_loss(model(x.narrow(0, 0, 8)), y.narrow(0, 0, 8));
        }
        last_validation = loss.item<double>();
        if (a.validate == 3) {  // (the mean over the ranks, after uneven forwards)
          std::vector<double> v{last_validation};
          replicas->all_reduce(v, tk::Reduce::mean);
          last_validation = v[0];
        }
        return std::map<std::string, double>{{"Val", last_validation}};
      };
    task.split = [](const std::vector<std::int64_t>& b, std::int64_t parts) {
      std::vector<std::vector<std::int64_t>> pieces(static_cast<size_t>(parts));
      for (size_t i = 0; i < b.size(); ++i) pieces[i * static_cast<size_t>(parts) / b.size()].push_back(b[i]);
      return pieces;
    };
    tk::Callbacks callbacks;
    if (a.stop_rank == rank)  // (this rank alone asks, after window W: the ranks stop where they agree)
      callbacks.batch_end = [&](tk::BatchEnd& e) { e.request_stop = trainer.windows() == a.stop_window; };
    callbacks.epoch_end = [](tk::EpochEnd& e) {
      for (const auto& [name, mean] : e.train)
        std::printf("fit epoch %lld train %s %.17g\n", static_cast<long long>(e.epoch), name.c_str(), mean);
      std::fflush(stdout);
    };
    const auto result = tk::fit(trainer, task,
                                tk::FitOptions()
                                    // (a sharded update writes a set: every rank into one directory)
                                    .output_path(a.resume || a.sharding > 0 ? a.fit : a.fit + "/rank" + std::to_string(rank))
                                    .end_epoch(2)
                                    .write_files(a.main_writes == 0 || rank == 0)
                                    .validate_by_unit(a.validate >= 2)
                                    .log_frequent(a.log_frequent)
                                    .nonfinite_patience(a.patience)
                                    .forward_peaks(a.forward_peaks != 0)
                                    .memory_budget(a.memory_over_mib > 0
                                                       ? (tk::detail::proc_status_bytes("VmRSS") + a.memory_over_mib * 1048576) / 0.9
                                                       : a.memory_budget)
                                    .piece_items(a.piece_items)
                                    .checkpoint_format(tk::checkpoint_format_of(a.checkpoint_format))
                                    .auto_resume(a.resume != 0)
                                    .handle_signals(false)
                                    .progress(false),
                                callbacks);
    std::cout << "fit wrote " << result.checkpoints.size() << " checkpoints, replayed " << result.replays
              << " window(s)" << std::endl;
    if (result.stopped) std::cout << "fit stopped at epoch " << result.position.epoch << ", micro-batch " << result.position.index << std::endl;
    fit_piece_items = result.piece_items, stand_in_pieces = result.stand_in_pieces;
  }
  const auto calls_before = counter->all_reduce_calls, bytes_before = counter->all_reduce_bytes;
  const auto windows_before = trainer.windows();
  // Micro-batches so far: the sampler's position (windows_per_epoch of them per epoch, the last
  // one partial with --flush).
  const auto windows_per_epoch = (per_epoch + a.accum - 1) / a.accum;
  std::int64_t m = trainer.windows() / windows_per_epoch * per_epoch + trainer.windows() % windows_per_epoch * a.accum;
  tk::StepReport last;
  while (trainer.windows() < a.steps) {
    const auto idx = torch::tensor(sampler.batch(m / per_epoch, m % per_epoch), torch::kLong);
    const bool inject = rank == a.overflow_rank && trainer.windows() + 1 == a.overflow_window &&
                        trainer.window_position() == a.accum - 1;
    // --items 1: sample i counts as 1 + i % 3 items (tokens), so the ranks' windows hold
    // different item counts; the loss is the item-weighted mean over the micro-batch.
    const auto weights = (idx % 3 + 1).to(torch::kFloat);
    auto closure = [&] {
      auto per_row = (model(x.index_select(0, idx)) - y.index_select(0, idx)).square().mean(1);
      auto loss = a.items ? (per_row * weights).sum() / weights.sum() : per_row.mean();
      return inject ? loss * std::numeric_limits<float>::infinity() : loss;
    };
    auto r = a.items ? trainer.micro_step(closure, weights.sum().template item<std::int64_t>())
                     : trainer.micro_step(closure);
    ++m;
    if (!r.window_closed && m % per_epoch == 0)
      if (auto report = trainer.flush()) r = {true, *report};  // the epoch's partial window
    if (r.window_closed) {
      last = r.report;
      std::cout << "window " << trainer.windows() << std::endl;
    }
    if (a.sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a.sleep_ms));
  }
  const auto training_calls = counter->all_reduce_calls - calls_before;
  const auto training_bytes = counter->all_reduce_bytes - bytes_before;
  if (!a.save.empty() && (group.is_main() || trainer.saves_collectively())) trainer.save(a.save);
  if (a.load_held) {
    trainer.hold_parameters(true);
    try {
      trainer.load(a.save);
      std::cout << "loaded while held" << std::endl;
    } catch (const std::exception& e) {
      std::cout << "load while held: " << e.what() << std::endl;
    }
    trainer.hold_parameters(false);
  }
  if (!a.export_weights.empty()) {
    if (a.export_hold) trainer.hold_parameters(true);  // (every rank: stage 3 gathers each unit; otherwise nothing)
    if (group.is_main()) tk::write_weights(a.export_weights, tk::model_weights(*model));
    if (a.export_hold) trainer.hold_parameters(false);
  }
  if (!a.save_set.empty()) {
    tk::CheckpointManager set(a.save_set, "set");
    set.set_format(tk::CheckpointFormat::sharded);
    set.create_directory();
    tk::LoopState state;
    state.position = {1, 0};
    set.save(trainer, state, /*epoch_end=*/true);
  }

  // The flat fp32 parameters (the masters with master weights). Sharded master weights hold
  // only their slices of the masters: the model's half parameters in fp32, back to back, stand
  // for them (--save has the masters). Stage 3: the root unit (half with master weights).
  torch::Tensor params = trainer.parameters().contiguous();
  if (a.sharding == 3) {
    params = trainer.storage().replicated_state().to(torch::kFloat).contiguous();
  } else if (Trainer::precision::master_weights && trainer.saves_collectively()) {
    std::vector<torch::Tensor> flat;
    for (const auto& p : model->parameters()) flat.push_back(p.detach().reshape({-1}).to(torch::kFloat));
    params = torch::cat(flat).contiguous();
  }
  const std::string prefix = a.out + ".rank" + std::to_string(rank);
  std::ofstream(prefix + ".bin", std::ios::binary)
      .write(static_cast<const char*>(params.data_ptr()), params.numel() * sizeof(float));
  const auto& units = trainer.storage().unit_gathers();
  std::int64_t unit_largest = 0, unit_total = 0;  // (the units' buffers, the root unit's left out)
  if (units)
    for (const auto& u : units->units())
      if (!u.whole) unit_largest = std::max(unit_largest, u.buffer.numel()), unit_total += u.buffer.numel();
  auto mean = std::vector<double>{last.empty() ? 0.0 : last.loss()};
  replicas->all_reduce(mean, tk::Reduce::mean);
  nlohmann::json j = {{"rank", rank},
                      {"world", world},
                      {"launcher", group.info().launcher},
                      {"windows", trainer.windows() - windows_before},
                      {"applied", trainer.applied_steps().template item<std::int64_t>()},
                      {"skipped", trainer.skipped_steps().template item<std::int64_t>()},
                      {"scale", trainer.loss_scale().template item<double>()},
                      {"allreduce_calls", training_calls},
                      {"allreduce_bytes", training_bytes},
                      {"gradient_bytes", gradient_bytes(trainer)},
                      {"overlapped_buckets", trainer.storage().overlapped_buckets()},
                      {"reduce_scatter_calls", counter->reduce_scatter_calls},
                      {"all_gather_calls", counter->all_gather_calls},
                      {"unit_gathers", units ? units->gathers() : 0},
                      {"unit_announcements", units ? units->announcements() : 0},
                      {"unit_peak", units ? units->peak_gathered() : 0},
                      {"unit_largest", unit_largest},
                      {"unit_total", unit_total},
                      {"unit_gradient_peak", units ? units->peak_gradient() : 0},
                      {"unit_gathers_ahead", units ? units->gathers_ahead() : 0},
                      {"unit_gathers_ahead_in_backward", units ? units->gathers_ahead_in_backward() : 0},
                      {"unit_gather_seconds", units ? units->gather_seconds() : 0.0},
                      {"parameter_bytes", parameter_bytes(*model)},
                      {"held_bytes", trainer.held_bytes()},
                      {"predicted_bytes", trainer.predicted_held().total()},
                      {"predicted_unit_gradients", trainer.predicted_held().unit_gradients},
                      {"vm_peak", tk::detail::proc_status_bytes("VmPeak")},
                      {"rss_peak", tk::detail::proc_status_bytes("VmHWM")},
                      {"buckets", replicas->buckets(trainer.parameters().numel())},
                      {"numel", trainer.parameters().numel()},
                      {"mean_loss", mean[0]},
                      {"validation", last_validation},
                      {"fit_piece_items", fit_piece_items},
                      {"stand_in_pieces", stand_in_pieces},
                      {"rows_seen", model->rows_seen.defined() ? model->rows_seen.item<std::int64_t>() : -1},
                      {"nonfinite", trainer.take_nonfinite_counts().windows}};
  std::ofstream(prefix + ".json") << j.dump() << "\n";
  return 0;
}

int run_precision(const Args& a, tk::ProcessGroup& base) {
  using Acc = tk::AccumulationPolicy<tk::Dynamic>;
  using Clip = tk::ClipPolicy<tk::ClipNorm>;
  if (a.precision == "fp16") return run<tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, Acc, Clip>>(a, base);
  if (a.precision == "fp32") return run<tk::Trainer<tk::PrecisionPolicy<tk::FP32>, Acc, Clip>>(a, base);
  if (a.precision == "fp16master")
    return run<tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::FP16Dynamic>>, Acc, Clip>>(a, base);
  if (a.precision == "bf16master")
    return run<tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::BF16>>, Acc, Clip>>(a, base);
  throw std::invalid_argument("--precision must be fp32, fp16, fp16master or bf16master");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    // The runs, in order: the arguments cut at each --then.
    std::vector<Args> runs;
    std::vector<char*> segment{argv[0]};
    for (int i = 1; i <= argc; ++i) {
      if (i < argc && std::string(argv[i]) != "--then") {
        segment.push_back(argv[i]);
        continue;
      }
      runs.push_back(parse(static_cast<int>(segment.size()), segment.data()));
      segment.assign(1, argv[0]);
    }
    const Args& first = runs.front();
    if (runs.size() > 1)
      for (const auto& a : runs)
        if (a.cap_rank >= 0 || a.cap_mib > 0 || a.resume)
          throw std::invalid_argument("--cap-rank, --cap-mib and --resume make a run of their own: no --then");
    if (first.cap_rank >= 0 || first.cap_mib > 0) torch::set_num_threads(1);  // no thread (and its stack) made under the cap
    auto options = tk::DistributedOptions().timeout_seconds(first.timeout);
    if (first.heartbeat >= 0) options.heartbeat_seconds(first.heartbeat);
    auto base = tk::ProcessGroup::create(options);
    for (const auto& a : runs)
      if (const int status = run_precision(a, base); status != 0) return status;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
