#pragma once
/// The VL-BERT example's application layer: its configuration sections (the schema registered
/// with tk::Config), partial loading of pre-trained weights, and the two tasks (pre-training,
/// VQA) as functions of a validated configuration. The trainer comes from tk::make_trainer (the
/// registry's compiled types, trainkit::registry): nothing here is compiled per trainer type.
#include "bert.hpp"
#include "model.hpp"
#include "scenes.hpp"

#include <trainkit/config/config.hpp>
#include <trainkit/fit/evaluate.hpp>
#include <trainkit/fit/fit.hpp>
#include <trainkit/run/launch.hpp>
#include <trainkit/fit/loss_loggers.hpp>
#include <trainkit/run/registry.hpp>
#include <trainkit/parallel/sampler.hpp>
#include <trainkit/io/weights.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace vlbert {

namespace tk = trainkit;

// --- configuration ---------------------------------------------------------------------------

/// NETWORK: VL-BERT's keys (PARTIAL_PRETRAIN, the VLBERT sizes, the classifier) that apply here.
inline tk::Schema network_schema() {
  tk::Schema v;
  v.integer("vocab_size", Vocabulary().size()).min(1).doc("word vocabulary (at least the generator's)");
  v.integer("hidden_size", 64).min(1);
  v.integer("num_hidden_layers", 2).min(1);
  v.integer("num_attention_heads", 2).min(1);
  v.integer("intermediate_size", 128).min(1);
  v.string("hidden_act", "gelu").one_of({"gelu"});
  v.number("hidden_dropout_prob", 0.1).min(0).max_exclusive(1);
  v.number("attention_probs_dropout_prob", 0.1).min(0).max_exclusive(1);
  v.integer("max_position_embeddings", 64).min(1);
  v.integer("type_vocab_size", 3).min(3).doc("segments A, B, C (regions are C)");
  v.integer("visual_size", 32).min(1).doc("region feature size; must equal DATASET.FEATURE_DIM");
  v.number("initializer_range", 0.02).min_exclusive(0).doc("standard deviation of the initial weights");
  v.boolean("visual_ln", true);
  v.number("visual_scale_text_init", 0.0).doc("initial weight of the words' visual LayerNorm (VL-BERT's)");
  v.number("visual_scale_object_init", 1.0).doc("initial weight of the regions' visual LayerNorm (VL-BERT's)");
  v.integer("geometry_frequencies", 8).min(1).doc("sinusoids per box coordinate in the geometry embedding");
  v.rule([](const nlohmann::json& s, const std::string& path) {
    if (s["hidden_size"].get<std::int64_t>() % s["num_attention_heads"].get<std::int64_t>() != 0)
      throw tk::ConfigError(path + ".num_attention_heads", "must divide hidden_size (" + s["hidden_size"].dump() + "), got " +
                                                               s["num_attention_heads"].dump());
  });
  tk::Schema n;
  n.string("BERT_MODEL_NAME", "")
      .doc("a Hugging Face BERT directory (config.json, vocab.txt, model.safetensors or pytorch_model.bin; scripts/get-bert "
           "puts one at ./model/pretrained_model/all-MiniLM-L6-v2): its tokenizer, the text stream's sizes (VLBERT's may "
           "only repeat them) and the language stream's initial weights. '' = the example's own 64-word vocabulary, "
           "random weights");
  n.string("BERT_PRETRAINED", "")
      .doc("the language stream's weights from this file instead of BERT_MODEL_NAME's (any weights format, BERT's names); "
           "where no such file exists, VL-BERT's BERT_PRETRAINED-<BERT_PRETRAINED_EPOCH, 4 digits>.model");
  n.integer("BERT_PRETRAINED_EPOCH", 0).min(0);
  n.boolean("BERT_FROZEN", false)
      .doc("the weights loaded from BERT (embeddings, encoder) are not trained; the visual part and the heads are");
  n.string("PARTIAL_PRETRAIN", "")
      .doc("weights to initialise from (a trainkit checkpoint, .safetensors, or a PyTorch state_dict): every weight "
           "whose name and shape match");
  n.list("PARTIAL_PRETRAIN_PREFIX_CHANGES", tk::Field::string("")).doc("renames 'old->new' applied to the file's names");
  n.boolean("RECOMPUTE", false)
      .doc("recompute each encoder layer's activations in backward (tk::recompute): memory for one layer's "
           "activations instead of all, for one more forward per layer");
  n.boolean("WITH_MLM_LOSS", true);
  n.boolean("WITH_MVRC_LOSS", true);
  n.string("CLASSIFIER_TYPE", "2fc").one_of({"2fc"});
  n.integer("CLASSIFIER_HIDDEN_SIZE", 128).min(1);
  n.number("CLASSIFIER_DROPOUT", 0.1).min(0).max_exclusive(1);
  n.section("VLBERT", v);
  return n;
}

/// The most memory the synthetic scenes' features may take.
inline constexpr std::int64_t kMaxSceneBytes = std::int64_t{16} << 30;

