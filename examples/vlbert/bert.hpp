#pragma once
/// A Hugging Face BERT directory as VL-BERT's language stream (NETWORK.BERT_MODEL_NAME): its
/// config.json gives the text stream's sizes, vocab.txt the tokenizer, and model.safetensors or
/// pytorch_model.bin the weights, loaded under BERT's names through one table (bert_name_table).
///
///   const auto bert = vlbert::BertDirectory::open("model/");   // config.json, vocab.txt, weights
///   bert.apply(config);                 // VLBertConfig: sizes from config.json
///   VLBertForPretraining model(config, 6);
///   const auto report = vlbert::load_bert(*model, "vlbert.", bert.weights_file());
///
/// What does not match by design is said in the report, as VL-BERT does it: BERT has 2 token
/// types and VL-BERT 3 (the two are loaded, the third keeps its initialisation); a file without
/// BERT's MLM head (a sentence-transformers model) leaves the head's transform new (its decoder
/// is the word embeddings in both).
#include "model.hpp"
#include "tokenizer.hpp"

#include <trainkit/io/weights.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace vlbert {

/// The files of a BERT directory, checked: config.json (a BERT's), vocab.txt (as many tokens as
/// the word embeddings have rows), weights.
struct BertDirectory {
  std::string dir, weights;  // weights: model.safetensors, else pytorch_model.bin
  nlohmann::json config;     // config.json

  static BertDirectory open(const std::string& dir) {
    BertDirectory d;
    d.dir = dir;
    const std::string config_path = dir + "/config.json";
    std::ifstream in(config_path);
    if (!in) throw std::runtime_error("BERT directory '" + dir + "': cannot open " + config_path);
    try {
      d.config = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(config_path + ": not JSON (" + e.what() + ")");
    }
    const auto type = d.config.value("model_type", std::string());
    if (type != "bert")
      throw std::runtime_error(config_path + ": model_type is \"" + type + "\", not \"bert\": a BERT directory is needed");
    for (const char* key : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                            "max_position_embeddings", "type_vocab_size"})
      if (!d.config.contains(key) || !d.config[key].is_number_integer() || d.config[key].get<std::int64_t>() < 1)
        throw std::runtime_error(config_path + ": " + key + " must be a positive integer" +
                                 (d.config.contains(key) ? ", got " + d.config[key].dump() : ", and is missing"));
    const auto act = d.config.value("hidden_act", std::string("gelu"));
    if (act != "gelu")
      throw std::runtime_error(config_path + ": hidden_act \"" + act + "\": the example's encoder is BERT's with \"gelu\" (erf)");
    const auto position = d.config.value("position_embedding_type", std::string("absolute"));
    if (position != "absolute")
      throw std::runtime_error(config_path + ": position_embedding_type \"" + position + "\": only \"absolute\" is supported");
    for (const char* name : {"model.safetensors", "pytorch_model.bin"})
      if (std::ifstream(dir + "/" + name).good()) {
        d.weights = dir + "/" + name;
        break;
      }
    d.tokenizer_.emplace(BertTokenizer::from_directory(dir));  // vocab.txt, read once: a missing one is named
    const auto vocab = d.tokenizer_->size();
    if (vocab != d.config["vocab_size"].get<std::int64_t>())
      throw std::runtime_error(dir + "/vocab.txt has " + std::to_string(vocab) + " tokens, but " + config_path + " says vocab_size " +
                               d.config["vocab_size"].dump() + ": the vocabulary does not match the embedding");
    return d;
  }

  /// The directory's tokenizer (vocab.txt, tokenizer_config.json).
  const BertTokenizer& tokenizer() const { return *tokenizer_; }

  /// The weights file; throws naming the directory where it has none.
  const std::string& weights_file() const {
    if (weights.empty())
      throw std::runtime_error("BERT directory '" + dir + "' has no weights (model.safetensors or pytorch_model.bin)");
    return weights;
  }

  /// config.json's value of a size, by its key.
  std::int64_t size(const std::string& key) const { return config.at(key).get<std::int64_t>(); }

  /// Sets the text stream's sizes in `c` from config.json. VL-BERT's 3 token types stay 3
  /// (BERT's 2 are loaded into the first two).
  void apply(VLBertConfig& c) const {
    c.vocab_size = size("vocab_size");
    c.hidden_size = size("hidden_size");
    c.num_hidden_layers = size("num_hidden_layers");
    c.num_attention_heads = size("num_attention_heads");
    c.intermediate_size = size("intermediate_size");
    c.max_position_embeddings = size("max_position_embeddings");
    c.hidden_dropout_prob = config.value("hidden_dropout_prob", c.hidden_dropout_prob);
    c.attention_probs_dropout_prob = config.value("attention_probs_dropout_prob", c.attention_probs_dropout_prob);
    c.initializer_range = config.value("initializer_range", c.initializer_range);
    c.layer_norm_eps = config.value("layer_norm_eps", c.layer_norm_eps);
    c.type_vocab_size = std::max<std::int64_t>(3, size("type_vocab_size"));
    const BertTokenizer& t = tokenizer();
    c.pad_id = config.value("pad_token_id", t.id("[PAD]"));
    c.img_id = t.id("[unused0]");
    c.end_id = t.id("[unused1]");
  }

 private:
  std::optional<BertTokenizer> tokenizer_;  // made by open()
};

