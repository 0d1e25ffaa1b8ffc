// Peak resident memory of one training run per precision configuration, on a BERT-tiny-like
// model (2 layers, hidden 128, 2 heads, FFN 512, vocabulary 30522: 4.4 M parameters, most of
// them in the embedding), AdamW (fused), masked-LM loss on 15% of the positions.
//
//   build/benchmarks/memory_master_weights                 # every configuration, one process each
//   build/benchmarks/memory_master_weights --config NAME   # one: fp32, autocast_fp16, autocast_bf16,
//                                                          #      master_fp16, master_bf16
//   options: --batch B (16) --seq S (128) --windows W (4) --repeat R (3: the median of R processes)
//            --accumulate N (1: micro-batches per window), --master-chunk C (TrainerOptions::
//            master_chunk, 16 Mi elements) and the model's shape: --vocab V
//            --hidden H --heads A --ffn F --layers L. With a wide model and small batches
//            (`--vocab 1000 --hidden 1024 --heads 8 --ffn 4096 --layers 4 --batch 1 --seq 16`,
//            51 M parameters) the training memory is the parameters, gradients and optimizer
//            state; its "B/param" column is then the bytes each parameter costs at the peak.
//
// Each configuration runs in a fresh process (a high-water mark cannot be reset), and reports
// its peak RSS (getrusage) and the peak minus the RSS before the model was built (LibTorch's own
// pages: the "baseline"). On the CPU the figures are the host allocator's high-water mark: they
// include freed blocks glibc kept, and CPU autocast's per-region weight cast cache; on a GPU
// the same run would measure the device allocator instead (not done here).
#include <trainkit/trainkit.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

namespace tk = trainkit;

namespace {

struct Settings {
  std::int64_t vocab = 30522, hidden = 128, heads = 2, ffn = 512, layers = 2, max_seq = 512;
  std::int64_t batch = 16, seq = 128, windows = 4, repeat = 3, accumulate = 1, master_chunk = std::int64_t{1} << 24;
};

struct LayerImpl : torch::nn::Module {
  LayerImpl(const Settings& s)
      : heads(s.heads),
        qkv(register_module("qkv", torch::nn::Linear(s.hidden, 3 * s.hidden))),
        out(register_module("out", torch::nn::Linear(s.hidden, s.hidden))),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.hidden})))),
        fc1(register_module("fc1", torch::nn::Linear(s.hidden, s.ffn))),
        fc2(register_module("fc2", torch::nn::Linear(s.ffn, s.hidden))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.hidden})))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), h = x.size(2), d = h / heads;
    auto parts = qkv(x).view({b, t, 3, heads, d}).permute({2, 0, 3, 1, 4});  // 3, b, heads, t, d
    auto att = torch::softmax(torch::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(double(d)), -1);
    auto ctx = torch::matmul(att, parts[2]).transpose(1, 2).reshape({b, t, h});
    auto y = ln1(x + out(ctx));
    return ln2(y + fc2(torch::gelu(fc1(y))));
  }
  std::int64_t heads;
  torch::nn::Linear qkv, out;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear fc1, fc2;
  torch::nn::LayerNorm ln2;
};
TORCH_MODULE(Layer);

struct BertTinyImpl : torch::nn::Module {
  explicit BertTinyImpl(const Settings& s)
      : tokens(register_module("tokens", torch::nn::Embedding(s.vocab, s.hidden))),
        positions(register_module("positions", torch::nn::Embedding(s.max_seq, s.hidden))),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.hidden})))),
        head(register_module("head", torch::nn::Linear(s.hidden, s.vocab))) {
    for (std::int64_t i = 0; i < s.layers; ++i)
      layers.push_back(register_module("layer" + std::to_string(i), Layer(s)));
  }
  // Masked-LM loss at `where` (flat positions) against `labels`.
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& where, const torch::Tensor& labels) {
    auto x = ln(tokens(ids) + positions(torch::arange(ids.size(1), ids.options())).unsqueeze(0));
    for (auto& l : layers) x = l(x);
    auto picked = x.reshape({-1, x.size(-1)}).index_select(0, where);
    return torch::cross_entropy_loss(head(picked), labels);
  }
  torch::nn::Embedding tokens, positions;
  torch::nn::LayerNorm ln;
  torch::nn::Linear head;
  std::vector<Layer> layers;
};
TORCH_MODULE(BertTiny);

long rss_kb() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}
long peak_kb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

std::int64_t parameter_count(const Settings& s) {
  BertTiny model(s);
  std::int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  return n;
}

template <class Precision>
double run(const Settings& s) {
  torch::manual_seed(0);
  BertTiny model(s);
  tk::Trainer<Precision, tk::AccumulationPolicy<tk::Dynamic>, tk::ClipPolicy<tk::ClipNorm>> trainer(
      model, tk::AdamW{1e-4, 1e-2}.eps(1e-6),
      tk::TrainerOptions().max_grad_norm(1.0).accumulation_steps(s.accumulate).master_chunk(s.master_chunk));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const std::int64_t masked = s.batch * s.seq * 15 / 100;
  tk::StepReport last;
  for (std::int64_t w = 0; w < s.windows * s.accumulate; ++w) {
    auto ids = torch::randint(s.vocab, {s.batch, s.seq}, gen, torch::kLong);
    auto where = torch::randperm(s.batch * s.seq, gen, torch::kLong).narrow(0, 0, masked);
    auto labels = torch::randint(s.vocab, {masked}, gen, torch::kLong);
    const auto result = trainer.micro_step([&] { return model->loss(ids, where, labels); });
    if (result.window_closed) last = result.report;
  }
  return last.loss();
}

