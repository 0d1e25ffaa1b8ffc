// The VL-BERT example (examples/vlbert): its synthetic data set, a short pre-train + fine-tune
// run, and partial loading of pre-trained weights.
#include "../support/helpers.hpp"

// Relative, so that no include path (a flag of every test file) changes for this one.
#include "../../examples/vlbert/vlbert.hpp"

#include <algorithm>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace test_vlbert {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

using namespace vlbert;
using Trainer = tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<1>, tk::ClipPolicy<tk::ClipNorm>>;

DataOptions small_data(std::int64_t seed) {
  DataOptions o;
  o.scenes.seed = seed;
  o.train_scenes = 50;
  o.val_scenes = 400;
  o.questions_per_scene = 3;
  return o;
}

int find(const std::vector<std::string>& list, const std::string& w) {
  for (std::size_t i = 0; i < list.size(); ++i)
    if (list[i] == w) return static_cast<int>(i);
  return -1;
}
template <std::size_t N>
int find(const std::array<const char*, N>& list, const std::string& w) {
  for (std::size_t i = 0; i < N; ++i)
    if (w == list[i]) return static_cast<int>(i);
  return -1;
}

// The answer to `q` worked out from the scene and the question's words alone (not from the
// generator's choice of object), or "ambiguous" when the words do not pick out one object.
std::string answer_from_words(const Scene& s, const std::vector<std::string>& q) {
  auto matching = [&](int colour, int shape) {
    std::vector<const Object*> m;
    for (const auto& o : s.objects)
      if ((colour < 0 || o.colour == colour) && (shape < 0 || o.category == shape)) m.push_back(&o);
    return m;
  };
  auto the = [&](int colour, int shape) -> const Object* {
    const auto m = matching(colour, shape);
    return m.size() == 1 ? m[0] : nullptr;
  };
  const auto& w = q;
  if (w[0] == "what" && w[4] != "leftmost" && w[4] != "rightmost") {
    const Object* o = w[1] == "colour" ? the(-1, find(kShapes, w[4]))
                    : w[1] == "shape"  ? the(find(kColours, w[4]), -1)
                                       : the(find(kColours, w[4]), find(kShapes, w[5]));
    if (!o) return "ambiguous";
    return w[1] == "colour" ? kColours[o->colour] : w[1] == "shape" ? kShapes[o->category] : kSizes[o->size];
  }
  if (w[0] == "what") {
    const Object* best = &s.objects[0];
    for (const auto& o : s.objects)
      if (w[4] == "leftmost" ? o.x < best->x : o.x > best->x) best = &o;
    return w[1] == "colour" ? kColours[best->colour] : kShapes[best->category];
  }
  if (w[0] == "is" && w[1] == "there") return matching(find(kColours, w[3]), find(kShapes, w[4])).empty() ? "no" : "yes";
  if (w[0] == "is") {
    const Object* a = the(find(kColours, w[2]), find(kShapes, w[3]));
    const Object* b = the(find(kColours, w[7]), find(kShapes, w[8]));
    if (!a || !b) return "ambiguous";
    return (w[4] == "left" ? a->x < b->x : a->x > b->x) ? "yes" : "no";
  }
  if (w[0] == "how") {
    const auto n = w[3] == "objects" ? matching(find(kColours, w[2]), -1).size() : matching(-1, find(kShapesPlural, w[2])).size();
    return kCounts[n];
  }
  return "unknown question";
}

bool same_scene(const Scene& a, const Scene& b) {
  if (a.objects.size() != b.objects.size() || a.features != b.features) return false;
  for (std::size_t i = 0; i < a.objects.size(); ++i) {
    const auto &x = a.objects[i], &y = b.objects[i];
    if (x.category != y.category || x.colour != y.colour || x.size != y.size || x.x != y.x || x.y != y.y) return false;
  }
  return true;
}

bool same_batch(const Batch& a, const Batch& b) {
  return a.text.equal(b.text) && a.features.equal(b.features) && a.boxes.equal(b.boxes) && a.regions.equal(b.regions) &&
         a.mlm_labels.equal(b.mlm_labels) && a.mvrc_labels.equal(b.mvrc_labels) && a.answers.equal(b.answers);
}

