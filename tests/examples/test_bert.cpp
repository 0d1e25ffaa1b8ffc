// The VL-BERT example's BERT side (examples/vlbert/tokenizer.hpp, bert.hpp) on small, hand-made
// vocabularies and directories: BERT's basic tokenization and WordPiece, the name table from a
// Hugging Face BERT's weights to the example's, and the errors for a broken directory. The check
// against Hugging Face on a real BERT is tests/bert/check_bert.py (test vlbert.bert_reference).
#include "../support/helpers.hpp"

// Relative, so that no include path (a flag of every test file) changes for this one.
#include "../../examples/vlbert/vlbert.hpp"

#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace test_bert {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

using namespace vlbert;
using Strings = std::vector<std::string>;
using testing::TempDir;

Strings small_vocab() {
  return {"[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "un", "##aff", "##able", "aff",
          "hello", "world", ",", "!", "?", "$", "3", ".", "50", "cafe", "e", "##e", "日", "本", "a", "##b", "ab", "x"};
}

BertTokenizer small_tokenizer() { return BertTokenizer(small_vocab(), TokenizerOptions{}); }

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  REQUIRE(out.good());
}

std::string vocab_text(const Strings& vocab) {
  std::string s;
  for (const auto& w : vocab) s += w + "\n";
  return s;
}

/// A BERT directory with the data set's words (hidden 16, 1 layer; "leftmost" and "rightmost"
/// as two pieces each) and random weights under BERT's names, without "bert." or an MLM head as
/// a sentence encoder's. Returns the file's tensors.
trainkit::NamedTensors write_tiny_bert(const std::string& dir, bool with_diamond = true) {
  REQUIRE(::mkdir(dir.c_str(), 0755) == 0);
  Strings vocab = {"[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "left", "right", "##most"};
  const Vocabulary words;
  for (std::int64_t id = Vocabulary::kSpecials; id < words.size(); ++id) {
    const auto& w = words.word(id);
    if (w != "leftmost" && w != "rightmost" && w != "left" && w != "right" && (with_diamond || w != "diamond")) vocab.push_back(w);
  }
  const std::int64_t v = static_cast<std::int64_t>(vocab.size()), h = 16, inter = 32;
  write_file(dir + "/vocab.txt", vocab_text(vocab));
  const nlohmann::json config = {{"model_type", "bert"}, {"vocab_size", v}, {"hidden_size", h}, {"num_hidden_layers", 1},
                                 {"num_attention_heads", 2}, {"intermediate_size", inter}, {"max_position_embeddings", 64},
                                 {"type_vocab_size", 2}, {"hidden_dropout_prob", 0.0}, {"attention_probs_dropout_prob", 0.0}};
  write_file(dir + "/config.json", config.dump());
  torch::manual_seed(3);
  trainkit::NamedTensors file;
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape, bool ones = false) {
    file.push_back({name, ones ? torch::ones(shape) : torch::randn(shape) * 0.05});
  };
  add("embeddings.word_embeddings.weight", {v, h});
  add("embeddings.position_embeddings.weight", {64, h});
  add("embeddings.token_type_embeddings.weight", {2, h});
  add("embeddings.LayerNorm.weight", {h}, true), add("embeddings.LayerNorm.bias", {h});
  for (const char* m : {"attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"})
    add(std::string("encoder.layer.0.") + m + ".weight", {h, h}), add(std::string("encoder.layer.0.") + m + ".bias", {h});
  add("encoder.layer.0.attention.output.LayerNorm.weight", {h}, true), add("encoder.layer.0.attention.output.LayerNorm.bias", {h});
  add("encoder.layer.0.intermediate.dense.weight", {inter, h}), add("encoder.layer.0.intermediate.dense.bias", {inter});
  add("encoder.layer.0.output.dense.weight", {h, inter}), add("encoder.layer.0.output.dense.bias", {h});
  add("encoder.layer.0.output.LayerNorm.weight", {h}, true), add("encoder.layer.0.output.LayerNorm.bias", {h});
  trainkit::write_weights(dir + "/model.safetensors", file);
  return file;
}

