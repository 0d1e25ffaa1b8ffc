#pragma once
/// A compact VL-BERT (Su et al., ICLR 2020) in LibTorch: one BERT encoder over the joint
/// sequence [CLS] words [SEP] [IMG]... [END].
///
/// Each input element's embedding is the sum of four (VL-BERT, section 3.2):
///   token     the word, or [IMG] for a region;
///   visual    the region's appearance feature and box geometry, projected into the hidden space
///             (VL-BERT's "visual feature embedding"; words get the whole image's);
///   segment   A for words, C for regions;
///   position  0, 1, 2... for words; one shared position for every region (regions are a set).
/// The encoder is BERT's: post-LN layers, GELU. Heads: masked language modelling (decoder tied
/// to the word embeddings) and masked region classification for pre-training; for VQA, an
/// answer classifier on the [MASK] token after the question.
///
/// Parameter names follow VL-BERT's where they exist (vlbert.word_embeddings, ...,
/// final_mlp.1.weight), so that partial loading (NETWORK.PARTIAL_PRETRAIN) matches by name.
#include "scenes.hpp"

#include <trainkit/trainer/recompute.hpp>
#include <trainkit/trainer/unit.hpp>

#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/activation.h>

#include <cmath>
#include <cstdint>

namespace vlbert {

/// NETWORK.VLBERT: the encoder's sizes (VL-BERT's key names and meanings).
struct VLBertConfig {
  std::int64_t vocab_size = 64, hidden_size = 64, num_hidden_layers = 2, num_attention_heads = 2,
               intermediate_size = 128, max_position_embeddings = 64, type_vocab_size = 3;
  double hidden_dropout_prob = 0.1, attention_probs_dropout_prob = 0.1;
  std::int64_t visual_size = 32;    // region feature size (must equal DATASET.FEATURE_DIM)
  std::int64_t geometry_frequencies = 8;  // sinusoids per box coordinate
  bool visual_ln = true;
  // Initial weights of the visual LayerNorms (VL-BERT's visual_scale_*_init): 0 lets the words
  // start as plain BERT input, the whole image's feature fading in as training finds it useful.
  double visual_scale_text_init = 0.0, visual_scale_object_init = 1.0;
  double initializer_range = 0.02;  // standard deviation of the initial weights (BERT's)
  double layer_norm_eps = 1e-12;    // BERT's config.json layer_norm_eps
  bool recompute = false;  // NETWORK.RECOMPUTE: each layer's activations made again in backward
  // The ids the model itself writes: padding, and the rows of word_embeddings that stand for
  // every region ([IMG]) and for the end of the sequence ([END]). A real BERT vocabulary has no
  // [IMG]/[END]: its [unused0]/[unused1] rows serve (untrained in BERT, as VL-BERT's own new
  // object_linguistic_embeddings and end_embedding are).
  std::int64_t pad_id = Vocabulary::PAD, img_id = Vocabulary::IMG, end_id = Vocabulary::END;
};

/// BERT's layer, post-LN: x = LN(x + Attention(x)); x = LN(x + W2 GELU(W1 x)).
struct LayerImpl : torch::nn::Module {
  explicit LayerImpl(const VLBertConfig& c)
      : heads(c.num_attention_heads),
        query(register_module("query", torch::nn::Linear(c.hidden_size, c.hidden_size))),
        key(register_module("key", torch::nn::Linear(c.hidden_size, c.hidden_size))),
        value(register_module("value", torch::nn::Linear(c.hidden_size, c.hidden_size))),
        attention_output(register_module("attention_output", torch::nn::Linear(c.hidden_size, c.hidden_size))),
        attention_ln(register_module("attention_ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)))),
        intermediate(register_module("intermediate", torch::nn::Linear(c.hidden_size, c.intermediate_size))),
        output(register_module("output", torch::nn::Linear(c.intermediate_size, c.hidden_size))),
        output_ln(register_module("output_ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)))),
        attention_dropout(register_module("attention_dropout", torch::nn::Dropout(c.attention_probs_dropout_prob))),
        dropout(register_module("dropout", torch::nn::Dropout(c.hidden_dropout_prob))) {}

  /// x [B, L, H]; bias [B, 1, 1, L]: 0 where attended, -10000 at padding (BERT's additive mask).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias) {
    const auto b = x.size(0), l = x.size(1), h = x.size(2);
    auto split = [&](const torch::Tensor& t) { return t.view({b, l, heads, h / heads}).transpose(1, 2); };
    const auto q = split(query(x));
    // softmax(q k^T / sqrt(d) + bias) v, with dropout on the probabilities while training, in
    // one call: ATen picks a fused kernel where one fits (on CUDA the memory-efficient one,
    // which takes an additive mask; on the CPU its flash kernel) and its math otherwise. The
    // mask in the queries' dtype (half under autocast): the call wants one dtype.
    const double p = is_training() ? attention_dropout->options.p() : 0.0;
    const auto context = at::scaled_dot_product_attention(q, split(key(x)), split(value(x)), bias.to(q.scalar_type()), p)
                             .transpose(1, 2)
                             .reshape({b, l, h});
    const auto y = attention_ln(x + dropout(attention_output(context)));
    return output_ln(y + dropout(output(torch::gelu(intermediate(y)))));
  }

  std::int64_t heads;
  torch::nn::Linear query, key, value, attention_output;
  torch::nn::LayerNorm attention_ln;
  torch::nn::Linear intermediate, output;
  torch::nn::LayerNorm output_ln;
  torch::nn::Dropout attention_dropout, dropout;  // attention_dropout: its p, given to the fused call
};
TORCH_MODULE(Layer);

/// The shared backbone: embeddings and encoder. forward() returns the hidden states of the
/// joint sequence [B, T + R + 1, H]: T text positions, R regions, [END].
struct VLBertImpl : torch::nn::Module {
  explicit VLBertImpl(const VLBertConfig& c)
      : config(c),
        word_embeddings(register_module("word_embeddings", torch::nn::Embedding(c.vocab_size, c.hidden_size))),
        position_embeddings(register_module("position_embeddings", torch::nn::Embedding(c.max_position_embeddings, c.hidden_size))),
        token_type_embeddings(register_module("token_type_embeddings", torch::nn::Embedding(c.type_vocab_size, c.hidden_size))),
        // Region appearance + geometry -> visual space (VL-BERT's obj_downsample after the
        // RoI head), then one projection each for words (the whole image) and for regions.
        obj_downsample(register_module("obj_downsample", torch::nn::Linear(c.visual_size + 8 * c.geometry_frequencies, c.hidden_size))),
        visual_1x1_text(register_module("visual_1x1_text", torch::nn::Linear(c.hidden_size, c.hidden_size))),
        visual_1x1_object(register_module("visual_1x1_object", torch::nn::Linear(c.hidden_size, c.hidden_size))),
        visual_ln_text(register_module("visual_ln_text", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)))),
        visual_ln_object(register_module("visual_ln_object", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)))),
        embedding_ln(register_module("embedding_LayerNorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)))),
        dropout(register_module("embedding_dropout", torch::nn::Dropout(c.hidden_dropout_prob))),
        layers(register_module("encoder", torch::nn::ModuleList())) {
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(Layer(c));
    // BERT's initialisation: N(0, initializer_range) weights, zero biases, unit LayerNorms.
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      if (p.key().find("ln") != std::string::npos || p.key().find("LayerNorm") != std::string::npos) continue;
      if (p.key().find("bias") != std::string::npos) p.value().zero_();
      else p.value().normal_(0, c.initializer_range);
    }
    visual_ln_text->weight.fill_(c.visual_scale_text_init);
    visual_ln_object->weight.fill_(c.visual_scale_object_init);
  }

  /// Sinusoids of the box coordinates at geometric frequencies (VL-BERT's coordinate embedding).
  torch::Tensor geometry(const torch::Tensor& boxes) const {
    const auto f = torch::pow(2.0, torch::arange(config.geometry_frequencies, boxes.options())) * 3.14159265;
    const auto angles = boxes.unsqueeze(-1) * f;  // [B, R, 4, F]
    return torch::cat({angles.sin(), angles.cos()}, -1).flatten(2);
  }

  /// BERT's embeddings of the words before their LayerNorm: word + position + segment A.
  torch::Tensor text_embeddings(const torch::Tensor& text) {
    const auto positions = torch::arange(text.size(1), text.options()).unsqueeze(0);
    return word_embeddings(text) + position_embeddings(positions) + token_type_embeddings->weight[0];
  }

  /// The encoder's layers over x [B, L, H] with BERT's additive mask bias [B, 1, 1, L].
  torch::Tensor encode(torch::Tensor x, const torch::Tensor& bias) {
    for (const auto& layer : *layers) {
      LayerImpl* l = layer->as<Layer>();
      // NETWORK.RECOMPUTE: keep only each layer's input; its activations are made again in
      // backward (the same dropout masks), for one more forward per layer. Each layer is a
      // unit (TRAIN.ZERO_STAGE 3 gathers its parameters around its call; otherwise the call).
      x = trainkit::unit(l, [&](const torch::Tensor& in) {
        return config.recompute
                   ? trainkit::recompute([l](const torch::Tensor& y, const torch::Tensor& mask) { return l->forward(y, mask); },
                                         in, bias)
                   : l->forward(in, bias);
      }, x);
    }
    return x;
  }

  /// BERT's mask bias of keep [B, L] (1 attended, 0 padding): 0 or -10000 (BERT's additive mask).
  static torch::Tensor mask_bias(const torch::Tensor& keep) {
    return ((1.0 - keep) * -10000.0).view({keep.size(0), 1, 1, keep.size(1)});
  }

  /// The text stream alone, as BERT reads a sentence: text [B, T] (padded with pad_id) -> the
  /// last hidden states [B, T, H]. With a BERT directory's weights this is BertModel's
  /// last_hidden_state (tests/bert/check_bert.py).
  torch::Tensor encode_text(const torch::Tensor& text) {
    const auto ids = text.to(word_embeddings->weight.device());
    const auto x = dropout(embedding_ln(text_embeddings(ids)));
    return encode(x, mask_bias(ids.ne(config.pad_id).to(x.dtype())));
  }

  torch::Tensor forward(const Batch& b) {
    const auto device = word_embeddings->weight.device();
    const auto text = b.text.to(device), regions = b.regions.to(device);
    const auto text_len = text.ne(config.pad_id).sum(1, true);  // [B, 1]
    // Visual feature embedding of every region [B, R, H]; words see the whole image (region 0).
    const auto visual = torch::relu(obj_downsample(torch::cat({b.features.to(device), geometry(b.boxes.to(device))}, -1)));
    auto object_visual = visual_1x1_object(visual), text_visual = visual_1x1_text(visual.select(1, 0)).unsqueeze(1);
    if (config.visual_ln) object_visual = visual_ln_object(object_visual), text_visual = visual_ln_text(text_visual);
    text_visual = text_visual * regions.select(1, 0).view({-1, 1, 1});  // no image: no visual term

    const auto segment_c = token_type_embeddings->weight[2];
    const auto words = text_embeddings(text) + text_visual;
    const auto img = word_embeddings->weight[config.img_id] + position_embeddings(text_len) + segment_c + object_visual;
    const auto end = word_embeddings->weight[config.end_id] + position_embeddings(text_len + 1) + segment_c;
    const auto x = dropout(embedding_ln(torch::cat({words, img, end}, 1)));

    const auto keep = torch::cat({text.ne(config.pad_id).to(x.dtype()), regions.to(x.dtype()), torch::ones({text.size(0), 1}, x.options())}, 1);
    return encode(x, mask_bias(keep));
  }

  VLBertConfig config;
  torch::nn::Embedding word_embeddings, position_embeddings, token_type_embeddings;
  torch::nn::Linear obj_downsample, visual_1x1_text, visual_1x1_object;
  torch::nn::LayerNorm visual_ln_text, visual_ln_object, embedding_ln;
  torch::nn::Dropout dropout;
  torch::nn::ModuleList layers;
};
TORCH_MODULE(VLBert);

/// Cross-entropy over the labelled positions (label -1: ignored): their sum (a loss term of the
/// trainer's, weighted by its count over the whole window: tk::Task::terms) and their mean (0,
/// not NaN, when a batch has none). Also returns the number of labelled positions and of
/// correct predictions.
struct MaskedLoss {
  torch::Tensor loss, sum, count, correct;
};
inline MaskedLoss masked_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels) {
  namespace F = torch::nn::functional;
  const auto flat = logits.reshape({-1, logits.size(-1)}).to(torch::kFloat);
  const auto y = labels.reshape({-1}).to(logits.device());
  const auto valid = y.ge(0);
  const auto count = valid.sum();
  const auto sum = F::cross_entropy(flat, y, F::CrossEntropyFuncOptions().ignore_index(-1).reduction(torch::kSum));
  const auto correct = (flat.argmax(-1).eq(y) & valid).sum();
  return {sum / count.clamp_min(1), sum, count, correct};
}

