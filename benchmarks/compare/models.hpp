#pragma once
// The benchmark models and their data, written so that benchmarks/compare/loop.py can build the
// same thing in Python: the same modules registered in the same order under the same names, the
// same initialisation (reseeded, then N(0, 0.02) for matrices, ones for LayerNorm weights, zeros
// for biases, in named_parameters() order), and data computed by the same tensor expressions.
// With the same seed both languages therefore start from bit-identical weights and see identical
// batches; the first window's FP32 loss printed by every implementation checks it.
//
//   mlp         overhead-bound: 4 Linear layers of width 256 on 32 samples
//   bert-tiny   4 layers x 256 (4 heads, FFN 1024), vocabulary 8192, sequence 64
//   bert-8x512  8 layers x 512 (8 heads, FFN 2048), vocabulary 8192, sequence 32 (CPU-sized)
//   bert-base   12 layers x 768 (12 heads, FFN 3072), vocabulary 30522, sequence 128 (GPU check)
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace bench {

struct ModelSpec {
  std::string name;
  bool bert = true;
  int64_t layers = 0, hidden = 0, heads = 0, vocab = 0, seq = 0;
  int64_t micro_batch = 0;  ///< default sequences (samples for the MLP) per micro-batch
  int64_t in = 0, out = 0;  ///< MLP only
};

inline ModelSpec model_spec(const std::string& name) {
  if (name == "mlp") return {name, false, 4, 256, 0, 0, 0, 32, 128, 16};
  if (name == "bert-tiny") return {name, true, 4, 256, 4, 8192, 64, 4};
  if (name == "bert-8x512") return {name, true, 8, 512, 8, 8192, 32, 4};
  if (name == "bert-base") return {name, true, 12, 768, 12, 30522, 128, 32};
  throw std::invalid_argument("unknown model '" + name +
                              "' (mlp, bert-tiny, bert-8x512, bert-base)");
}

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const ModelSpec& s) {
    int64_t width = s.in;
    for (int64_t i = 0; i < s.layers; ++i) {
      const int64_t next = i + 1 == s.layers ? s.out : s.hidden;
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(width, next)));
      width = next;
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < fc.size(); ++i) {
      x = fc[i](x);
      if (i + 1 < fc.size()) x = torch::gelu(x);
    }
    return x;
  }
  std::vector<torch::nn::Linear> fc;
};
TORCH_MODULE(Mlp);

/// A post-LayerNorm BERT encoder layer (q, k, v, o projections, SDPA, GELU FFN).
struct EncoderLayerImpl : torch::nn::Module {
  EncoderLayerImpl(int64_t hidden, int64_t heads)
      : heads(heads),
        q(register_module("q", torch::nn::Linear(hidden, hidden))),
        k(register_module("k", torch::nn::Linear(hidden, hidden))),
        v(register_module("v", torch::nn::Linear(hidden, hidden))),
        o(register_module("o", torch::nn::Linear(hidden, hidden))),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})))),
        ff1(register_module("ff1", torch::nn::Linear(hidden, 4 * hidden))),
        ff2(register_module("ff2", torch::nn::Linear(4 * hidden, hidden))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})))) {}

  torch::Tensor forward(torch::Tensor x) {
    const auto b = x.size(0), s = x.size(1), h = x.size(2);
    auto split = [&](const torch::Tensor& t) { return t.view({b, s, heads, h / heads}).transpose(1, 2); };
    auto a = at::scaled_dot_product_attention(split(q(x)), split(k(x)), split(v(x)));
    a = a.transpose(1, 2).reshape({b, s, h});
    x = ln1(x + o(a));
    return ln2(x + ff2(torch::gelu(ff1(x))));
  }

  int64_t heads;
  torch::nn::Linear q, k, v, o;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear ff1, ff2;
  torch::nn::LayerNorm ln2;
};
TORCH_MODULE(EncoderLayer);