/// BERT's names (Hugging Face's BertModel / BertForPreTraining, without "bert.") -> the example's,
/// as regular expressions: one table for every weight the text stream and the MLM head take.
/// "gamma"/"beta" are the LayerNorm names of files saved before PyTorch 1.0.
inline const std::vector<std::pair<std::regex, std::string>>& bert_name_table() {
  static const std::pair<const char*, const char*> names[] = {
      {R"(embeddings\.word_embeddings\.weight)", "word_embeddings.weight"},
      {R"(embeddings\.position_embeddings\.weight)", "position_embeddings.weight"},
      {R"(embeddings\.token_type_embeddings\.weight)", "token_type_embeddings.weight"},
      {R"(embeddings\.LayerNorm\.(weight|gamma))", "embedding_LayerNorm.weight"},
      {R"(embeddings\.LayerNorm\.(bias|beta))", "embedding_LayerNorm.bias"},
      {R"(encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias))", "encoder.$1.$2.$3"},
      {R"(encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias))", "encoder.$1.attention_output.$2"},
      {R"(encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|gamma))", "encoder.$1.attention_ln.weight"},
      {R"(encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(bias|beta))", "encoder.$1.attention_ln.bias"},
      {R"(encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias))", "encoder.$1.intermediate.$2"},
      {R"(encoder\.layer\.(\d+)\.output\.dense\.(weight|bias))", "encoder.$1.output.$2"},
      {R"(encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|gamma))", "encoder.$1.output_ln.weight"},
      {R"(encoder\.layer\.(\d+)\.output\.LayerNorm\.(bias|beta))", "encoder.$1.output_ln.bias"},
      // The MLM head (BertForPreTraining's "cls."): outside the backbone, so "../" climbs out of it.
      {R"(cls\.predictions\.transform\.dense\.(weight|bias))", "../mlm_head_transform.0.$1"},
      {R"(cls\.predictions\.transform\.LayerNorm\.(weight|gamma))", "../mlm_head_transform.2.weight"},
      {R"(cls\.predictions\.transform\.LayerNorm\.(bias|beta))", "../mlm_head_transform.2.bias"},
      {R"(cls\.predictions\.bias)", "../mlm_head_bias"},
  };
  static const auto table = [] {  // compiled once
    std::vector<std::pair<std::regex, std::string>> t;
    for (const auto& [pattern, target] : names) t.emplace_back(std::regex(pattern), target);
    return t;
  }();
  return table;
}

/// The example's name of a BERT weight ("" where it has none: the pooler, the NSP head, the
/// decoder, which is the word embeddings, position_ids), under `prefix` (the backbone's place in
/// the model, e.g. "vlbert.").
inline std::string bert_name(std::string name, const std::string& prefix) {
  if (name.rfind("bert.", 0) == 0) name = name.substr(5);
  for (const auto& [re, target] : bert_name_table()) {
    if (!std::regex_match(name, re)) continue;
    std::string mapped = std::regex_replace(name, re, target);
    if (mapped.rfind("../", 0) == 0) return mapped.substr(3);  // beside the backbone, at the top
    return prefix + mapped;
  }
  return "";
}

/// What load_bert() did: tk::WeightsReport's lists (the model's names), and what differed by design.
struct BertLoad {
  trainkit::WeightsReport weights;
  std::vector<std::string> notes;  // shapes that differ by design, and what was done
};