/// DATASET: the synthetic scenes' sizes.
inline tk::Schema dataset_schema() {
  tk::Schema d;
  d.string("DATASET", "synthetic").one_of({"synthetic"});
  d.integer("TRAIN_SCENES", 4000).min(1).max(100000000).doc("held in memory (see the rule below)");
  d.integer("VAL_SCENES", 500).min(1).max(100000000).doc("the fixed validation split");
  d.integer("QUESTIONS_PER_SCENE", 2).min(1).max(1000).doc("VQA samples per scene");
  d.integer("MIN_OBJECTS", 2).min(1);
  d.integer("MAX_OBJECTS", 5).min(1).max(kMaxObjects);
  d.integer("FEATURE_DIM", 32).min(1).max(65536);
  d.number("FEATURE_NOISE", 1.0).min(0).doc("noise (standard deviation) on each region feature");
  d.boolean("ADD_IMAGE_AS_A_BOX", true).doc("region 0 is the whole image; words get its visual feature");
  d.number("TEXT_MASK_PROB", 0.15).min(0).max(1);
  d.number("REGION_MASK_PROB", 0.15).min(0).max(1);
  d.string("BLANK", "none").one_of({"none", "image", "question"}).doc("hide a modality: single-modality baselines");
  d.rule([](const nlohmann::json& s, const std::string& path) {
    if (s["MIN_OBJECTS"].get<std::int64_t>() > s["MAX_OBJECTS"].get<std::int64_t>())
      throw tk::ConfigError(path + ".MIN_OBJECTS", "must be <= MAX_OBJECTS (" + s["MAX_OBJECTS"].dump() + ")");
    // The scenes' region features are generated up front and held in memory: refuse a size
    // that cannot be, before it ends in std::bad_alloc (the bounds above keep this in range).
    const std::int64_t scenes = s["TRAIN_SCENES"].get<std::int64_t>() + s["VAL_SCENES"].get<std::int64_t>();
    const std::int64_t bytes = scenes * s["MAX_OBJECTS"].get<std::int64_t>() * s["FEATURE_DIM"].get<std::int64_t>() *
                               static_cast<std::int64_t>(sizeof(float));
    if (bytes > kMaxSceneBytes)
      throw tk::ConfigError(path + ".TRAIN_SCENES", "the scenes' features would take up to " + std::to_string(bytes >> 20) +
                                                        " MiB of memory (TRAIN_SCENES + VAL_SCENES) x MAX_OBJECTS x FEATURE_DIM "
                                                        "x 4 bytes; the synthetic set is held in memory, at most " +
                                                        std::to_string(kMaxSceneBytes >> 30) + " GiB: use fewer scenes");
  });
  return d;
}

/// VAL and TEST: VL-BERT's keys for evaluation batches.
inline tk::Schema eval_schema(bool test) {
  tk::Schema s;
  s.boolean("SHUFFLE", false);
  s.add("BATCH_IMAGES", tk::Field::either({tk::Field::integer(1).min(1), tk::Field::list(tk::Field::integer(1).min(1)).non_empty()}, 64));
  if (test) s.integer("TEST_EPOCH", 0).min(0);
  return s;
}

/// The application's sections, registered with `config` (call before load()).
inline void register_sections(tk::Config& config) {
  config.register_section("NETWORK", network_schema());
  config.register_section("DATASET", dataset_schema());
  config.register_section("VAL", eval_schema(false));
  config.register_section("TEST", eval_schema(true));
}

inline std::int64_t summed(const nlohmann::json& v) {
  if (!v.is_array()) return v.get<std::int64_t>();
  std::int64_t n = 0;
  for (const auto& x : v) n += x.get<std::int64_t>();
  return n;
}

inline DataOptions data_options(const tk::Config& config, std::int64_t seed) {
  const auto& d = config.tree()["DATASET"];
  DataOptions o;
  o.scenes.seed = seed;
  o.scenes.min_objects = static_cast<int>(d["MIN_OBJECTS"].get<std::int64_t>());
  o.scenes.max_objects = static_cast<int>(d["MAX_OBJECTS"].get<std::int64_t>());
  o.scenes.feature_dim = static_cast<int>(d["FEATURE_DIM"].get<std::int64_t>());
  o.scenes.feature_noise = d["FEATURE_NOISE"].get<double>();
  o.train_scenes = d["TRAIN_SCENES"].get<std::int64_t>();
  o.val_scenes = d["VAL_SCENES"].get<std::int64_t>();
  o.questions_per_scene = static_cast<int>(d["QUESTIONS_PER_SCENE"].get<std::int64_t>());
  o.image_box = d["ADD_IMAGE_AS_A_BOX"].get<bool>();
  o.text_mask_prob = d["TEXT_MASK_PROB"].get<double>();
  o.region_mask_prob = d["REGION_MASK_PROB"].get<double>();
  const auto blank = d["BLANK"].get<std::string>();
  o.blank = blank == "image" ? Blank::image : blank == "question" ? Blank::question : Blank::none;
  return o;
}