trainkit::Config bert_config(const std::string& bert_dir, const std::string& out, const std::vector<std::string>& overrides = {}) {
  trainkit::Config c;
  register_sections(c);
  c.load_string(R"({
    "RNG_SEED": 7, "OUTPUT_PATH": ")" + out + R"(", "MODEL_PREFIX": "bert", "LOG_FREQUENT": 1,
    "DATASET": {"TRAIN_SCENES": 64, "VAL_SCENES": 20, "MAX_OBJECTS": 4, "FEATURE_DIM": 16},
    "NETWORK": {"BERT_MODEL_NAME": ")" + bert_dir + R"(", "BERT_FROZEN": true, "VLBERT": {"visual_size": 16}},
    "TRAIN": {"BATCH_IMAGES": 16, "END_EPOCH": 1, "OPTIMIZER": "AdamW", "LR": 1e-3, "LR_SCHEDULE": "constant"},
    "VAL": {"BATCH_IMAGES": 20}})",
                trainkit::Config::Format::json, overrides, "bert.json");
  return c;
}

}  // namespace

TEST_CASE("BERT's basic tokenizer: whitespace, punctuation, accents, case, CJK and control characters") {
  const auto tok = small_tokenizer();
  CHECK(tok.basic("Hello, World!") == Strings{"hello", ",", "world", "!"});
  CHECK(tok.basic("  tabs\tand\nnew\r\nlines\u00a0nbsp ") == Strings{"tabs", "and", "new", "lines", "nbsp"});
  CHECK(tok.basic("Café CRÈME Ñandú Ångström") == Strings{"cafe", "creme", "nandu", "angstrom"});  // NFD, marks dropped
  CHECK(tok.basic("日本語 text") == Strings{"日", "本", "語", "text"});                              // each ideograph a word
  CHECK(tok.basic("a\u0007b\u200bc\ufeffd") == Strings{"abcd"});                                    // C* characters dropped
  CHECK(tok.basic("$3.50 <x>") == Strings{"$", "3", ".", "50", "<", "x", ">"});                     // ASCII symbols split
  CHECK(tok.basic("한") == Strings{"\u1112\u1161\u11ab"});                                           // Hangul: its jamo
  CHECK(tok.basic("bad\xff utf8\xc3") == Strings{"bad", "utf8"});                                   // not UTF-8: dropped
  CHECK(tok.basic("").empty());
}