/// Loads a BERT weights file into `model`, whose VLBert backbone sits at `prefix` ("vlbert."),
/// through bert_name_table(). Rows of the token-type embedding beyond BERT's keep their
/// initialisation (said in the notes); any other shape that differs is an error naming the
/// weight and the file, as is a file with no BERT weight at all.
inline BertLoad load_bert(torch::nn::Module& model, const std::string& prefix, const std::string& path) {
  std::map<std::string, torch::Tensor> file;
  std::vector<std::string> unused;
  for (auto& [name, t] : trainkit::read_weights(path)) {
    const std::string mapped = bert_name(name, prefix);
    if (mapped.empty()) unused.push_back(name);
    else file[mapped] = std::move(t);
  }
  if (file.empty())
    throw std::runtime_error("'" + path + "' holds no BERT weights (embeddings.word_embeddings.weight, encoder.layer.N..., "
                             "with or without \"bert.\")");
  // config.json sized the model: a shape that differs is an error, but for the token types,
  // where BERT's rows come first and the model's own initialisation fills the rest.
  BertLoad r;
  for (const auto& p : model.named_parameters(true)) {
    const auto it = file.find(p.key());
    if (it == file.end()) continue;
    torch::Tensor& from = it->second;
    const torch::Tensor& target = p.value();
    const bool token_types = p.key() == prefix + "token_type_embeddings.weight";
    if (token_types && from.dim() == 2 && from.size(1) == target.size(1) && from.size(0) < target.size(0)) {
      torch::Tensor padded = target.detach().to(from.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      padded.narrow(0, 0, from.size(0)).copy_(from);
      r.notes.push_back(p.key() + ": BERT's " + std::to_string(from.size(0)) + " token types loaded into rows 0-" +
                        std::to_string(from.size(0) - 1) + "; rows " + std::to_string(from.size(0)) + "-" +
                        std::to_string(target.size(0) - 1) + " (VL-BERT's visual segment) keep their initialisation");
      from = padded;
    } else if (from.sizes() != target.sizes()) {
      throw std::runtime_error("'" + path + "': " + p.key() + " has shape " + trainkit::detail::shape_string(from.sizes()) +
                               " in the file and " + trainkit::detail::shape_string(target.sizes()) +
                               " in the model (config.json and the weights disagree)");
    }
  }
  r.weights = trainkit::load_named_weights(model, file);
  r.weights.unused.insert(r.weights.unused.end(), unused.begin(), unused.end());
  const bool head = std::any_of(r.weights.loaded.begin(), r.weights.loaded.end(),
                                [](const std::string& n) { return n.rfind("mlm_head_", 0) == 0; });
  const bool has_head = std::any_of(r.weights.not_loaded.begin(), r.weights.not_loaded.end(),
                                    [](const std::string& n) { return n.rfind("mlm_head_", 0) == 0; });
  if (!head && has_head)
    r.notes.push_back("the file has no MLM head (cls.predictions: a sentence encoder's file): the head's transform and bias "
                      "are new; its decoder is the loaded word embeddings");
  return r;
}

/// For each sentence, BERT's input ([CLS] tokens [SEP]) and the text stream's last hidden states
/// with the directory's weights, as JSON: {"bert", "weights", "sentences": [{"text", "tokens",
/// "ids", "hidden": [[H floats] per token]}]} (`vlbert encode`: a user's check of their own
/// directory against transformers.BertModel).
inline nlohmann::json encode_sentences(const std::string& dir, const std::vector<std::string>& sentences) {
  const BertDirectory bert = BertDirectory::open(dir);
  const BertTokenizer& tok = bert.tokenizer();
  VLBertConfig c;
  bert.apply(c);
  torch::manual_seed(0);
  VLBert model(c);
  const BertLoad load = load_bert(*model, "", bert.weights_file());
  model->eval();
  torch::NoGradGuard no_grad;
  nlohmann::json out = {{"bert", dir}, {"weights", bert.weights}, {"sentences", nlohmann::json::array()}};
  for (const auto& text : sentences) {
    std::vector<std::string> tokens = {"[CLS]"};
    for (auto& t : tok.tokenize(text)) tokens.push_back(std::move(t));
    tokens.emplace_back("[SEP]");
    if (static_cast<std::int64_t>(tokens.size()) > c.max_position_embeddings)
      throw std::runtime_error("a sentence of " + std::to_string(tokens.size()) + " tokens is longer than max_position_embeddings (" +
                               std::to_string(c.max_position_embeddings) + ") of " + dir + "/config.json");
    std::vector<std::int64_t> ids;
    for (const auto& t : tokens) ids.push_back(tok.id(t));
    const auto hidden = model->encode_text(torch::tensor(ids).unsqueeze(0)).squeeze(0).to(torch::kDouble).contiguous();
    std::vector<std::vector<double>> rows;
    for (std::int64_t i = 0; i < hidden.size(0); ++i) {
      const double* row = hidden[i].data_ptr<double>();
      rows.emplace_back(row, row + hidden.size(1));
    }
    out["sentences"].push_back({{"text", text}, {"tokens", tokens}, {"ids", ids}, {"hidden", rows}});
  }
  out["loaded"] = load.weights.loaded.size();
  out["unused"] = load.weights.unused;
  out["not_loaded"] = load.weights.not_loaded;
  return out;
}

}  // namespace vlbert