// --- BERT (NETWORK.BERT_MODEL_NAME, BERT_PRETRAINED, BERT_FROZEN) ------------------------------

/// NETWORK.BERT_MODEL_NAME's directory, checked (errors name the key and the file); none where
/// the key is empty.
inline std::optional<BertDirectory> bert_directory(const tk::Config& config) {
  const auto dir = config.get<std::string>("NETWORK.BERT_MODEL_NAME");
  if (dir.empty()) return std::nullopt;
  try {
    return BertDirectory::open(dir);
  } catch (const std::exception& e) {
    throw tk::ConfigError("NETWORK.BERT_MODEL_NAME", std::string(e.what()) +
                                                         (dir.find("pretrained_model/all-MiniLM-L6-v2") != std::string::npos
                                                              ? " (scripts/get-bert puts it there)"
                                                              : ""));
  }
}

/// How the data set writes its words: BERT's tokenizer, or the example's own vocabulary.
inline Lexicon lexicon_of(const std::optional<BertDirectory>& bert) {
  if (!bert) return Lexicon();
  return Lexicon(bert->tokenizer());
}

/// The file NETWORK.BERT_PRETRAINED names, else BERT_MODEL_NAME's weights; "" where neither is set.
inline std::string language_weights(const tk::Config& config, const std::optional<BertDirectory>& bert) {
  const auto file = config.get<std::string>("NETWORK.BERT_PRETRAINED");
  if (file.empty()) {
    if (!bert) return "";
    try {
      return bert->weights_file();
    } catch (const std::exception& e) {
      throw tk::ConfigError("NETWORK.BERT_MODEL_NAME", e.what());
    }
  }
  if (std::ifstream(file).good()) return file;
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, "-%04lld.model", static_cast<long long>(config.get<std::int64_t>("NETWORK.BERT_PRETRAINED_EPOCH")));
  if (std::ifstream(file + suffix).good()) return file + suffix;  // VL-BERT's name
  throw tk::ConfigError("NETWORK.BERT_PRETRAINED", "neither '" + file + "' nor '" + file + suffix + "' can be read");
}

/// Loads the language stream's weights (language_weights) into `model`, whose VLBert backbone is
/// at `prefix`, and freezes them with NETWORK.BERT_FROZEN; prints the report on the main rank.
/// Nothing is loaded where no BERT is configured.
inline std::optional<BertLoad> load_language(torch::nn::Module& model, const std::string& prefix, const tk::Config& config,
                                             const std::optional<BertDirectory>& bert, bool report) {
  const std::string file = language_weights(config, bert);
  const bool frozen = config.get<bool>("NETWORK.BERT_FROZEN");
  if (file.empty()) {
    if (frozen) throw tk::ConfigError("NETWORK.BERT_FROZEN", "freezes the weights loaded from BERT: set BERT_MODEL_NAME or BERT_PRETRAINED");
    return std::nullopt;
  }
  BertLoad load = load_bert(model, prefix, file);
  std::int64_t frozen_count = 0;
  if (frozen)
    for (auto& p : model.named_parameters(true))
      if (p.key().rfind(prefix, 0) == 0 &&
          std::find(load.weights.loaded.begin(), load.weights.loaded.end(), p.key()) != load.weights.loaded.end()) {
        p.value().set_requires_grad(false);
        ++frozen_count;
      }
  if (report) {
    std::cerr << "[vlbert] BERT " << file << ": loaded " << load.weights.loaded.size() << " weights"
              << (frozen ? " (" + std::to_string(frozen_count) + " of them frozen: BERT_FROZEN)" : std::string()) << ", "
              << load.weights.not_loaded.size() << " new, " << load.weights.unused.size() << " in the file unused\n";
    for (const auto& n : load.notes) std::cerr << "[vlbert]   " << n << "\n";
    for (const auto& n : load.weights.not_loaded) std::cerr << "[vlbert]   new (not in BERT): " << n << "\n";
    for (const auto& n : load.weights.unused) std::cerr << "[vlbert]   unused from the file: " << n << "\n";
    for (const auto& n : load.weights.converted) std::cerr << "[vlbert]   dtype converted: " << n << "\n";
  }
  return load;
}

