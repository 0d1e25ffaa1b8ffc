// TRAIN.MEMORY_BUDGET on BERT-8x512 (benchmarks/compare/models.hpp): peak memory and time per
// sequence at one effective batch for
//   whole      the effective batch as one micro-batch (no accumulation)
//   x4         4 micro-batches of a quarter (AccumulationPolicy<Dynamic>, N = 4)
//   planned    one micro-batch, run by tk::fit as the pieces TRAIN.MEMORY_BUDGET plans (--budget)
// each also with every encoder layer recomputed in backward (tk::recompute): "+rc".
// Every row runs tk::fit (FP32, fused AdamW, ClipNorm 1.0) for --steps optimizer steps, in a
// fresh process of its own (the peak resident set, VmHWM, is per process). The time per
// sequence includes the plan's measuring, which is also printed on its own.
//
//   build/benchmarks/memory_plan [--batch 64] [--steps 4] [--budget 1200MiB] [--repeat 3]
//   build/benchmarks/memory_plan --row planned+rc ...      # one row, one RESULT line
#include "compare/models.hpp"

#include <trainkit/trainkit.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

namespace tk = trainkit;

namespace {

struct Settings {
  std::int64_t batch = 64, steps = 4, repeat = 3;
  std::string budget = "1200MiB";
};

struct Tokens {
  torch::Tensor ids, target;
  std::int64_t rows() const { return ids.size(0); }
};

// One row: prints RESULT {...} on stdout.
int run_row(const std::string& row, const Settings& s) {
  const bool recompute = row.find("+rc") != std::string::npos;
  const std::string mode = row.substr(0, row.find('+'));
  if (mode != "whole" && mode != "x4" && mode != "planned") {
    std::cerr << "unknown row '" << row << "' (whole, x4, planned; optionally +rc)\n";
    return 2;
  }
  const std::int64_t n = mode == "x4" ? 4 : 1;
  if (s.batch % n != 0) {
    std::cerr << "--batch must be a multiple of 4\n";
    return 2;
  }
  const bench::ModelSpec spec = bench::model_spec("bert-8x512");
  bench::Bert model(spec);
  bench::init_weights(*model, 0);
  tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<tk::Dynamic>, tk::ClipPolicy<tk::ClipNorm>> trainer(
      model, tk::AdamW{1e-4, 1e-2}, tk::TrainerOptions().max_grad_norm(1.0).accumulation_steps(n));

  tk::Task<Tokens> task;
  task.batches_per_epoch = [&](std::int64_t) { return s.steps * n; };
  // Step t's sequences are the same in every row: x4's micro-batches are quarters of them.
  task.batch = [&](std::int64_t, std::int64_t index) {
    auto [ids, target] = bench::make_batch(spec, s.batch, spec.seq, index / n, torch::kCPU);
    const std::int64_t rows = s.batch / n, at = (index % n) * rows;
    return Tokens{ids.narrow(0, at, rows), target.narrow(0, at, rows)};
  };
  task.loss = [&](const Tokens& b, tk::Metrics&) {
    const auto positions = torch::arange(b.ids.size(1), b.ids.options());
    auto x = model->ln_emb(model->tok(b.ids) + model->pos(positions));
    for (const auto& layer : *model->layers) {
      auto* l = layer->as<bench::EncoderLayer>();
      x = recompute ? tk::recompute([l](const torch::Tensor& h) { return l->forward(h); }, x) : l->forward(x);
    }
    const auto logits = model->head(x);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), b.target.reshape({-1}));
  };
  // Items are tokens (the loss is their mean); pieces are whole sequences.
  task.items = [](const Tokens& b) { return b.ids.numel(); };
  task.split = [](const Tokens& b, std::int64_t parts) {
    std::vector<Tokens> pieces;
    const auto ids = b.ids.tensor_split(parts), target = b.target.tensor_split(parts);
    for (size_t k = 0; k < ids.size(); ++k) pieces.push_back({ids[k], target[k]});
    return pieces;
  };
  char dir[] = "/tmp/trainkit-memory-plan-XXXXXX";
  if (!::mkdtemp(dir)) return 1;
  tk::FitOptions options = tk::FitOptions().output_path(dir).end_epoch(1).seed(1).progress(false).write_files(false);
  if (mode == "planned") {
    tk::Config c;
    c.load_string("{\"TRAIN\": {\"MEMORY_BUDGET\": \"" + s.budget + "\"}, \"RNG_SEED\": 1}", tk::Config::Format::json, {}, "--budget");
    options.memory_budget(tk::RunPlan::from(c, 1).fit.memory_budget());
  }
  const auto t0 = std::chrono::steady_clock::now();
  const tk::FitResult r = tk::fit(trainer, task, options);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::rmdir(dir);
  const double sequences = static_cast<double>(s.batch * s.steps);
  std::printf("RESULT {\"row\": \"%s\", \"peak_rss_mib\": %.0f, \"ms_per_sequence\": %.3f, \"steps\": %lld, "
              "\"loss\": %.6f, \"piece_rows\": %lld, \"plan_seconds\": %.3f}\n",
              row.c_str(), tk::detail::proc_status_bytes("VmHWM") / (1024.0 * 1024.0), 1000.0 * seconds / sequences,
              static_cast<long long>(r.applied_steps), r.train.count("Loss") ? r.train.at("Loss") : 0.0,
              static_cast<long long>(r.piece_items / spec.seq), r.plan ? r.plan->seconds : 0.0);
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// "key": number in a RESULT line.
double field(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\": ");
  return at == std::string::npos ? 0.0 : std::stod(line.substr(at + key.size() + 4));
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::string row;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--row") row = v;
    else if (a == "--batch") s.batch = std::stoll(v);
    else if (a == "--steps") s.steps = std::stoll(v);
    else if (a == "--budget") s.budget = v;
    else if (a == "--repeat") s.repeat = std::max<std::int64_t>(1, std::stoll(v));
    else {
      std::cerr << "unknown option " << a << "\n";
      return 2;
    }
  }
  if (!row.empty()) return run_row(row, s);

  char exe[4096];
  const ssize_t length = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (length <= 0) return 1;
  exe[length] = '\0';
  std::cout << "BERT-8x512, sequence 32, effective batch " << s.batch << " sequences, " << s.steps
            << " optimizer steps, FP32, CPU; budget of planned rows " << s.budget << "; median of " << s.repeat
            << " processes per row\n\n"
            << "| row | micro-batch | peak RSS (MiB) | time per sequence (ms) | planning (s) | final loss |\n"
            << "|---|---|---|---|---|---|\n";
  double base = 0;
  for (const std::string r : {"whole", "x4", "planned", "whole+rc", "x4+rc", "planned+rc"}) {
    std::vector<double> rss, ms, plan;
    std::string last;
    for (std::int64_t k = 0; k < s.repeat; ++k) {
      const std::string command = std::string(exe) + " --row " + r + " --batch " + std::to_string(s.batch) +
                                  " --steps " + std::to_string(s.steps) + " --budget " + s.budget + " 2>/dev/null";
      FILE* p = ::popen(command.c_str(), "r");
      char buf[1024];
      std::string line;
      while (p && std::fgets(buf, sizeof buf, p))
        if (std::string(buf).rfind("RESULT ", 0) == 0) line = buf;
      if (!p || ::pclose(p) != 0 || line.empty()) {
        std::cerr << "row " << r << " failed: " << command << "\n";
        return 1;
      }
      rss.push_back(field(line, "peak_rss_mib"));
      ms.push_back(field(line, "ms_per_sequence"));
      plan.push_back(field(line, "plan_seconds"));
      last = line;
    }
    const double t = median(ms);
    if (base == 0) base = t;
    const auto pieces = static_cast<long long>(field(last, "piece_rows"));
    const std::string micro = (r.rfind("x4", 0) == 0 ? std::to_string(s.batch / 4) + " x 4" : std::to_string(s.batch)) +
                              (pieces > 0 ? " (pieces of " + std::to_string(pieces) + ")" : "");
    char out[256];
    std::snprintf(out, sizeof out, "| %s | %s | %.0f | %.2f (%.2fx) | %.2f | %.4f |\n", r.c_str(), micro.c_str(), median(rss), t,
                  t / base, median(plan), field(last, "loss"));
    std::cout << out << std::flush;
  }
  return 0;
}