/// Token + position embeddings, LayerNorm, the encoder, and a masked-LM-style head over the
/// vocabulary (not tied to the embedding: one less thing to keep equal across languages).
struct BertImpl : torch::nn::Module {
  explicit BertImpl(const ModelSpec& s)
      : tok(register_module("tok", torch::nn::Embedding(s.vocab, s.hidden))),
        pos(register_module("pos", torch::nn::Embedding(s.seq, s.hidden))),
        ln_emb(register_module("ln_emb", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.hidden})))),
        layers(register_module("layers", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(s.hidden, s.vocab))) {
    for (int64_t i = 0; i < s.layers; ++i) layers->push_back(EncoderLayer(s.hidden, s.heads));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    const auto positions = torch::arange(ids.size(1), ids.options());
    auto x = ln_emb(tok(ids) + pos(positions));
    for (const auto& layer : *layers) x = layer->as<EncoderLayer>()->forward(x);
    return head(x);
  }
  torch::nn::Embedding tok, pos;
  torch::nn::LayerNorm ln_emb;
  torch::nn::ModuleList layers;
  torch::nn::Linear head;
};
TORCH_MODULE(Bert);

/// Reinitialises every parameter in named_parameters() order (loop.py does the same).
inline void init_weights(torch::nn::Module& m, uint64_t seed) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  for (auto& p : m.named_parameters(true)) {
    auto& t = p.value();
    const auto& name = p.key();
    if (t.dim() >= 2) t.normal_(0.0, 0.02);
    else if (name.size() >= 7 && name.compare(name.size() - 7, 7, ".weight") == 0) t.fill_(1.0);
    else t.zero_();
  }
}

/// A model with its loss over micro-batch k of a fixed pool (the same batches in every
/// implementation and language).
struct Task {
  ModelSpec spec;
  int64_t seq = 0;  ///< tokens per sequence in the batches (BERT)
  std::shared_ptr<torch::nn::Module> module;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> pool;  ///< (input, target) micro-batches
  std::function<torch::Tensor(const torch::Tensor&)> forward;

  /// The loss of micro-batch k (cross-entropy, mean over the micro-batch's items).
  torch::Tensor loss(int64_t k) const {
    const auto& [x, y] = pool[static_cast<size_t>(k) % pool.size()];
    auto out = forward(x);
    return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
  }
};

/// Micro-batch k: BERT token ids (b*977 + s*31 + k*7919) mod V, target (17 id + 3) mod V;
/// MLP inputs sin(0.01 i + k) with labels i mod C.
/// `seq`: tokens per sequence, at most the model's (its position table keeps its size).
inline std::pair<torch::Tensor, torch::Tensor> make_batch(const ModelSpec& s, int64_t batch,
                                                          int64_t seq, int64_t k,
                                                          torch::Device device) {
  const auto i64 = torch::dtype(torch::kLong);
  if (s.bert) {
    auto ids = (torch::arange(batch, i64).view({batch, 1}) * 977 +
                torch::arange(seq, i64).view({1, seq}) * 31 + k * 7919)
                   .remainder(s.vocab);
    auto target = (ids * 17 + 3).remainder(s.vocab);
    return {ids.to(device), target.to(device)};
  }
  auto x = torch::sin(torch::arange(batch * s.in, torch::dtype(torch::kFloat)).view({batch, s.in}) * 0.01 +
                      static_cast<double>(k));
  auto y = torch::arange(batch, i64).remainder(s.out);
  return {x.to(device), y.to(device)};
}

/// micro_batch, seq: 0 for the model's defaults.
inline Task make_task(const std::string& model, int64_t micro_batch, int64_t seq,
                      torch::Device device, int64_t pool_size = 4, uint64_t seed = 0) {
  Task task;
  task.spec = model_spec(model);
  if (micro_batch <= 0) micro_batch = task.spec.micro_batch;
  if (seq <= 0) seq = task.spec.seq;
  if (task.spec.bert && seq > task.spec.seq)
    throw std::invalid_argument("--seq " + std::to_string(seq) + " exceeds the model's " +
                                std::to_string(task.spec.seq));
  task.seq = seq;
  if (task.spec.bert) {
    Bert m(task.spec);
    task.module = m.ptr();
    task.forward = [m](const torch::Tensor& x) mutable { return m->forward(x); };
  } else {
    Mlp m(task.spec);
    task.module = m.ptr();
    task.forward = [m](const torch::Tensor& x) mutable { return m->forward(x); };
  }
  init_weights(*task.module, seed);
  task.module->to(device);
  for (int64_t k = 0; k < pool_size; ++k) task.pool.push_back(make_batch(task.spec, micro_batch, seq, k, device));
  return task;
}

inline int64_t parameter_count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

}  // namespace bench