// A configuration small enough to train in seconds.
tk::Config tiny_config(const std::string& dir, const std::string& extra_network = "", const std::vector<std::string>& overrides = {}) {
  tk::Config c;
  register_sections(c);
  c.load_string(R"({
    "RNG_SEED": 7, "OUTPUT_PATH": ")" + dir + R"(", "MODEL_PREFIX": "tiny", "LOG_FREQUENT": 1,
    "DATASET": {"TRAIN_SCENES": 600, "VAL_SCENES": 200, "QUESTIONS_PER_SCENE": 2, "MAX_OBJECTS": 4,
                "FEATURE_DIM": 16, "FEATURE_NOISE": 0.5},
    "NETWORK": {)" + extra_network + R"("CLASSIFIER_HIDDEN_SIZE": 64,
                "VLBERT": {"hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                           "intermediate_size": 96, "visual_size": 16,
                           "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}},
    "TRAIN": {"BATCH_IMAGES": 32, "END_EPOCH": 3, "OPTIMIZER": "AdamW", "LR": 1e-4, "WD": 1e-4,
              "CLIP_GRAD_NORM": 1.0, "LR_SCHEDULE": "constant"},
    "VAL": {"BATCH_IMAGES": 100}})",
                tk::Config::Format::json, overrides, "tiny.json");
  return c;
}

}  // namespace

TEST_CASE("the scene generator is deterministic for a seed and differs between seeds") {
  const SyntheticData a(small_data(11)), b(small_data(11)), c(small_data(12));
  for (bool val : {false, true}) {
    REQUIRE(a.scenes(val).size() == b.scenes(val).size());
    for (std::size_t i = 0; i < a.scenes(val).size(); ++i) CHECK(same_scene(a.scenes(val)[i], b.scenes(val)[i]));
    for (std::size_t i = 0; i < a.questions(val).size(); ++i) {
      CHECK(a.questions(val)[i].question.words == b.questions(val)[i].question.words);
      CHECK(a.questions(val)[i].question.answer == b.questions(val)[i].question.answer);
    }
  }
  int differ = 0;
  for (std::size_t i = 0; i < a.scenes(false).size(); ++i) differ += !same_scene(a.scenes(false)[i], c.scenes(false)[i]);
  CHECK(differ == static_cast<int>(a.scenes(false).size()));
  // Batches by (epoch, index): the same position gives the same batch; other epochs shuffle
  // and mask differently; validation batches do not depend on the epoch.
  for (bool vqa : {false, true}) {
    CHECK(same_batch(a.batch(vqa, false, 3, 1, 8, true), b.batch(vqa, false, 3, 1, 8, true)));
    CHECK_FALSE(same_batch(a.batch(vqa, false, 3, 1, 8, true), a.batch(vqa, false, 4, 1, 8, true)));
    CHECK(same_batch(a.batch(vqa, true, 0, 2, 8, false), a.batch(vqa, true, 5, 2, 8, false)));
  }
  // The validation split does not depend on the training split's size.
  DataOptions more = small_data(11);
  more.train_scenes = 80;
  CHECK(same_scene(SyntheticData(more).scenes(true)[7], a.scenes(true)[7]));
}

TEST_CASE("every answer follows from its scene and its question's words") {
  const SyntheticData data(small_data(3));
  std::map<std::string, int> types;
  for (bool val : {false, true})
    for (const auto& asked : data.questions(val)) {
      const auto& q = asked.question;
      CHECK(answer_from_words(data.scenes(val)[asked.scene], q.words) == q.answer);
      CHECK(find(data.answers(), q.answer) >= 0);
      ++types[name(q.type)];
    }
  CHECK(types.size() == static_cast<std::size_t>(QuestionType::kCount));  // every type is asked
  // Yes and no are balanced, so a yes/no question's words do not give its answer away.
  int yes = 0, no = 0;
  for (const auto& asked : data.questions(true)) yes += asked.question.answer == "yes", no += asked.question.answer == "no";
  CHECK(std::abs(yes - no) < (yes + no) / 5);
  for (const auto& s : data.scenes(false)) CHECK(s.features.size() == s.objects.size() * 32);
  // A VQA batch: [CLS] question [MASK] [SEP], the answer read at the [MASK].
  const Batch b = data.batch(true, true, 0, 0, 4, false);
  for (std::int64_t i = 0; i < b.size(); ++i) {
    CHECK(b.text[i][0].item<std::int64_t>() == Vocabulary::CLS);
    CHECK(b.text[i][b.answer_at[i].item<std::int64_t>()].item<std::int64_t>() == Vocabulary::MASK);
    CHECK(b.regions[i][0].item<float>() == 1.0f);  // the whole image
  }
}