/// A transform (Linear, GELU, LayerNorm) as in BERT's prediction heads.
inline torch::nn::Sequential head_transform(std::int64_t hidden) {
  return torch::nn::Sequential(torch::nn::Linear(hidden, hidden), torch::nn::GELU(),
                               torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden}).eps(1e-12)));
}

/// Pre-training: masked language modelling + masked region (category) classification.
struct VLBertForPretrainingImpl : torch::nn::Module {
  VLBertForPretrainingImpl(const VLBertConfig& c, std::int64_t num_categories)
      : vlbert(register_module("vlbert", VLBert(c))),
        mlm_transform(register_module("mlm_head_transform", head_transform(c.hidden_size))),
        mlm_bias(register_parameter("mlm_head_bias", torch::zeros({c.vocab_size}))),
        mvrc_transform(register_module("mvrc_head_transform", head_transform(c.hidden_size))),
        mvrc_classifier(register_module("mvrc_head_classifier", torch::nn::Linear(c.hidden_size, num_categories))) {}

  struct Output {
    MaskedLoss mlm, mvrc;
    torch::Tensor loss;
  };
  Output forward(const Batch& b, bool with_mlm = true, bool with_mvrc = true) {
    const auto h = vlbert(b);
    const auto t = b.text.size(1), r = b.features.size(1);
    Output out;
    // Decoder tied to the word embeddings, as BERT's. Only the labelled positions are scored
    // against the vocabulary (b.mlm_at, made on the host with the batch: no host sync): with a
    // real BERT's 30522 words, scoring every position would cost about what the encoder does.
    const auto decode = [&](const torch::Tensor& hidden) {
      return torch::matmul(mlm_transform->forward(hidden), vlbert->word_embeddings->weight.t()) + mlm_bias;
    };
    if (b.mlm_at.defined()) {
      const auto at = b.mlm_at.to(h.device());
      const auto rows = at.div(t, "floor"), columns = at.remainder(t);
      const auto picked = h.reshape({-1, h.size(2)}).index_select(0, rows * h.size(1) + columns);  // [N, H]
      out.mlm = masked_cross_entropy(decode(picked), b.mlm_labels.to(h.device()).reshape({-1}).index_select(0, at));
    } else {
      out.mlm = masked_cross_entropy(decode(h.narrow(1, 0, t)), b.mlm_labels);
    }
    out.mvrc = masked_cross_entropy(mvrc_classifier(mvrc_transform->forward(h.narrow(1, t, r))), b.mvrc_labels);
    out.loss = (with_mlm ? out.mlm.loss : out.mlm.loss * 0) + (with_mvrc ? out.mvrc.loss : out.mvrc.loss * 0);
    return out;
  }