TEST_CASE("WordPiece: greedy longest match first, ## continuations, [UNK] for what cannot be spelled or is too long") {
  const auto tok = small_tokenizer();
  CHECK(tok.wordpiece("unaffable") == Strings{"un", "##aff", "##able"});
  CHECK(tok.wordpiece("ab") == Strings{"ab"});           // the longest match, not a + ##b
  CHECK(tok.wordpiece("abb") == Strings{"ab", "##b"});
  CHECK(tok.wordpiece("unknown") == Strings{"[UNK]"});   // "un" matches, "##known" cannot: the whole word
  CHECK(tok.wordpiece(std::string(100, 'x')) == Strings{"[UNK]"});  // no ##x in the vocabulary
  BertTokenizer xs({"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "x", "##x"}, TokenizerOptions{});
  CHECK(xs.wordpiece(std::string(100, 'x')).size() == 100);
  CHECK(xs.wordpiece(std::string(101, 'x')) == Strings{"[UNK]"});   // past max_chars_per_word
  CHECK(tok.tokenize("Hello, unaffable world!") == Strings{"hello", ",", "un", "##aff", "##able", "world", "!"});
  CHECK(tok.encode("the [MASK] ?") == std::vector<std::int64_t>{7, 6, 16});  // special tokens in the text stay whole
  CHECK(tok.tokenize("x[SEP]x") == Strings{"x", "[SEP]", "x"});
  CHECK_THROWS_WITH_AS(tok.id("nope"), "vocabulary: no token 'nope'", std::out_of_range);
}

TEST_CASE("A cased tokenizer keeps case and accents; mixed options are refused, naming them") {
  TokenizerOptions cased;
  cased.lower_case = cased.strip_accents = false;
  const BertTokenizer tok(small_vocab(), cased);
  CHECK(tok.basic("Café World") == Strings{"Café", "World"});
  TokenizerOptions mixed;
  mixed.strip_accents = false;
  CHECK_THROWS_WITH_AS(BertTokenizer(small_vocab(), mixed, "v.txt"),
                       "v.txt: do_lower_case true with strip_accents false is not supported (uncased models: both true; cased: both false)",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(BertTokenizer(Strings{"[PAD]", "a"}, TokenizerOptions{}, "v.txt"), "v.txt: no [UNK] token: not a BERT vocabulary",
                       std::runtime_error);
}

TEST_CASE("A BERT directory: sizes from config.json, BERT's names mapped onto the example's, the differences reported") {
  TempDir dir;
  const Strings vocab = small_vocab();
  const std::int64_t v = static_cast<std::int64_t>(vocab.size()), h = 8, inter = 16, layers = 2, positions = 40;
  write_file(dir / "vocab.txt", vocab_text(vocab));
  nlohmann::json config = {{"model_type", "bert"}, {"vocab_size", v}, {"hidden_size", h}, {"num_hidden_layers", layers},
                           {"num_attention_heads", 2}, {"intermediate_size", inter}, {"max_position_embeddings", positions},
                           {"type_vocab_size", 2}, {"layer_norm_eps", 1e-7}, {"hidden_act", "gelu"}};
  write_file(dir / "config.json", config.dump());
  // A file as BertForPreTraining saves it ("bert." prefix, pooler, MLM head, NSP head), one
  // value per tensor so that each one's place can be checked.
  trainkit::NamedTensors file;
  double value = 1;
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape) { file.push_back({name, torch::full(shape, value++)}); };
  add("bert.embeddings.word_embeddings.weight", {v, h});
  add("bert.embeddings.position_embeddings.weight", {positions, h});
  add("bert.embeddings.token_type_embeddings.weight", {2, h});
  add("bert.embeddings.LayerNorm.gamma", {h});  // pre-1.0 names
  add("bert.embeddings.LayerNorm.beta", {h});
  for (int l = 0; l < layers; ++l) {
    const std::string p = "bert.encoder.layer." + std::to_string(l) + ".";
    for (const char* m : {"attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"})
      add(p + m + ".weight", {h, h}), add(p + m + ".bias", {h});
    add(p + "attention.output.LayerNorm.weight", {h}), add(p + "attention.output.LayerNorm.bias", {h});
    add(p + "intermediate.dense.weight", {inter, h}), add(p + "intermediate.dense.bias", {inter});
    add(p + "output.dense.weight", {h, inter}), add(p + "output.dense.bias", {h});
    add(p + "output.LayerNorm.weight", {h}), add(p + "output.LayerNorm.bias", {h});
  }
  add("bert.pooler.dense.weight", {h, h});
  add("cls.predictions.transform.dense.weight", {h, h});
  add("cls.predictions.transform.LayerNorm.weight", {h});
  add("cls.predictions.bias", {v});
  add("cls.predictions.decoder.weight", {v, h});
  add("cls.seq_relationship.weight", {2, h});
  trainkit::write_weights(dir / "model.safetensors", file);

  const auto bert = BertDirectory::open(dir.path);
  CHECK(bert.weights == dir / "model.safetensors");
  VLBertConfig c;
  bert.apply(c);
  CHECK(c.vocab_size == v);
  CHECK(c.hidden_size == h);
  CHECK(c.num_hidden_layers == layers);
  CHECK(c.intermediate_size == inter);
  CHECK(c.max_position_embeddings == positions);
  CHECK(c.type_vocab_size == 3);  // VL-BERT's visual segment on top of BERT's two
  CHECK(c.layer_norm_eps == doctest::Approx(1e-7));
  CHECK(c.img_id == 1);  // [unused0], [unused1]
  CHECK(c.end_id == 2);
  torch::manual_seed(0);
  VLBertForPretraining model(c, 6);
  const auto third_row = model->vlbert->token_type_embeddings->weight[2].clone();
  const BertLoad load = load_bert(*model, "vlbert.", bert.weights_file());

  const auto params = model->named_parameters();
  const auto& f = [&](const std::string& name) {
    for (const auto& [n, t] : file)
      if (n == name) return t;
    FAIL("no " << name);
    return torch::Tensor();
  };
  CHECK(torch::equal(params["vlbert.word_embeddings.weight"], f("bert.embeddings.word_embeddings.weight")));
  CHECK(torch::equal(params["vlbert.embedding_LayerNorm.weight"], f("bert.embeddings.LayerNorm.gamma")));
  CHECK(torch::equal(params["vlbert.encoder.1.query.bias"], f("bert.encoder.layer.1.attention.self.query.bias")));
  CHECK(torch::equal(params["vlbert.encoder.0.attention_output.weight"], f("bert.encoder.layer.0.attention.output.dense.weight")));
  CHECK(torch::equal(params["vlbert.encoder.1.attention_ln.bias"], f("bert.encoder.layer.1.attention.output.LayerNorm.bias")));
  CHECK(torch::equal(params["vlbert.encoder.0.intermediate.weight"], f("bert.encoder.layer.0.intermediate.dense.weight")));
  CHECK(torch::equal(params["vlbert.encoder.1.output_ln.weight"], f("bert.encoder.layer.1.output.LayerNorm.weight")));
  CHECK(torch::equal(params["mlm_head_transform.0.weight"], f("cls.predictions.transform.dense.weight")));
  CHECK(torch::equal(params["mlm_head_bias"], f("cls.predictions.bias")));
  const auto types = params["vlbert.token_type_embeddings.weight"];
  CHECK(torch::equal(types.narrow(0, 0, 2), f("bert.embeddings.token_type_embeddings.weight")));
  CHECK(torch::equal(types[2], third_row));  // kept its initialisation
  CHECK(load.weights.loaded.size() == 5 + 16 * static_cast<std::size_t>(layers) + 3);
  // Not in the file: the visual part, the MVRC head, the MLM head's LayerNorm bias.
  CHECK(std::count(load.weights.not_loaded.begin(), load.weights.not_loaded.end(), "mlm_head_transform.2.bias") == 1);
  CHECK(std::count(load.weights.not_loaded.begin(), load.weights.not_loaded.end(), "vlbert.obj_downsample.weight") == 1);
  for (const auto& n : load.weights.not_loaded) CHECK(n.find("encoder.") == std::string::npos);
  CHECK(load.weights.unused == Strings{"bert.pooler.dense.weight", "cls.predictions.decoder.weight", "cls.seq_relationship.weight"});
  REQUIRE(load.notes.size() == 1);
  CHECK(load.notes[0].find("BERT's 2 token types loaded into rows 0-1") != std::string::npos);

  // A sentence encoder's file (no "bert.", no MLM head): the note says the head is new.
  trainkit::NamedTensors encoder_only;
  for (const auto& [n, t] : file)
    if (n.rfind("bert.", 0) == 0) encoder_only.push_back({n.substr(5), t});
  trainkit::write_weights(dir / "model.safetensors", encoder_only);
  const BertLoad second = load_bert(*model, "vlbert.", bert.weights_file());
  CHECK(second.weights.loaded.size() == 5 + 16 * static_cast<std::size_t>(layers));
  REQUIRE(second.notes.size() == 2);
  CHECK(second.notes[1].find("the file has no MLM head") != std::string::npos);

  // The text stream alone (BERT's computation, which check_bert.py compares with transformers):
  // padding does not change the hidden states of the other positions.
  model->eval();
  torch::NoGradGuard no_grad;
  const auto one = model->vlbert->encode_text(torch::tensor({4, 12, 13, 5}).unsqueeze(0));
  const auto padded = model->vlbert->encode_text(torch::tensor({4, 12, 13, 5, 0, 0}).unsqueeze(0));
  CHECK(torch::allclose(one, padded.narrow(1, 0, 4), 1e-6, 1e-6));
}

TEST_CASE("A broken BERT directory: each error names the file and what is wrong") {
  TempDir dir;
  CHECK_THROWS_WITH_AS(BertDirectory::open(dir.path), ("BERT directory '" + dir.path + "': cannot open " + dir.path + "/config.json").c_str(),
                       std::runtime_error);
  write_file(dir / "config.json", R"({"model_type": "gpt2"})");
  CHECK_THROWS_WITH_AS(BertDirectory::open(dir.path),
                       (dir.path + "/config.json: model_type is \"gpt2\", not \"bert\": a BERT directory is needed").c_str(),
                       std::runtime_error);
  nlohmann::json config = {{"model_type", "bert"}, {"vocab_size", 31}, {"hidden_size", 8}, {"num_hidden_layers", 1},
                           {"num_attention_heads", 2}, {"intermediate_size", 16}, {"max_position_embeddings", 40},
                           {"type_vocab_size", 2}};
  config.erase("hidden_size");
  write_file(dir / "config.json", config.dump());
  CHECK_THROWS_WITH_AS(BertDirectory::open(dir.path), (dir.path + "/config.json: hidden_size must be a positive integer, and is missing").c_str(),
                       std::runtime_error);
  config["hidden_size"] = 8;
  write_file(dir / "config.json", config.dump());
  CHECK_THROWS_WITH_AS(BertDirectory::open(dir.path),
                       ("BERT directory '" + dir.path + "': cannot open " + dir.path + "/vocab.txt").c_str(), std::runtime_error);
  write_file(dir / "vocab.txt", vocab_text(small_vocab()));  // 30 tokens, config says 31
  CHECK_THROWS_WITH_AS(BertDirectory::open(dir.path),
                       (dir.path + "/vocab.txt has 30 tokens, but " + dir.path +
                        "/config.json says vocab_size 31: the vocabulary does not match the embedding")
                           .c_str(),
                       std::runtime_error);
  config["vocab_size"] = 30;
  write_file(dir / "config.json", config.dump());
  const auto bert = BertDirectory::open(dir.path);
  CHECK_THROWS_WITH_AS(bert.weights_file(), ("BERT directory '" + dir.path + "' has no weights (model.safetensors or pytorch_model.bin)").c_str(),
                       std::runtime_error);
  // Weights that are not BERT's, and a BERT weight whose shape contradicts config.json.
  trainkit::write_weights(dir / "model.safetensors", {{"fc.weight", torch::zeros({2, 2})}});
  VLBertConfig c;
  bert.apply(c);
  VLBert model(c);
  CHECK_THROWS_WITH_AS(load_bert(*model, "", dir / "model.safetensors"),
                       ("'" + dir.path + "/model.safetensors' holds no BERT weights (embeddings.word_embeddings.weight, encoder.layer.N..., "
                        "with or without \"bert.\")")
                           .c_str(),
                       std::runtime_error);
  trainkit::write_weights(dir / "model.safetensors", {{"embeddings.word_embeddings.weight", torch::zeros({30, 16})}});
  CHECK_THROWS_WITH_AS(load_bert(*model, "", dir / "model.safetensors"),
                       ("'" + dir.path + "/model.safetensors': word_embeddings.weight has shape [30, 16] in the file and [30, 8] in "
                        "the model (config.json and the weights disagree)")
                           .c_str(),
                       std::runtime_error);
}

TEST_CASE("The main job from a BERT directory: its tokenizer writes the data, its sizes make the model, its weights start it") {
  TempDir dir;
  const auto file = write_tiny_bert(dir / "bert");
  const auto bert = BertDirectory::open(dir / "bert");
  const Lexicon lexicon(bert.tokenizer());
  const auto tok = bert.tokenizer();
  CHECK(lexicon.ids("leftmost") == std::vector<std::int64_t>{tok.id("left"), tok.id("##most")});
  CHECK(lexicon.ids("red") == std::vector<std::int64_t>{tok.id("red")});
  CHECK(lexicon.mask() == tok.id("[MASK]"));
  // Captions and questions in WordPiece ids; [CLS] and [SEP] are BERT's; the answer is read at BERT's [MASK].
  DataOptions o;
  o.train_scenes = 20, o.val_scenes = 10, o.scenes.feature_dim = 16;
  const SyntheticData data(o, lexicon);
  const Batch b = data.batch(true, false, 0, 0, 20, false);
  for (std::int64_t i = 0; i < b.size(); ++i) {
    CHECK(b.text[i][0].item<std::int64_t>() == tok.id("[CLS]"));
    CHECK(b.text[i][b.answer_at[i].item<std::int64_t>()].item<std::int64_t>() == tok.id("[MASK]"));
    CHECK(b.text[i][b.answer_at[i].item<std::int64_t>() + 1].item<std::int64_t>() == tok.id("[SEP]"));
  }

  // NETWORK.VLBERT may repeat config.json's sizes, not contradict them; the rest come from the directory.
  const auto given = bert_config(dir / "bert", dir / "out", {"NETWORK.VLBERT.hidden_size=16", "NETWORK.VLBERT.hidden_dropout_prob=0.2"});
  const VLBertConfig c = model_config(given);
  CHECK(c.hidden_size == 16);
  CHECK(c.vocab_size == tok.size());
  CHECK(c.num_hidden_layers == 1);
  CHECK(c.hidden_dropout_prob == doctest::Approx(0.2));  // given: kept
  CHECK(c.attention_probs_dropout_prob == doctest::Approx(0.0));  // config.json's
  CHECK_THROWS_WITH_AS(model_config(bert_config(dir / "bert", dir / "out", {"NETWORK.VLBERT.hidden_size=64"})),
                       ("NETWORK.VLBERT.hidden_size: is 64, but NETWORK.BERT_MODEL_NAME's " + dir.path +
                        "/bert/config.json says 16: leave it out, or give the same value")
                           .c_str(),
                       trainkit::ConfigError);
  CHECK_THROWS_WITH_AS(model_config(bert_config(dir / "missing", dir / "out")),
                       ("NETWORK.BERT_MODEL_NAME: BERT directory '" + dir.path + "/missing': cannot open " + dir.path + "/missing/config.json")
                           .c_str(),
                       trainkit::ConfigError);
  CHECK_THROWS_WITH_AS(pretrain(bert_config(dir / "bert", dir / "out", {"NETWORK.BERT_PRETRAINED=" + dir / "none"})),
                       ("NETWORK.BERT_PRETRAINED: neither '" + dir.path + "/none' nor '" + dir.path + "/none-0000.model' can be read").c_str(),
                       trainkit::ConfigError);
  write_tiny_bert(dir / "no_diamond", /*with_diamond=*/false);
  CHECK_THROWS_WITH_AS(Lexicon(BertDirectory::open(dir / "no_diamond").tokenizer()),
                       (dir.path + "/no_diamond/vocab.txt: the data set's word 'diamond' is [UNK] in this vocabulary").c_str(),
                       std::runtime_error);

  // A pre-training epoch with BERT_FROZEN: BERT's weights are loaded and stay as they were;
  // the new ones train.
  const RunResult r = pretrain(bert_config(dir / "bert", dir / "out"));
  REQUIRE(r.language);
  CHECK(r.language->loaded.size() == 5 + 16);
  CHECK(r.steps == 4);
  std::map<std::string, torch::Tensor> trained;
  for (auto& [name, t] : trainkit::read_weights(r.checkpoint)) trained[name] = t;
  for (const auto& [name, t] : file) {
    const std::string mapped = bert_name(name, "vlbert.");
    INFO(mapped);
    REQUIRE(trained.count(mapped));
    if (mapped == "vlbert.token_type_embeddings.weight") CHECK(torch::equal(trained[mapped].narrow(0, 0, 2), t));
    else CHECK(torch::equal(trained[mapped], t));
  }
  torch::manual_seed(7);  // RNG_SEED: the model as pretrain() made it, before training
  const VLBertForPretraining fresh(model_config(bert_config(dir / "bert", dir / "out")), 6);
  CHECK_FALSE(torch::equal(trained["vlbert.obj_downsample.weight"], fresh->vlbert->obj_downsample->weight));
}

}  // namespace test_bert