TEST_CASE("blanking a modality hides it completely") {
  DataOptions o = small_data(5);
  o.blank = Blank::image;
  const Batch image = SyntheticData(o).batch(true, true, 0, 0, 8, false);
  CHECK(image.regions.sum().item<float>() == 0.0f);
  CHECK(image.features.abs().sum().item<float>() == 0.0f);
  o.blank = Blank::question;
  const Batch question = SyntheticData(o).batch(true, true, 0, 0, 8, false);
  CHECK(question.text.size(1) == 3);  // [CLS] [MASK] [SEP]
  CHECK(question.regions.sum().item<float>() > 0.0f);
}

namespace {
// One thread for a test's runs, as the vlbert program runs: the matrices are small, and a busy
// machine's idle OpenMP workers would spin.
struct OneThread {
  int before = torch::get_num_threads();
  OneThread() { torch::set_num_threads(1); }
  ~OneThread() { torch::set_num_threads(before); }
};
}  // namespace

TEST_CASE("the MLM head scores only the labelled positions, with the loss and accuracy of scoring every one") {
  const SyntheticData d(small_data(3));
  Batch b = d.batch(false, false, 0, 0, 16, false);
  REQUIRE(b.mlm_at.defined());
  CHECK(b.mlm_at.numel() == b.mlm_labels.ge(0).sum().item<std::int64_t>());
  CHECK(b.mlm_at.numel() > 0);
  VLBertConfig c;
  c.visual_size = 32;
  torch::manual_seed(0);
  VLBertForPretraining model(c, 6);
  model->eval();
  torch::NoGradGuard no_grad;
  const auto picked = model->forward(b);
  Batch dense = b;
  dense.mlm_at = torch::Tensor();
  const auto all = model->forward(dense);
  CHECK(picked.mlm.loss.item<double>() == doctest::Approx(all.mlm.loss.item<double>()).epsilon(1e-6));
  CHECK(picked.mlm.count.item<std::int64_t>() == all.mlm.count.item<std::int64_t>());
  CHECK(picked.mlm.correct.item<std::int64_t>() == all.mlm.correct.item<std::int64_t>());
  // A split batch's pieces carry their own positions (cut with the host offsets: no device
  // read), and their counts (the loss terms' items) add up to the batch's.
  const auto pieces = b.split(3);
  std::int64_t labelled = 0, regions = 0;
  for (const auto& p : pieces) {
    CHECK(p.mlm_at.equal(Batch::labelled(p.mlm_labels)));
    CHECK(p.mvrc_at.equal(Batch::labelled(p.mvrc_labels)));
    CHECK(p.mlm_from == Batch::row_starts(p.mlm_labels));
    CHECK(p.mvrc_count() == p.mvrc_labels.ge(0).sum().item<std::int64_t>());
    labelled += p.mlm_count();
    regions += p.mvrc_count();
  }
  CHECK(labelled == b.mlm_at.numel());
  CHECK(regions == b.mvrc_labels.ge(0).sum().item<std::int64_t>());
  CHECK(regions > 0);
}

TEST_CASE("the text-only prior per question type: each type's share, averaging to the overall prior") {
  const SyntheticData d(small_data(5));
  const auto by_type = d.question_prior_by_type();
  REQUIRE(by_type.size() == static_cast<std::size_t>(QuestionType::kCount));
  std::map<std::string, double> questions;
  for (const auto& a : d.questions(true)) questions[name(a.question.type)] += 1;
  double right = 0;
  for (const auto& [type, prior] : by_type) {
    CAPTURE(type);
    CHECK(prior >= 0.0);
    CHECK(prior <= 1.0);
    right += prior * questions.at(type);
  }
  CHECK(right / static_cast<double>(d.questions(true).size()) == doctest::Approx(d.question_prior_accuracy()));
  CHECK(by_type.at("exists") > 0.3);      // yes or no: about half
  CHECK(by_type.at("colour_of") < 0.35);  // one of six colours
}