  VLBert vlbert;
  torch::nn::Sequential mlm_transform;
  torch::Tensor mlm_bias;
  torch::nn::Sequential mvrc_transform;
  torch::nn::Linear mvrc_classifier;
};
TORCH_MODULE(VLBertForPretraining);

/// VQA: the [MASK] token's hidden state -> VL-BERT's 2-layer classifier over the answers.
struct VLBertForVQAImpl : torch::nn::Module {
  VLBertForVQAImpl(const VLBertConfig& c, std::int64_t num_answers, std::int64_t classifier_hidden, double classifier_dropout)
      : vlbert(register_module("vlbert", VLBert(c))),
        final_mlp(register_module("final_mlp", torch::nn::Sequential(
                                                   torch::nn::Dropout(classifier_dropout), torch::nn::Linear(c.hidden_size, classifier_hidden),
                                                   torch::nn::ReLU(), torch::nn::Dropout(classifier_dropout),
                                                   torch::nn::Linear(classifier_hidden, num_answers)))) {}

  /// Answer logits [B, answers].
  torch::Tensor forward(const Batch& b) {
    const auto h = vlbert(b);
    const auto at = b.answer_at.to(h.device()).view({-1, 1, 1}).expand({-1, 1, h.size(2)});
    return final_mlp->forward(h.gather(1, at).squeeze(1));
  }

  VLBert vlbert;
  torch::nn::Sequential final_mlp;
};
TORCH_MODULE(VLBertForVQA);

}  // namespace vlbert