int run_one(const std::string& name, const Settings& s) {
  const long baseline = rss_kb();
  double loss = 0;
  if (name == "fp32") loss = run<tk::PrecisionPolicy<tk::FP32>>(s);
  else if (name == "autocast_fp16") loss = run<tk::PrecisionPolicy<tk::FP16Dynamic>>(s);
  else if (name == "autocast_bf16") loss = run<tk::PrecisionPolicy<tk::BF16>>(s);
  else if (name == "master_fp16") loss = run<tk::PrecisionPolicy<tk::MasterWeights<tk::FP16Dynamic>>>(s);
  else if (name == "master_bf16") loss = run<tk::PrecisionPolicy<tk::MasterWeights<tk::BF16>>>(s);
  else {
    std::cerr << "unknown configuration " << name << "\n";
    return 2;
  }
  std::cout << name << " " << peak_kb() << " " << baseline << " " << loss << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::string config, pass;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--config") config = v;
    else if (a == "--batch") s.batch = std::stoll(v);
    else if (a == "--seq") s.seq = std::stoll(v);
    else if (a == "--windows") s.windows = std::stoll(v);
    else if (a == "--repeat") s.repeat = std::max<std::int64_t>(1, std::stoll(v));
    else if (a == "--accumulate") s.accumulate = std::max<std::int64_t>(1, std::stoll(v));
    else if (a == "--vocab") s.vocab = std::stoll(v);
    else if (a == "--hidden") s.hidden = std::stoll(v);
    else if (a == "--heads") s.heads = std::stoll(v);
    else if (a == "--ffn") s.ffn = std::stoll(v);
    else if (a == "--layers") s.layers = std::stoll(v);
    else if (a == "--master-chunk") s.master_chunk = std::stoll(v);
    else {
      std::cerr << "usage: " << argv[0] << " [--config NAME] [--batch B] [--seq S] [--windows W] [--repeat R]"
                << " [--accumulate N] [--vocab V] [--hidden H] [--heads A] [--ffn F] [--layers L] [--master-chunk C]\n";
      return 2;
    }
    if (a != "--config" && a != "--repeat") pass += " " + a + " " + v;
  }
  torch::set_num_threads(1);
  if (!config.empty()) return run_one(config, s);

  const auto parameters = parameter_count(s);
  std::cout << "BERT-like (vocab " << s.vocab << ", hidden " << s.hidden << ", FFN " << s.ffn << ", " << s.layers
            << " layers: " << parameters << " parameters), batch " << s.batch << " x seq " << s.seq
            << ", AdamW fused, " << s.windows << " windows of " << s.accumulate << " micro-batches, CPU, one process per configuration and run, median of " << s.repeat
            << " runs (glibc's high-water mark varies by tens of MiB between identical runs)\n\n";
  std::cout << std::left << std::setw(16) << "configuration" << std::right << std::setw(12) << "peak MiB"
            << std::setw(14) << "baseline MiB" << std::setw(14) << "training MiB" << std::setw(12) << "vs fp32"
            << std::setw(10) << "B/param" << std::setw(10) << "loss" << "\n";
  double fp32_training = 0;
  char path[4096] = {};
  const ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  const std::string self = length > 0 ? std::string(path, static_cast<size_t>(length)) : std::string(argv[0]);
  for (const char* name : {"fp32", "autocast_fp16", "autocast_bf16", "master_fp16", "master_bf16"}) {
    const std::string command = "'" + self + "' --config " + std::string(name) + pass;
    std::vector<std::pair<long, long>> runs;  // (peak - baseline, baseline)
    double loss = 0;
    for (std::int64_t r = 0; r < s.repeat; ++r) {
      FILE* p = popen(command.c_str(), "r");
      char got[64] = {};
      long peak_r = 0, baseline_r = 0;
      const int n = p ? std::fscanf(p, "%63s %ld %ld %lf", got, &peak_r, &baseline_r, &loss) : 0;
      if (p) pclose(p);
      if (n == 4) runs.emplace_back(peak_r - baseline_r, baseline_r);
    }
    if (runs.empty()) {
      std::cout << name << ": failed\n";
      continue;
    }
    std::sort(runs.begin(), runs.end());
    const auto [delta, baseline] = runs[runs.size() / 2];
    const long peak = delta + baseline;
    const double training = delta / 1024.0;
    if (fp32_training == 0) fp32_training = training;
    std::cout << std::left << std::setw(16) << name << std::right << std::fixed << std::setprecision(1)
              << std::setw(12) << peak / 1024.0 << std::setw(14) << baseline / 1024.0 << std::setw(14)
              << training << std::setw(12) << std::setprecision(2) << training / fp32_training
              << std::setw(10) << std::setprecision(1) << delta * 1024.0 / static_cast<double>(parameters)
              << std::setw(10) << std::setprecision(3) << loss << "\n";
  }
  return 0;
}