TEST_CASE("a short pre-training and fine-tuning run learns, and fine-tuning loads every matching weight") {
  const OneThread one_thread;
  testing::TempDir dir;
  const tk::Config pre = tiny_config(dir / "pretrain", "", {R"(TRAIN.LOSS_LOGGERS=["mlm_loss,MLMLoss"])"});
  const RunResult p = pretrain(pre);
  REQUIRE(p.epoch_loss.size() == 3);
  INFO("pretrain epoch losses " << p.epoch_loss[0] << " -> " << p.epoch_loss[2]);
  CHECK(p.epoch_loss[2] < 0.8 * p.epoch_loss[0]);
  REQUIRE(p.val.size() == 3);
  CHECK(p.val.back().at("MLM-Acc") > 0.3);  // 1/vocabulary is chance; masked region classes
                                            // are not learnt in so short a run
  REQUIRE(testing::file_exists(p.checkpoint));
  {  // TRAIN.LOSS_LOGGERS: the outputs it names, under their display names, and only those
    std::ifstream log(dir / "pretrain/tiny-scalars.jsonl");
    const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    CHECK(text.find("\"Train-MLMLoss\"") != std::string::npos);
    CHECK(text.find("Train-MVRC") == std::string::npos);
    CHECK(text.find("\"Initial-LR/Group_0\"") != std::string::npos);
  }
  // --eval: the last checkpoint's weights give the last validation again, with no training.
  const RunResult e = pretrain(pre, tk::Launch::single(), p.checkpoint);
  CHECK(e.evaluated == p.checkpoint);
  CHECK(e.steps == 0);
  REQUIRE(e.val.size() == 1);
  CHECK(e.val[0] == p.val.back());
  const tk::Config unknown = tiny_config(dir / "unknown", "", {R"(TRAIN.LOSS_LOGGERS=["mlm,MLM"])"});
  CHECK_THROWS_WITH_AS(pretrain(unknown), doctest::Contains("TRAIN.LOSS_LOGGERS[0]: no output 'mlm' to log; this task's outputs are: mlm_loss, mvrc_loss"),
                       tk::ConfigError);

  const tk::Config vqa = tiny_config(dir / "vqa", R"("PARTIAL_PRETRAIN": ")" + p.checkpoint + R"(", )");
  const RunResult f = finetune(vqa);
  // Every backbone weight comes from the checkpoint; the answer classifier is new and the
  // pre-training heads are left over, and both are reported by name.
  VLBertForVQA probe(model_config(vqa), 23, 64, 0.1);
  std::size_t backbone = 0;
  for (const auto& q : probe->named_parameters()) backbone += q.key().rfind("vlbert.", 0) == 0;
  CHECK(f.partial.loaded.size() == backbone);
  REQUIRE(f.partial.not_loaded.size() == 4);  // final_mlp.{1,4}.{weight,bias}
  for (const auto& n : f.partial.not_loaded) CHECK(n.rfind("final_mlp.", 0) == 0);
  REQUIRE_FALSE(f.partial.unused.empty());
  for (const auto& n : f.partial.unused) CHECK((n.rfind("mlm_head", 0) == 0 || n.rfind("mvrc_head", 0) == 0));
  REQUIRE(f.epoch_loss.size() == 3);
  INFO("vqa epoch losses " << f.epoch_loss[0] << " -> " << f.epoch_loss[2] << ", accuracy " << f.val.back().at("Acc"));
  CHECK(f.epoch_loss[2] < f.epoch_loss[0]);
  CHECK(f.val.back().at("Acc") > 2 * f.chance);
}

TEST_CASE("partial loading applies prefix changes and reports a shape mismatch instead of loading it") {
  testing::TempDir dir;
  const tk::Config c = tiny_config(dir.path);
  torch::manual_seed(1);
  VLBertForPretraining pre(model_config(c), 6);
  Trainer trainer(pre, tk::AdamW{1e-3});
  trainer.save(dir / "pre.model");
  // Renamed: nothing of the backbone matches under "vlbert." any more, all of it under "backbone.".
  VLBertForVQA vqa(model_config(c), 23, 64, 0.1);
  const PartialLoad none = load_partial(*vqa, dir / "pre.model", {"vlbert.->backbone."});
  CHECK(none.loaded.empty());
  // A different hidden size: the shapes do not match, nothing is copied, each is reported.
  tk::Config wide = tiny_config(dir.path);
  wide.set("NETWORK.VLBERT.intermediate_size=64");
  VLBertForVQA other(model_config(wide), 23, 64, 0.1);
  const auto before = other->vlbert->layers[0]->as<Layer>()->intermediate->weight.clone();
  const PartialLoad r = load_partial(*other, dir / "pre.model");
  CHECK(other->vlbert->layers[0]->as<Layer>()->intermediate->weight.equal(before));
  CHECK(std::any_of(r.not_loaded.begin(), r.not_loaded.end(), [](const std::string& n) {
    return n == "vlbert.encoder.0.intermediate.weight (shape [96, 48] in the file)";
  }));
  CHECK(!r.loaded.empty());  // the embeddings still match
}