/// NETWORK.VLBERT, checked against what the data need; with a BERT directory its config.json's
/// sizes (a size VLBERT also gives must equal it) and, where VLBERT leaves them out, its dropouts,
/// initializer_range and layer_norm_eps.
inline VLBertConfig model_config(const tk::Config& config, const std::optional<BertDirectory>& bert) {
  const auto& v = config.tree()["NETWORK"]["VLBERT"];
  const auto& d = config.tree()["DATASET"];
  VLBertConfig c;
  c.vocab_size = v["vocab_size"].get<std::int64_t>();
  c.hidden_size = v["hidden_size"].get<std::int64_t>();
  c.num_hidden_layers = v["num_hidden_layers"].get<std::int64_t>();
  c.num_attention_heads = v["num_attention_heads"].get<std::int64_t>();
  c.intermediate_size = v["intermediate_size"].get<std::int64_t>();
  c.hidden_dropout_prob = v["hidden_dropout_prob"].get<double>();
  c.attention_probs_dropout_prob = v["attention_probs_dropout_prob"].get<double>();
  c.max_position_embeddings = v["max_position_embeddings"].get<std::int64_t>();
  c.type_vocab_size = v["type_vocab_size"].get<std::int64_t>();
  c.visual_size = v["visual_size"].get<std::int64_t>();
  c.visual_ln = v["visual_ln"].get<bool>();
  c.initializer_range = v["initializer_range"].get<double>();
  c.visual_scale_text_init = v["visual_scale_text_init"].get<double>();
  c.visual_scale_object_init = v["visual_scale_object_init"].get<double>();
  c.geometry_frequencies = v["geometry_frequencies"].get<std::int64_t>();
  c.recompute = config.tree()["NETWORK"]["RECOMPUTE"].get<bool>();
  std::int64_t pieces_per_word = 1;
  if (bert) {
    VLBertConfig b = c;
    bert->apply(b);
    const std::map<std::string, std::pair<std::int64_t, std::int64_t>> sizes = {
        {"vocab_size", {c.vocab_size, b.vocab_size}},
        {"hidden_size", {c.hidden_size, b.hidden_size}},
        {"num_hidden_layers", {c.num_hidden_layers, b.num_hidden_layers}},
        {"num_attention_heads", {c.num_attention_heads, b.num_attention_heads}},
        {"intermediate_size", {c.intermediate_size, b.intermediate_size}},
        {"max_position_embeddings", {c.max_position_embeddings, b.max_position_embeddings}}};
    for (const auto& [key, values] : sizes)
      if (config.given("NETWORK.VLBERT." + key) && values.first != values.second)
        throw tk::ConfigError("NETWORK.VLBERT." + key, "is " + std::to_string(values.first) + ", but NETWORK.BERT_MODEL_NAME's " +
                                                           bert->dir + "/config.json says " + std::to_string(values.second) +
                                                           ": leave it out, or give the same value");
    if (config.given("NETWORK.VLBERT.type_vocab_size") && c.type_vocab_size < b.type_vocab_size)
      throw tk::ConfigError("NETWORK.VLBERT.type_vocab_size", "is " + std::to_string(c.type_vocab_size) + ", fewer than the " +
                                                                  std::to_string(b.type_vocab_size) + " of " + bert->dir + "/config.json");
    b.type_vocab_size = std::max(c.type_vocab_size, b.type_vocab_size);
    for (const auto& [key, value] : {std::pair<const char*, double*>{"hidden_dropout_prob", &b.hidden_dropout_prob},
                                     {"attention_probs_dropout_prob", &b.attention_probs_dropout_prob},
                                     {"initializer_range", &b.initializer_range}})
      if (config.given(std::string("NETWORK.VLBERT.") + key)) *value = v[key].get<double>();
    c = b;
    const Lexicon lexicon = lexicon_of(bert);
    const Vocabulary vocabulary;
    for (const auto& w : vocabulary.words())
      if (w.front() != '[') pieces_per_word = std::max<std::int64_t>(pieces_per_word, static_cast<std::int64_t>(lexicon.ids(w).size()));
  } else {
    const auto words = Vocabulary().size();
    if (c.vocab_size < words)
      throw tk::ConfigError("NETWORK.VLBERT.vocab_size", "must be >= " + std::to_string(words) + ", the words the data set uses; got " +
                                                             std::to_string(c.vocab_size));
  }
  if (c.visual_size != d["FEATURE_DIM"].get<std::int64_t>())
    throw tk::ConfigError("NETWORK.VLBERT.visual_size", "must equal DATASET.FEATURE_DIM (" + d["FEATURE_DIM"].dump() + "), got " +
                                                            std::to_string(c.visual_size));
  // Longest text: a caption of 4 words per object (each of up to pieces_per_word tokens), [CLS],
  // [SEP]; regions and [END] follow it.
  const auto longest = 4 * d["MAX_OBJECTS"].get<std::int64_t>() * pieces_per_word + 4;
  if (c.max_position_embeddings < longest)
    throw tk::ConfigError("NETWORK.VLBERT.max_position_embeddings", "must be >= " + std::to_string(longest) +
                                                                        " for DATASET.MAX_OBJECTS, got " + std::to_string(c.max_position_embeddings));
  return c;
}
inline VLBertConfig model_config(const tk::Config& config) { return model_config(config, bert_directory(config)); }

// --- partial loading (NETWORK.PARTIAL_PRETRAIN) ----------------------------------------------

/// What load_partial() did, by parameter name.
using PartialLoad = tk::WeightsReport;