TEST_CASE("a data set too large to hold in memory is a ConfigError naming DATASET.TRAIN_SCENES, not bad_alloc") {
  testing::TempDir dir;
  tk::Config c = tiny_config(dir.path);
  CHECK_THROWS_WITH_AS(c.set("DATASET.TRAIN_SCENES=100000000"),
                       doctest::Contains("DATASET.TRAIN_SCENES: the scenes' features would take up to"), tk::ConfigError);
  CHECK_THROWS_WITH_AS(c.set("DATASET.TRAIN_SCENES=100000001"),
                       doctest::Contains("DATASET.TRAIN_SCENES: must be <= "), tk::ConfigError);
}

TEST_CASE("NETWORK.RECOMPUTE: recomputing the encoder layers in backward trains exactly as keeping their activations") {
  const OneThread one_thread;
  testing::TempDir dir;
  // Dropout on: the recomputed forward must draw the same masks.
  const std::vector<std::string> common{"TRAIN.END_EPOCH=1", "DATASET.TRAIN_SCENES=200",
                                        "NETWORK.VLBERT.hidden_dropout_prob=0.1",
                                        "NETWORK.VLBERT.attention_probs_dropout_prob=0.1"};
  auto with = [&](const std::string& name, bool recompute) {
    auto overrides = common;
    overrides.push_back(std::string("NETWORK.RECOMPUTE=") + (recompute ? "true" : "false"));
    return pretrain(tiny_config(dir / name, "", overrides));
  };
  const RunResult kept = with("kept", false), recomputed = with("recomputed", true);
  REQUIRE(kept.epoch_loss.size() == 1);
  REQUIRE(recomputed.epoch_loss.size() == 1);
  CHECK(recomputed.epoch_loss[0] == kept.epoch_loss[0]);
  CHECK(recomputed.val.back() == kept.val.back());
}

TEST_CASE("the layer's attention (at::scaled_dot_product_attention) equals BERT's formula written out") {
  // softmax(q k^T / sqrt(d) + mask) v with padding, in fp32 without dropout, to 1e-6; and with
  // dropout while training, a different output for another seed (the dropout is there).
  VLBertConfig c;
  c.hidden_size = 32, c.num_attention_heads = 4, c.intermediate_size = 64;
  c.hidden_dropout_prob = 0.0, c.attention_probs_dropout_prob = 0.0;
  torch::manual_seed(3);
  Layer layer(c);
  layer->eval();
  const auto x = torch::randn({3, 7, 32});
  auto bias = torch::zeros({3, 1, 1, 7});
  bias.index_put_({1, 0, 0, torch::indexing::Slice(5, torch::indexing::None)}, -10000.0);  // 2 padded positions
  bias.index_put_({2, 0, 0, torch::indexing::Slice(3, torch::indexing::None)}, -10000.0);
  auto split = [](const torch::Tensor& t) { return t.view({3, 7, 4, 8}).transpose(1, 2); };
  const auto scores = torch::matmul(split(layer->query(x)), split(layer->key(x)).transpose(-1, -2)) / std::sqrt(8.0);
  const auto context = torch::matmul(torch::softmax(scores + bias, -1), split(layer->value(x))).transpose(1, 2).reshape({3, 7, 32});
  const auto y = layer->attention_ln(x + layer->attention_output(context));
  const auto expected = layer->output_ln(y + layer->output(torch::gelu(layer->intermediate(y))));
  const auto got = layer->forward(x, bias);
  CHECK((got - expected).abs().max().item<double>() < 1e-6);
  // Not comparing nothing: the mask matters.
  CHECK((layer->forward(x, torch::zeros_like(bias)) - expected).abs().max().item<double>() > 1e-3);

  c.attention_probs_dropout_prob = 0.5;
  torch::manual_seed(3);
  Layer dropping(c);
  dropping->train();
  torch::manual_seed(1);
  const auto a = dropping->forward(x, bias);
  torch::manual_seed(1);
  const auto again = dropping->forward(x, bias);
  torch::manual_seed(2);
  const auto other = dropping->forward(x, bias);
  CHECK(torch::equal(a, again));                        // the same draws from the same seed
  CHECK((a - other).abs().max().item<double>() > 1e-3);  // the probabilities are dropped
  dropping->eval();
  CHECK((dropping->forward(x, bias) - expected).abs().max().item<double>() < 1e-6);  // none in eval (same weights)
}

}  // namespace test_vlbert