/// Copies into `model` every parameter and buffer of a weights file (a trainkit checkpoint, a
/// .safetensors file or a PyTorch state_dict) whose name (after `prefix_changes`, VL-BERT's
/// "old->new" renames) and shape match (tk::load_weights), converting dtypes.
inline PartialLoad load_partial(torch::nn::Module& model, const std::string& path,
                                const std::vector<std::string>& prefix_changes = {}) {
  std::vector<tk::PrefixChange> changes;
  try {
    changes = tk::parse_prefix_changes(prefix_changes);
  } catch (const std::invalid_argument& e) {
    throw tk::ConfigError("NETWORK.PARTIAL_PRETRAIN_PREFIX_CHANGES", e.what());
  }
  return tk::load_weights(model, path, changes);
}

inline void print_partial_load(const PartialLoad& r, const std::string& path) {
  std::cerr << "[vlbert] PARTIAL_PRETRAIN " << path << ": loaded " << r.loaded.size() << " weights, "
            << r.not_loaded.size() << " not loaded, " << r.unused.size() << " in the file unused, "
            << r.converted.size() << " converted\n";
  for (const auto& n : r.not_loaded) std::cerr << "[vlbert]   not loaded (initialised afresh): " << n << "\n";
  for (const auto& n : r.unused) std::cerr << "[vlbert]   unused from the file: " << n << "\n";
  for (const auto& n : r.converted) std::cerr << "[vlbert]   dtype converted: " << n << "\n";
}

// --- the run ---------------------------------------------------------------------------------

/// Peak resident memory of this process so far (VmHWM), in MiB.
inline double peak_rss_mib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0;
}

/// What a run measured (over every rank when data-parallel).
struct RunResult {
  std::string task, trainer, device;
  int world_size = 1;
  std::vector<std::map<std::string, double>> val;  // per validated epoch
  std::vector<double> epoch_loss;                  // mean training loss per epoch
  double train_seconds = 0;                        // training only (validation excluded)
  std::int64_t train_samples = 0, steps = 0, skipped = 0;  // samples: all ranks'
  double peak_rss_mib = 0;                         // the largest of the ranks' peaks
  std::int64_t piece_items = 0, replays = 0;       // micro-batches run as pieces of at most this (0: whole)
  double plan_seconds = 0;                         // TRAIN.MEMORY_BUDGET's measuring (in train_seconds)
  double chance = 0, question_prior = 0, majority = 0;  // VQA reference points
  std::map<std::string, double> prior_by_type;          // question_prior per question type
  PartialLoad partial;
  std::optional<tk::WeightsReport> language;  // what BERT (NETWORK.BERT_MODEL_NAME / BERT_PRETRAINED) gave
  std::string checkpoint;  // the last one written (or resumed from)
  std::string evaluated;   // --eval: the weights evaluated (nothing was trained)
};

/// Runs `f` in the trainer's precision region (autocast for BF16/FP16), as training runs.
using InPrecision = std::function<void(const std::function<void()>&)>;

/// This rank's validation batches: every world_size-th of the split's batches, from its rank.
inline std::vector<std::int64_t> validation_batches(std::int64_t batches, const tk::Launch& launch) {
  std::vector<std::int64_t> mine;
  for (std::int64_t i = launch.rank(); i < batches; i += launch.world_size()) mine.push_back(i);
  return mine;
}

/// Trains `model` (already on launch.device()) with the trainer the configuration asks for
/// (tk::make_trainer; data-parallel over the launch's ranks) on the task `make_task(in_precision)`
/// builds, through tk::fit (resume, validation, checkpoints, logs, progress line). With `eval`
/// (--eval FILE): the weights in that file, validated in the configured precision, no training.
template <class Model, class MakeTask>
RunResult run_fit(const tk::RunPlan& plan, const tk::Launch& launch, Model& model, const std::string& name,
                  const std::string& eval, MakeTask&& make_task) {
  const tk::FitOptions& options = plan.fit;
  // TRAIN.ZERO_STAGE 3 with TRAIN.UNITS empty: each encoder layer is a unit (model.hpp's
  // encode() calls each through tk::unit); the embeddings and the heads stay whole.
  tk::RunPlan units_chosen = plan;
  if (plan.trainer_options.sharding() == tk::Sharding::parameters && plan.trainer_options.units().empty())
    units_chosen.trainer_options.units({"vlbert.encoder.*"});
  // --eval loads a weight file into the model itself: no parameter may be sharded away.
  if (!eval.empty() && plan.trainer_options.sharding() == tk::Sharding::parameters)
    units_chosen.trainer_options.sharding(tk::Sharding::gradients);
  const std::unique_ptr<tk::AnyTrainer> made = tk::make_trainer(units_chosen, model);
  tk::AnyTrainer& trainer = *made;
  launch.attach(trainer);  // data parallel: rank 0's weights to every rank, one all-reduce per window
  if (launch.is_main())
    std::cerr << "[vlbert] " << name << " with " << trainer.type_name() << " on " << launch.device().str()
              << (launch.world_size() > 1 ? " x " + std::to_string(launch.world_size()) + " ranks" : std::string()) << "\n";
  RunResult r;
  r.task = name;
  r.trainer = trainer.type_name();
  r.device = launch.device().str();
  r.world_size = launch.world_size();
  const InPrecision in_precision = [&](const std::function<void()>& f) {
    [[maybe_unused]] const auto region = trainer.precision_region();
    f();
  };
  tk::Task<Batch> task = make_task(in_precision);
  trainer.set_schedule(plan.make_schedule(task.batches_per_epoch(options.begin_epoch())));
  // Time per sample counts training only: the loss counts samples, validation its own time.
  double val_seconds = 0;
  const auto loss = task.loss;
  task.loss = [&, loss](const Batch& b, tk::Metrics& m) {
    r.train_samples += b.size();
    return loss(b, m);
  };
  const auto validate = task.validate;
  task.validate = [&, validate](std::int64_t epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    auto m = validate(epoch);
    val_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.val.push_back(m);
    return m;
  };
  task.items = [](const Batch& b) { return b.size(); };
  task.split = [](const Batch& b, std::int64_t parts) { return b.split(parts); };  // TRAIN.MEMORY_BUDGET, out-of-memory replay
  if (!eval.empty()) {  // VL-BERT's test.py: every weight from the file, strictly
    r.evaluated = eval;
    tk::evaluate(*model, task, eval);  // (task.validate above records the metrics in r.val)
    return r;
  }
  tk::Callbacks callbacks;
  callbacks.epoch_end = [&](tk::EpochEnd& e) {
    r.epoch_loss.push_back(e.train.count("Loss") ? e.train.at("Loss") : 0.0);
    // fit() prints the validation line itself.
  };
  const auto t0 = std::chrono::steady_clock::now();
  const tk::FitResult f = tk::fit(trainer, task, options, callbacks);
  r.train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() - val_seconds;
  r.steps = f.applied_steps;
  r.piece_items = f.piece_items;
  r.replays = f.replays;
  if (f.plan) {  // its measuring ran task.loss: those samples were not trained on
    r.plan_seconds = f.plan->seconds;
    for (const auto& [items, bytes] : f.plan->measured) r.train_samples -= items;
  }
  // A relaunch of a finished run trains nothing: its last epoch's figures come from the
  // checkpoint it resumed from.
  if (r.epoch_loss.empty() && f.train.count("Loss")) r.epoch_loss.push_back(f.train.at("Loss"));
  if (r.val.empty() && !f.validation.empty()) r.val.push_back(f.validation);
  r.skipped = f.skipped_steps;
  r.checkpoint = f.checkpoints.empty() ? f.resumed_from : f.checkpoints.back();
  std::vector<double> samples{static_cast<double>(r.train_samples)}, peak{peak_rss_mib()};
  launch.replicas().all_reduce(samples, tk::Reduce::sum);  // every rank's samples
  launch.replicas().all_reduce(peak, tk::Reduce::max);     // the largest rank's peak
  r.train_samples = static_cast<std::int64_t>(samples[0]);
  r.peak_rss_mib = peak[0];
  return r;
}

/// Pre-training: MLM + MVRC on captioned scenes; validation: MLM and MVRC accuracy (over every
/// rank's share of the validation split).
inline RunResult pretrain(const tk::Config& config, const tk::Launch& launch, const std::string& eval = {}) {
  const tk::RunPlan plan = tk::RunPlan::from(config, launch);
  const tk::FitOptions& options = plan.fit;
  const auto bert = bert_directory(config);
  const SyntheticData data(data_options(config, options.seed()), lexicon_of(bert));
  torch::manual_seed(static_cast<std::uint64_t>(options.seed()));
  VLBertForPretraining model(model_config(config, bert), 6);
  std::optional<BertLoad> language;  // on the CPU, before the move (every rank reads the same file)
  if (eval.empty()) language = load_language(*model, "vlbert.", config, bert, launch.is_main());
  model->to(launch.device());
  const auto bs = plan.batch_images, val_bs = summed(config.tree()["VAL"]["BATCH_IMAGES"]);
  const bool with_mlm = config.get<bool>("NETWORK.WITH_MLM_LOSS"), with_mvrc = config.get<bool>("NETWORK.WITH_MVRC_LOSS");
  if (!with_mlm && !with_mvrc)
    throw tk::ConfigError("NETWORK.WITH_MLM_LOSS", "and NETWORK.WITH_MVRC_LOSS are both false: pre-training would have no loss");
  const auto loggers = tk::LossLoggers::from(config).require({"mlm_loss", "mvrc_loss"});  // TRAIN.LOSS_LOGGERS
  // The loss terms, each the mean over its own items in the whole window (every rank's):
  // MLM over labelled words, MVRC over labelled regions. Each is logged under its
  // TRAIN.LOSS_LOGGERS name (the output's own where it has none).
  const auto term_name = [&](const std::string& output) {
    for (const auto& l : loggers.loggers())
      if (l.output == output) return l.name;
    return output;
  };
  std::vector<std::string> terms;
  if (with_mlm) terms.push_back(term_name("mlm_loss"));
  if (with_mvrc) terms.push_back(term_name("mvrc_loss"));
  // Each rank its shard of every epoch's order; W ranks x batch B see, window for window, the
  // samples of one process with batch W x B.
  const tk::DistributedSampler sampler(data.samples(false, false), bs, launch.rank(), launch.world_size(),
                                       static_cast<std::uint64_t>(options.seed()), config.get<bool>("TRAIN.SHUFFLE"));
  const torch::Device device = launch.device();
  RunResult r = run_fit(plan, launch, model, "pretrain", eval, [&](const InPrecision& in_precision) {
    tk::Task<Batch> task;
    task.batches_per_epoch = [&](std::int64_t) { return sampler.batches_per_epoch(); };
    task.batch = [&](std::int64_t e, std::int64_t i) { return data.batch_of(false, false, e, sampler.batch(e, i)).to(device); };
    task.terms = terms;
    task.term_items = [&](const Batch& b) {
      std::vector<std::int64_t> items;
      if (with_mlm) items.push_back(b.mlm_count());
      if (with_mvrc) items.push_back(b.mvrc_count());
      return items;
    };
    task.loss = [&](const Batch& b, tk::Metrics&) {
      const auto out = model->forward(b, with_mlm, with_mvrc);
      std::vector<torch::Tensor> sums;
      if (with_mlm) sums.push_back(out.mlm.sum);
      if (with_mvrc) sums.push_back(out.mvrc.sum);
      return torch::stack(sums);
    };
    task.validate = [&, in_precision](std::int64_t) {
      torch::NoGradGuard no_grad;
      model->eval();
      auto sums = torch::zeros({4}, torch::dtype(torch::kDouble).device(device));  // MLM right, count; MVRC right, count
      in_precision([&] {
        for (const std::int64_t i : validation_batches(SyntheticData::batches(data.samples(false, true), val_bs), launch)) {
          const auto out = model->forward(data.batch(false, true, 0, i, val_bs, false).to(device));
          sums += torch::stack({out.mlm.correct, out.mlm.count, out.mvrc.correct, out.mvrc.count}).to(torch::kDouble);
        }
      });
      model->train();
      const auto host = sums.cpu();  // one host sync per validation
      std::vector<double> v{host[0].item<double>(), host[1].item<double>(), host[2].item<double>(), host[3].item<double>()};
      launch.replicas().all_reduce(v, tk::Reduce::sum);  // every rank's share of the split
      return std::map<std::string, double>{{"MLM-Acc", v[0] / std::max(v[1], 1.0)}, {"MVRC-Acc", v[2] / std::max(v[3], 1.0)}};
    };
    task.best_metric = "MLM-Acc";
    return task;
  });
  if (language) r.language = language->weights;
  return r;
}

/// VQA fine-tuning: the answer classifier over the [MASK] token, from PARTIAL_PRETRAIN's weights;
/// validation: accuracy, overall and per question type (over every rank's share).
inline RunResult finetune(const tk::Config& config, const tk::Launch& launch, const std::string& eval = {}) {
  const tk::RunPlan plan = tk::RunPlan::from(config, launch);
  const tk::FitOptions& options = plan.fit;
  const auto bert = bert_directory(config);
  const SyntheticData data(data_options(config, options.seed()), lexicon_of(bert));
  torch::manual_seed(static_cast<std::uint64_t>(options.seed()));
  const auto& n = config.tree()["NETWORK"];
  VLBertForVQA model(model_config(config, bert), static_cast<std::int64_t>(data.answers().size()),
                     n["CLASSIFIER_HIDDEN_SIZE"].get<std::int64_t>(), n["CLASSIFIER_DROPOUT"].get<double>());
  // BERT's weights first, then PARTIAL_PRETRAIN's over them (VL-BERT's order).
  std::optional<BertLoad> language;
  if (eval.empty()) language = load_language(*model, "vlbert.", config, bert, launch.is_main());
  PartialLoad partial;
  const auto pretrained = n["PARTIAL_PRETRAIN"].get<std::string>();
  if (!pretrained.empty() && eval.empty()) {  // on the CPU, before the move (every rank reads the same file)
    partial = load_partial(*model, pretrained, n["PARTIAL_PRETRAIN_PREFIX_CHANGES"].get<std::vector<std::string>>());
    if (launch.is_main()) print_partial_load(partial, pretrained);
  }
  model->to(launch.device());
  const auto bs = plan.batch_images, val_bs = summed(config.tree()["VAL"]["BATCH_IMAGES"]);
  const tk::DistributedSampler sampler(data.samples(true, false), bs, launch.rank(), launch.world_size(),
                                       static_cast<std::uint64_t>(options.seed()), config.get<bool>("TRAIN.SHUFFLE"));
  const torch::Device device = launch.device();
  const auto loggers = tk::LossLoggers::from(config).require({"ans_loss"});  // TRAIN.LOSS_LOGGERS
  RunResult r = run_fit(plan, launch, model, "vqa", eval, [&](const InPrecision& in_precision) {
    tk::Task<Batch> task;
    task.batches_per_epoch = [&](std::int64_t) { return sampler.batches_per_epoch(); };
    task.batch = [&](std::int64_t e, std::int64_t i) { return data.batch_of(true, false, e, sampler.batch(e, i)).to(device); };
    task.loss = [&](const Batch& b, tk::Metrics& m) {
      const auto logits = model->forward(b).to(torch::kFloat);
      m.add("Acc", logits.argmax(1).eq(b.answers).to(torch::kFloat).mean(), static_cast<double>(b.size()));
      auto loss = torch::nn::functional::cross_entropy(logits, b.answers);
      loggers.add(m, {{"ans_loss", loss}}, static_cast<double>(b.size()));
      return loss;
    };
    task.validate = [&, in_precision](std::int64_t) {
      torch::NoGradGuard no_grad;
      model->eval();
      constexpr int kTypes = static_cast<int>(QuestionType::kCount);
      std::vector<double> counts(2 * kTypes, 0.0);  // per type: right, total (the same layout on every rank)
      in_precision([&] {
        for (const std::int64_t i : validation_batches(SyntheticData::batches(data.samples(true, true), val_bs), launch)) {
          const Batch b = data.batch(true, true, 0, i, val_bs, false);
          const auto right = model->forward(b.to(device)).argmax(1).cpu().eq(b.answers);
          const auto acc = right.accessor<bool, 1>();
          for (std::int64_t k = 0; k < b.size(); ++k) {
            const int type = b.types[static_cast<std::size_t>(k)];
            counts[static_cast<std::size_t>(2 * type)] += acc[k];
            counts[static_cast<std::size_t>(2 * type + 1)] += 1;
          }
        }
      });
      model->train();
      launch.replicas().all_reduce(counts, tk::Reduce::sum);  // every rank's share of the split
      std::map<std::string, double> m;
      double ok = 0, total = 0;
      for (int type = 0; type < kTypes; ++type) {
        const double right = counts[static_cast<std::size_t>(2 * type)], seen = counts[static_cast<std::size_t>(2 * type + 1)];
        if (seen == 0) continue;
        m[std::string("Acc-") + name(static_cast<QuestionType>(type))] = right / seen;
        ok += right, total += seen;
      }
      m["Acc"] = ok / std::max(total, 1.0);
      return m;
    };
    task.best_metric = "Acc";
    return task;
  });
  r.partial = partial;
  if (language) r.language = language->weights;
  r.chance = 1.0 / static_cast<double>(data.answers().size());
  r.question_prior = data.question_prior_accuracy();
  r.prior_by_type = data.question_prior_by_type();
  std::map<std::string, double> counts;
  for (const auto& a : data.questions(true)) counts[a.question.answer] += 1;
  for (const auto& [a, c] : counts) r.majority = std::max(r.majority, c / static_cast<double>(data.questions(true).size()));
  return r;
}

/// One process on the CPU (tests).
inline RunResult pretrain(const tk::Config& config) { return pretrain(config, tk::Launch::single()); }
inline RunResult finetune(const tk::Config& config) { return finetune(config, tk::Launch::single()); }

/// The run's figures as one JSON line (benchmarks/vlbert_table.sh and scripts/run read it).
inline std::string result_json(const RunResult& r) {
  nlohmann::json j;
  j["task"] = r.task;
  j["trainer"] = r.trainer;
  j["val"] = r.val.empty() ? nlohmann::json::object() : nlohmann::json(r.val.back());
  j["epoch_loss"] = r.epoch_loss;
  j["train_seconds"] = r.train_seconds;
  j["train_samples"] = r.train_samples;
  j["ms_per_sample"] = 1000.0 * r.train_seconds / static_cast<double>(std::max<std::int64_t>(1, r.train_samples));
  j["steps"] = r.steps;
  j["skipped_steps"] = r.skipped;
  j["peak_rss_mib"] = r.peak_rss_mib;
  j["piece_items"] = r.piece_items;
  j["replays"] = r.replays;
  j["plan_seconds"] = r.plan_seconds;
  j["world_size"] = r.world_size;
  j["device"] = r.device;
  j["checkpoint"] = r.checkpoint;
  if (!r.evaluated.empty()) j["evaluated"] = r.evaluated;
  if (r.language) j["bert"] = {{"loaded", r.language->loaded.size()}, {"new", r.language->not_loaded.size()}, {"unused", r.language->unused}};
  if (r.task == "vqa") {
    j["chance"] = r.chance;
    j["majority_answer"] = r.majority;
    j["question_prior"] = r.question_prior;
    j["question_prior_by_type"] = r.prior_by_type;
    j["partial_pretrain"] = {{"loaded", r.partial.loaded.size()}, {"not_loaded", r.partial.not_loaded}, {"unused", r.partial.unused}};
  }
  return j.dump();
}

}  // namespace vlbert
