// trainkit::Config with JSON files: defaults, the corpus of broken configurations with their
// messages, --set overrides, isolation, application schemas, derived values, trainer keys.
#include <trainkit/config/config.hpp>
#include <trainkit/run/plan.hpp>

#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace test_config {  // this file's names, apart from those of the files it shares a unity batch with

namespace tk = trainkit;
using nlohmann::json;

namespace {

tk::Config from_json(const std::string& text, const std::vector<std::string>& overrides = {}) {
  tk::Config c;
  c.load_string(text, tk::Config::Format::json, overrides, "test.json");
  return c;
}

/// The error a load gives (what() and path()), or "" when it loads.
struct Outcome {
  std::string what, path;
};
Outcome error_of(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    from_json(text, overrides);
  } catch (const tk::ConfigError& e) {
    return {e.what(), e.path()};
  }
  return {};
}

/// Sets an environment variable for the scope (WORLD_SIZE), restoring it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

}  // namespace

TEST_CASE("defaults: every toolkit key of the TRAIN section, with its default") {
  const tk::Config c;
  const json& t = c.tree()["TRAIN"];
  CHECK(t.size() == 56);  // VL-BERT's 28 TRAIN keys and trainkit's 28
  CHECK(t["CHECKPOINT_BACKGROUND"] == true);
  CHECK(t["CHECKPOINT_FORMAT"] == "auto");
  CHECK(t["ZERO_STAGE"] == 0);
  CHECK(t["OVERLAP_REDUCTION"] == true);
  CHECK(t["UNIT_PREFETCH"] == 1);
  CHECK(t["RESHARD_AFTER_FORWARD"] == true);
  CHECK(t["NO_DECAY"] == json::array());
  CHECK(t["RESUME_CHANGES"] == "refuse");
  CHECK(t["NONFINITE_PATIENCE"] == 20);
  CHECK(t["FORWARD_PEAKS"] == false);
  CHECK(c.tree()["DIST_TIMEOUT"] == 1800.0);
  CHECK(c.tree()["DIST_HEARTBEAT"] == 15.0);
  CHECK(t["MASTER_WEIGHTS"] == false);
  CHECK(t["LR"] == 0.1);
  CHECK(t["OPTIMIZER"] == "SGD");
  CHECK(t["BATCH_IMAGES"] == 1);
  CHECK(t["GRAD_ACCUMULATE_STEPS"] == 1);
  CHECK(t["WARMUP_FACTOR"].get<double>() == doctest::Approx(1.0 / 3));
  CHECK(t["WARMUP_STEPS"] == 1000);
  CHECK(t["FP16_LOSS_SCALE"] == 128.0);
  CHECK(t["FP16_INIT_SCALE"] == 65536.0);
  CHECK(t["FP16_MAX_LOSS_SCALE"] == 16777216.0);
  CHECK(t["LR_STEP"] == json::array());
  CHECK(t["LR_SCALING"] == "per_sample");
  CHECK(t["PARTIAL_WINDOW"] == "flush");
  CHECK(t["CHECKPOINT_KEEP"] == 3);
  CHECK(t["MEMORY_BUDGET"] == 0.0);
  CHECK(t["TARGET_BATCH"] == 0);
  CHECK(t["PIECE_ITEMS"] == 0);
  CHECK(c.tree()["RNG_SEED"] == -1);
  CHECK(c.tree()["OUTPUT_PATH"] == "./output");
  CHECK(c.tree()["LOG_FREQUENT"] == 50);
  CHECK(c.tree()["SCALES"] == json::array());
  CHECK(c.unvalidated_sections().empty());
  const tk::RunPlan d = tk::RunPlan::from(c, 1);
  CHECK(d.total_batch == 1);
  CHECK(d.base_lr == doctest::Approx(0.1));
  CHECK(d.trainer.name() == "Trainer<FP32, Accumulate<1>, NoClip>");
}

TEST_CASE("an empty TRAIN section means all defaults, not 'no section'") {
  const tk::Config defaults;
  for (const char* text : {R"({"TRAIN": {}})", R"({"TRAIN": null})", "{}", ""}) {
    CAPTURE(text);
    const tk::Config c = from_json(text[0] ? text : "{}");
    CHECK(c.tree() == defaults.tree());
  }
  // ... which cannot train: END_EPOCH must exceed BEGIN_EPOCH, said when training starts.
  try {
    tk::RunPlan::from(from_json(R"({"TRAIN": {}})"), 1).require_training();
    FAIL("expected a ConfigError");
  } catch (const tk::ConfigError& e) {
    CHECK(std::string(e.what()) == "TRAIN.END_EPOCH: must be > TRAIN.BEGIN_EPOCH (0) to train, got 0");
  }
  CHECK_NOTHROW(tk::RunPlan::from(from_json(R"({"TRAIN": {"END_EPOCH": 2}})"), 1).require_training());
}

TEST_CASE("given(): what the file or a --set named, apart from the defaults") {
  tk::Config c;
  c.load_string(R"({"TRAIN": {"LR": 0.1}})", tk::Config::Format::json, {"TRAIN.WD=0.01"}, "given.json");
  CHECK(c.given("TRAIN.LR"));
  CHECK(c.given("TRAIN.WD"));               // by --set
  CHECK_FALSE(c.given("TRAIN.BEGIN_EPOCH"));  // a default
  CHECK_FALSE(c.given("TRAIN.LR.X"));
  CHECK_FALSE(c.given("NETWORK.VLBERT.hidden_size"));
  CHECK(c.given("TRAIN"));
}

TEST_CASE("broken configurations, each with its message") {
  struct Case {
    const char* text;
    const char* path;
    const char* what;
  };
  const Case cases[] = {
      // misspelt keys: the full path and the nearest known key
      {R"({"TRAIN": {"GRAD_ACCULATE_STEPS": 4}})", "TRAIN.GRAD_ACCULATE_STEPS",
       "TRAIN.GRAD_ACCULATE_STEPS: unknown key; did you mean TRAIN.GRAD_ACCUMULATE_STEPS?"},
      {R"({"TRAIN": {"lr": 0.1}})", "TRAIN.lr", "TRAIN.lr: unknown key; did you mean TRAIN.LR?"},
      {R"({"TRAIN": {"WARMUP_STPES": 10}})", "TRAIN.WARMUP_STPES",
       "TRAIN.WARMUP_STPES: unknown key; did you mean TRAIN.WARMUP_STEPS?"},
      {R"({"LOG_FREQUNT": 10})", "LOG_FREQUNT", "LOG_FREQUNT: unknown key; did you mean LOG_FREQUENT?"},
      {R"({"TRIAN": {"LR": 0.1}})", "TRIAN",
       "TRIAN: unknown section; did you mean TRAIN? (an application's own section needs a schema: "
       "Config::register_section(\"TRIAN\", ...))"},
      {R"({"NETWROK": {}})", "NETWROK",
       "NETWROK: unknown section; did you mean NETWORK? (an application's own section needs a schema: "
       "Config::register_section(\"NETWROK\", ...))"},
      // wrong types
      {R"({"TRAIN": {"LR": "fast"}})", "TRAIN.LR", "TRAIN.LR: expected a number, got the string \"fast\""},
      {R"({"TRAIN": {"LR": "1e-7"}})", "TRAIN.LR",
       "TRAIN.LR: expected a number, got the string \"1e-7\"; remove the quotes"},
      {R"({"TRAIN": {"GRAD_ACCUMULATE_STEPS": 2.5}})", "TRAIN.GRAD_ACCUMULATE_STEPS",
       "TRAIN.GRAD_ACCUMULATE_STEPS: expected an integer, got the number 2.5"},
      {R"({"TRAIN": {"SHUFFLE": "yes"}})", "TRAIN.SHUFFLE",
       "TRAIN.SHUFFLE: expected a boolean (true or false), got the string \"yes\"; write true or false "
       "(YAML 1.2 reads yes/no/on/off as strings)"},
      {R"({"TRAIN": {"FP16": 1}})", "TRAIN.FP16", "TRAIN.FP16: expected a boolean (true or false), got the integer 1"},
      {R"({"TRAIN": {"BATCH_IMAGES": "8"}})", "TRAIN.BATCH_IMAGES",
       "TRAIN.BATCH_IMAGES: expected an integer or a list, got the string \"8\"; remove the quotes"},
      {R"({"TRAIN": {"LR": null}})", "TRAIN.LR",
       "TRAIN.LR: got an empty value; give a number, or remove the key to use the default (0.1)"},
      {R"({"TRAIN": 5})", "TRAIN", "TRAIN: expected a section (a mapping of keys), got the integer 5"},
      {R"({"TRAIN": {"OPTIMIZER": "adamw"}})", "TRAIN.OPTIMIZER",
       "TRAIN.OPTIMIZER: expected one of SGD, Adam, AdamW, got the string \"adamw\"; did you mean AdamW?"},
      {R"({"TRAIN": {"FP16_LOSS_SCALE": "Dynamic"}})", "TRAIN.FP16_LOSS_SCALE",
       "TRAIN.FP16_LOSS_SCALE: expected \"dynamic\", got the string \"Dynamic\"; did you mean dynamic?"},
      {R"({"TRAIN": {"FP16_LOSS_SCALE": true}})", "TRAIN.FP16_LOSS_SCALE",
       "TRAIN.FP16_LOSS_SCALE: expected \"dynamic\" or a number, got the boolean true"},
      {R"({"TRAIN": {"LR_MULT": [["vlbert"]]}})", "TRAIN.LR_MULT[0]",
       "TRAIN.LR_MULT[0]: expected a pair [name-substring, multiplier >= 0] such as [\"vlbert\", 0.1], got a list "
       "of 1 values [\"vlbert\"]"},
      // ranges
      {R"({"TRAIN": {"GRAD_ACCUMULATE_STEPS": 0}})", "TRAIN.GRAD_ACCUMULATE_STEPS",
       "TRAIN.GRAD_ACCUMULATE_STEPS: must be >= 1, got 0"},
      {R"({"TRAIN": {"WARMUP_STEPS": -1}})", "TRAIN.WARMUP_STEPS", "TRAIN.WARMUP_STEPS: must be >= 0, got -1"},
      {R"({"TRAIN": {"LR": 0}})", "TRAIN.LR", "TRAIN.LR: must be > 0, got 0"},
      {R"({"DIST_HEARTBEAT": -1})", "DIST_HEARTBEAT", "DIST_HEARTBEAT: must be >= 0, got -1"},
      {R"({"TRAIN": {"LR": -1e-5}})", "TRAIN.LR", "TRAIN.LR: must be > 0, got -1e-05"},
      {R"({"TRAIN": {"FP16_LOSS_SCALE": 0}})", "TRAIN.FP16_LOSS_SCALE", "TRAIN.FP16_LOSS_SCALE: must be > 0, got 0"},
      {R"({"TRAIN": {"BATCH_IMAGES": [8, 0]}})", "TRAIN.BATCH_IMAGES[1]", "TRAIN.BATCH_IMAGES[1]: must be >= 1, got 0"},
      {R"({"TRAIN": {"BATCH_IMAGES": []}})", "TRAIN.BATCH_IMAGES",
       "TRAIN.BATCH_IMAGES: expected a list with at least one value, got an empty list"},
      {R"({"TRAIN": {"MOMENTUM": 1.0}})", "TRAIN.MOMENTUM", "TRAIN.MOMENTUM: must be < 1, got 1.0"},
      {R"({"TRAIN": {"FP16_BACKOFF_FACTOR": 1.5}})", "TRAIN.FP16_BACKOFF_FACTOR",
       "TRAIN.FP16_BACKOFF_FACTOR: must be < 1, got 1.5"},
      // keys that contradict each other
      {R"({"TRAIN": {"FP16": true, "BF16": true}})", "TRAIN.BF16",
       "TRAIN.BF16: FP16 and BF16 are both true; set one of them to false (FP16: float16 with loss scaling; BF16: "
       "bfloat16, no scaling)"},
      {R"({"TRAIN": {"CLIP_GRAD_NORM": 1.0, "CLIP_GRAD_VALUE": 0.5}})", "TRAIN.CLIP_GRAD_VALUE",
       "TRAIN.CLIP_GRAD_VALUE: CLIP_GRAD_NORM (1) and CLIP_GRAD_VALUE (0.5) are both > 0; clip by norm or by "
       "value, and set the other to -1"},
      {R"({"TRAIN": {"FP16_MIN_LOSS_SCALE": 1024, "FP16_MAX_LOSS_SCALE": 512}})", "TRAIN.FP16_MAX_LOSS_SCALE",
       "TRAIN.FP16_MAX_LOSS_SCALE: must be > FP16_MIN_LOSS_SCALE (1024), got 512"},
      {R"({"TRAIN": {"FP16": true, "FP16_LOSS_SCALE": "dynamic", "FP16_MAX_LOSS_SCALE": 1024}})",
       "TRAIN.FP16_INIT_SCALE",
       "TRAIN.FP16_INIT_SCALE: must lie within [FP16_MIN_LOSS_SCALE, FP16_MAX_LOSS_SCALE] = [1, 1024], got 65536"},
      {R"({"TRAIN": {"LR_SCHEDULE": "plateau", "LR_FACTOR": 2}})", "TRAIN.LR_FACTOR",
       "TRAIN.LR_FACTOR: plateau cuts the LR by LR_FACTOR, so it must be < 1, got 2"},
      // LR_STEP: sorted, as a list or VL-BERT's comma string
      {R"({"TRAIN": {"LR_STEP": [18, 14]}})", "TRAIN.LR_STEP",
       "TRAIN.LR_STEP: epochs must be in increasing order, got [18, 14]; write [14, 18]"},
      {R"({"TRAIN": {"LR_STEP": "18,14"}})", "TRAIN.LR_STEP",
       "TRAIN.LR_STEP: epochs must be in increasing order, got [18, 14]; write [14, 18]"},
      {R"({"TRAIN": {"LR_STEP": "14;18"}})", "TRAIN.LR_STEP",
       "TRAIN.LR_STEP: expected epochs as numbers >= 0 separated by commas (\"14,18\") or a list ([14, 18]), got "
       "the string \"14;18\""},
      // the file itself
      {R"({"TRAIN": {"LR": 0.1, "LR": 0.2}})", "TRAIN.LR", "TRAIN.LR: duplicate key (the file sets it twice; keep one)"},
      {"[1, 2]", "", "test.json: the top level must be a mapping of keys and sections, got a list of 2 values [1,2]"},
      {"{\n  \"TRAIN\": {\n    \"LR\": 0.1,\n  }\n}", "",
       "test.json:4:3: invalid JSON: syntax error while parsing object key - unexpected '}'; expected string literal"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.text);
    const Outcome o = error_of(c.text);
    CHECK(o.what == c.what);
    CHECK(o.path == c.path);
  }
}

TEST_CASE("syntax errors carry line and column; missing files and unknown formats say so") {
  try {
    from_json("{\n  \"TRAIN\": {\n    \"LR\": 0.1,\n  }\n}");
    FAIL("expected a ConfigError");
  } catch (const tk::ConfigError& e) {
    CHECK(e.line() == 4);
    CHECK(e.column() == 3);
    CHECK(e.path().empty());
  }
  try {
    tk::Config().load("/nonexistent/dir/cfg.json");
    FAIL("expected a ConfigError");
  } catch (const tk::ConfigError& e) {
    CHECK(std::string(e.what()) ==
          "/nonexistent/dir/cfg.json: cannot open the file (does it exist, and is it readable?)");
  }
  CHECK_THROWS_WITH_AS(tk::Config().load("cfg.txt"),
                       "cfg.txt: unknown configuration format; name the file *.json, *.yaml or *.yml",
                       tk::ConfigError);
  // Nesting is bounded (a hostile file cannot exhaust the stack).
  std::string deep = "{\"TRAIN\": {\"LR_MULT\": " + std::string(100, '[') + std::string(100, ']') + "}}";
  CHECK_THROWS_AS(from_json(deep), tk::ConfigError);
}

TEST_CASE("values in VL-BERT's forms are read and normalized") {
  const tk::Config c = from_json(R"({"GPUS": 0, "TRAIN": {"LR_STEP": "14, 18.5", "BATCH_IMAGES": [8, 8],
      "WARMUP_STEPS": 1e3, "CLIP_GRAD_NORM": 10, "LR_MULT": [["vlbert", 0.1]],
      "LOSS_LOGGERS": ["mlm_loss,MLMLoss"], "FP16_LOSS_SCALE": "dynamic", "FP16": true}})");
  const json& t = c.tree()["TRAIN"];
  CHECK(t["LR_STEP"] == json({14.0, 18.5}));
  CHECK(t["BATCH_IMAGES"] == json({8, 8}));
  CHECK(t["WARMUP_STEPS"].is_number_integer());
  CHECK(t["WARMUP_STEPS"] == 1000);
  CHECK(t["CLIP_GRAD_NORM"].is_number_float());
  CHECK(c.tree()["GPUS"] == "0");
  CHECK(from_json(R"({"TRAIN": {"LR_STEP": 14}})").tree()["TRAIN"]["LR_STEP"] == json({14.0}));
  CHECK(from_json(R"({"TRAIN": {"LR_STEP": ""}})").tree()["TRAIN"]["LR_STEP"] == json::array());
  CHECK(tk::RunPlan::from(c, 1).trainer.name() == "Trainer<FP16Dynamic, Accumulate<1>, ClipNorm>");
}

TEST_CASE("--set overrides are read as YAML/JSON scalars and validated the same way") {
  const char* base = R"({"TRAIN": {"LR": 0.1, "BATCH_IMAGES": 4}})";
  tk::Config c = from_json(base, {"TRAIN.LR=2e-5", "TRAIN.FP16=true", "TRAIN.FP16_LOSS_SCALE=dynamic",
                                  "TRAIN.BATCH_IMAGES=[4, 4]", "TRAIN.LR_STEP=14,18", "GPUS=0,1",
                                  "NETWORK.VLBERT.hidden_size=64", "MODEL_PREFIX='vl-bert'"});
  const json& t = c.tree()["TRAIN"];
  CHECK(t["LR"] == 2e-5);
  CHECK(t["FP16"] == true);
  CHECK(t["FP16_LOSS_SCALE"] == "dynamic");
  CHECK(t["BATCH_IMAGES"] == json({4, 4}));
  CHECK(t["LR_STEP"] == json({14.0, 18.0}));
  CHECK(c.tree()["GPUS"] == "0,1");
  CHECK(c.tree()["MODEL_PREFIX"] == "vl-bert");
  CHECK(c.tree()["NETWORK"]["VLBERT"]["hidden_size"] == 64);  // a passed-through section, created
  CHECK(c.unvalidated_sections() == std::vector<std::string>{"NETWORK"});
  CHECK(c.raw() == json::parse(base));  // the file as read; overrides apply on top

  // Later overrides win; set() adds one.
  c.set("TRAIN.LR=3e-5");
  CHECK(c.tree()["TRAIN"]["LR"] == 3e-5);

  CHECK(error_of(base, {"TRAIN.LR=fast"}).what ==
        "TRAIN.LR: expected a number, got the string \"fast\" (from --set TRAIN.LR=fast)");
  CHECK(error_of(base, {"TRAIN.GRAD_ACCULATE_STEPS=4"}).what ==
        "TRAIN.GRAD_ACCULATE_STEPS: unknown key; did you mean TRAIN.GRAD_ACCUMULATE_STEPS? "
        "(from --set TRAIN.GRAD_ACCULATE_STEPS=4)");
  CHECK(error_of(base, {"TRAIN.BF16=true", "TRAIN.FP16=true"}).what.rfind("TRAIN.BF16: FP16 and BF16 are both true", 0) == 0);
  CHECK(error_of(base, {"TRAIN.LR"}).what == "--set TRAIN.LR: expected SECTION.KEY=VALUE, such as TRAIN.LR=2e-5");
  CHECK(error_of(base, {"TRAIN..LR=1"}).what == "--set TRAIN..LR=1: \"TRAIN..LR\" has an empty key between dots");
  CHECK(error_of(base, {"TRAIN.LR.X=1"}).what ==
        "TRAIN.LR: is the number 0.1, not a section; --set TRAIN.LR.X=1 cannot set a key inside it");
  CHECK(error_of(base, {"TRAIN.BATCH_IMAGES=[4,"}).what.rfind("--set TRAIN.BATCH_IMAGES=[4,: the value is not a valid", 0) == 0);

  CHECK(error_of(base, {"TRAIN.LR=\xff"}).what == "--set: the argument is not valid UTF-8 text");
  CHECK(error_of("{\"TRAIN\": {\"OPTIMIZER\": \"\xff\"}}").what.find("test.json:1:") == 0);

  // A rejected override leaves the Config as it was.
  const json before = c.tree();
  CHECK_THROWS_AS(c.set("TRAIN.WARMUP_STEPS=-1"), tk::ConfigError);
  CHECK(c.tree() == before);
}

TEST_CASE("two loads never share values") {
  tk::Config a = from_json(R"({"TRAIN": {"LR": 0.5, "GRAD_ACCUMULATE_STEPS": 4}, "NETWORK": {"X": 1}})");
  tk::Config b = from_json(R"({"TRAIN": {"WD": 0.01}})");
  CHECK(a.tree()["TRAIN"]["LR"] == 0.5);
  CHECK(b.tree()["TRAIN"]["LR"] == 0.1);  // b never saw a's LR
  CHECK(b.tree()["TRAIN"]["GRAD_ACCUMULATE_STEPS"] == 1);
  CHECK(a.tree()["TRAIN"]["WD"] == 1e-4);
  CHECK_FALSE(b.tree().contains("NETWORK"));
  b.set("TRAIN.LR=0.2");
  CHECK(a.tree()["TRAIN"]["LR"] == 0.5);

  // Loading again into the same object replaces everything, overrides included.
  a.load_string(R"({"TRAIN": {"WD": 0.02}})", tk::Config::Format::json);
  CHECK(a.tree()["TRAIN"]["LR"] == 0.1);
  CHECK(a.tree()["TRAIN"]["GRAD_ACCUMULATE_STEPS"] == 1);
  CHECK_FALSE(a.tree().contains("NETWORK"));
  // A failed load leaves the previous configuration in place.
  CHECK_THROWS_AS(a.load_string(R"({"TRAIN": {"LR": "x"}})", tk::Config::Format::json), tk::ConfigError);
  CHECK(a.tree()["TRAIN"]["WD"] == 0.02);

  // Copies are independent too.
  tk::Config c = a;
  c.set("TRAIN.WD=0.5");
  CHECK(a.tree()["TRAIN"]["WD"] == 0.02);
}

TEST_CASE("applications register schemas for their own sections") {
  tk::Schema vlbert;
  vlbert.integer("hidden_size", 768).min(1);
  vlbert.integer("num_hidden_layers", 12).min(1);
  vlbert.number("dropout", 0.1).min(0).max_exclusive(1);
  tk::Schema network;
  network.string("PARTIAL_PRETRAIN", "");
  network.section("VLBERT", vlbert);
  network.rule([](const json& n, const std::string& path) {
    if (n["VLBERT"]["hidden_size"].get<std::int64_t>() % 2)
      throw tk::ConfigError(path + ".VLBERT.hidden_size", "must be even");
  });

  tk::Config c;
  c.register_section("NETWORK", network);
  c.load_string(R"({"NETWORK": {"VLBERT": {"hidden_size": 64}}, "DATASET": {"X": 1}, "VAL": null})",
                tk::Config::Format::json);
  CHECK(c.tree()["NETWORK"]["VLBERT"]["hidden_size"] == 64);
  CHECK(c.tree()["NETWORK"]["VLBERT"]["num_hidden_layers"] == 12);  // default filled in
  CHECK(c.tree()["NETWORK"]["PARTIAL_PRETRAIN"] == "");
  CHECK(c.unvalidated_sections() == std::vector<std::string>{"DATASET", "VAL"});

  auto load_error = [&](const std::string& text) -> std::string {
    try {
      c.load_string(text, tk::Config::Format::json);
    } catch (const tk::ConfigError& e) {
      return e.what();
    }
    return "";
  };
  CHECK(load_error(R"({"NETWORK": {"VLBERT": {"hiden_size": 64}}})") ==
        "NETWORK.VLBERT.hiden_size: unknown key; did you mean NETWORK.VLBERT.hidden_size?");
  CHECK(load_error(R"({"NETWORK": {"VLBERT": {"dropout": 1.5}}})") == "NETWORK.VLBERT.dropout: must be < 1, got 1.5");
  CHECK(load_error(R"({"NETWORK": {"VLBERT": {"hidden_size": 63}}})") == "NETWORK.VLBERT.hidden_size: must be even");
  CHECK(load_error(R"({"NETWORK": {"VLBERT": {"zzz": 1}}})") ==
        "NETWORK.VLBERT.zzz: unknown key; NETWORK.VLBERT has the keys hidden_size, num_hidden_layers, dropout");
  // An absent registered section means its defaults.
  CHECK(load_error("{}").empty());
  CHECK(c.tree()["NETWORK"]["VLBERT"]["hidden_size"] == 768);

  // --set KEY= clears a text key (the empty string); a key of another type says what it got.
  c.load_string(R"({"NETWORK": {"PARTIAL_PRETRAIN": "model/pretrained.ckpt"}})", tk::Config::Format::json,
                {"NETWORK.PARTIAL_PRETRAIN="});
  CHECK(c.tree()["NETWORK"]["PARTIAL_PRETRAIN"] == "");
  c.set("NETWORK.PARTIAL_PRETRAIN=other.ckpt");
  c.set("NETWORK.PARTIAL_PRETRAIN= ");
  CHECK(c.tree()["NETWORK"]["PARTIAL_PRETRAIN"] == "");
  CHECK_THROWS_WITH(c.set("NETWORK.VLBERT.hidden_size="),
                    "NETWORK.VLBERT.hidden_size: expected an integer, got the string \"\" (an empty --set value, KEY=, is "
                    "the empty string; remove the --set to keep the default) (from --set NETWORK.VLBERT.hidden_size=)");

  // Strict: every section needs a schema.
  c.strict_sections();
  CHECK(load_error(R"({"DATASET": {}})") == "DATASET: unknown section; the sections with a schema are TRAIN, NETWORK");
  CHECK_THROWS_AS(c.register_section("TRAIN", tk::Schema()), std::invalid_argument);

  // A section that is a list of mappings (VL-BERT's pretraining DATASET).
  tk::Schema dataset;
  dataset.string("DATASET", "");
  dataset.string("DATASET_PATH", "");
  tk::Config d;
  d.register_section("DATASET", tk::Field::list(tk::Field::section(dataset)));
  d.load_string(R"({"DATASET": [{"DATASET": "cc"}, {"DATASET": "corpus", "DATASET_PATH": "./data"}]})",
                tk::Config::Format::json);
  CHECK(d.tree()["DATASET"][0]["DATASET_PATH"] == "");
  CHECK_THROWS_WITH(d.load_string(R"({"DATASET": [{"DATASET": "cc"}, {"DATSET": "x"}]})", tk::Config::Format::json),
                    "DATASET[1].DATSET: unknown key; did you mean DATASET[1].DATASET?");
}

TEST_CASE("derived values: world size, total batch, base LR") {
  const tk::Config c = from_json(R"({"TRAIN": {"BATCH_IMAGES": [8, 8], "GRAD_ACCUMULATE_STEPS": 4,
                                                "LR": 1e-7, "OPTIMIZER": "AdamW", "WD": 0.0001}})");
  {
    ScopedEnv env("WORLD_SIZE", nullptr);
    const tk::RunPlan d = tk::RunPlan::from(c);
    CHECK(d.world_size == 1);
    CHECK(d.batch_images == 16);
    CHECK(d.total_batch == 64);
    CHECK(d.base_lr == doctest::Approx(6.4e-6));
  }
  {
    ScopedEnv env("WORLD_SIZE", "4");
    const tk::RunPlan d = tk::RunPlan::from(c);
    CHECK(d.world_size == 4);
    CHECK(d.total_batch == 256);  // VL-BERT: world x sum(BATCH_IMAGES) x GRAD_ACCUMULATE_STEPS
    CHECK(d.base_lr == doctest::Approx(2.56e-5));
    CHECK(d.optimizer.name == "AdamW");
    CHECK(d.optimizer.lr == d.base_lr);
    CHECK(d.optimizer.beta1 == 0.9);
    CHECK(d.optimizer.beta2 == 0.999);
    CHECK(d.optimizer.eps == 1e-6);  // VL-BERT's AdamW
    CHECK(d.optimizer.weight_decay == 1e-4);
    CHECK(tk::RunPlan::from(c, 2).world_size == 2);  // an explicit world size wins
  }
  {
    ScopedEnv env("WORLD_SIZE", "two");
    CHECK_THROWS_WITH_AS(tk::RunPlan::from(c), doctest::Contains("WORLD_SIZE: the environment variable WORLD_SIZE=\"two\""),
                         tk::ConfigError);
  }
  const tk::Config none = from_json(R"({"TRAIN": {"BATCH_IMAGES": 8, "LR": 1e-3, "LR_SCALING": "none"}})");
  CHECK(tk::RunPlan::from(none, 8).base_lr == 1e-3);  // LR is the base LR
  CHECK(tk::RunPlan::from(none, 8).total_batch == 64);
  CHECK(tk::RunPlan::from(from_json(R"({"TRAIN": {"OPTIMIZER": "Adam"}})"), 1).optimizer.eps == 1e-8);
}

TEST_CASE("trainer keys: precision, accumulation and clipping from TRAIN") {
  struct Case {
    const char* train;
    const char* name;
    const char* dispatched;
  };
  const Case cases[] = {
      {"{}", "Trainer<FP32, Accumulate<1>, NoClip>", "Trainer<FP32, Accumulate<Dynamic>, NoClip>"},
      {R"({"FP16": true})", "Trainer<FP16Static, Accumulate<1>, NoClip>", "Trainer<FP16Static, Accumulate<Dynamic>, NoClip>"},
      {R"({"FP16": true, "FP16_LOSS_SCALE": "dynamic", "GRAD_ACCUMULATE_STEPS": 4, "CLIP_GRAD_NORM": 1})",
       "Trainer<FP16Dynamic, Accumulate<4>, ClipNorm>", "Trainer<FP16Dynamic, Accumulate<Dynamic>, ClipNorm>"},
      {R"({"BF16": true, "GRAD_ACCUMULATE_STEPS": 8, "CLIP_GRAD_VALUE": 0.5})",
       "Trainer<BF16, Accumulate<8>, ClipValue>", "Trainer<BF16, Accumulate<Dynamic>, ClipValue>"},
      {R"({"GRAD_ACCUMULATE_STEPS": 3, "CLIP_GRAD_NORM": 0})", "Trainer<FP32, Accumulate<3>, NoClip>",
       "Trainer<FP32, Accumulate<Dynamic>, NoClip>"},
      {R"({"GRAD_ACCUMULATE_STEPS": 16, "BF16": false})", "Trainer<FP32, Accumulate<16>, NoClip>",
       "Trainer<FP32, Accumulate<Dynamic>, NoClip>"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.train);
    const tk::TrainerKey key = tk::RunPlan::from(from_json(std::string(R"({"TRAIN": )") + c.train + "}"), 1).trainer;
    CHECK(key.name() == c.name);
    CHECK(key.dispatched().name() == c.dispatched);
  }
}

TEST_CASE("keys kept for VL-BERT compatibility are noted once") {
  const tk::Config c = from_json(R"({"TRAIN": {"VISUAL_SCALE_TEXT_LR_MULT": 1.0}})");
  REQUIRE(c.notes().size() == 1);
  CHECK(c.notes()[0] == "TRAIN.VISUAL_SCALE_TEXT_LR_MULT is accepted for compatibility with VL-BERT and not used");
  CHECK(from_json("{}").notes().empty());
}

TEST_CASE("load() reads JSON files by extension") {
  const std::string path = "trainkit_test_config_load.json";
  {
    std::ofstream out(path);
    out << R"({"TRAIN": {"LR": 0.5}})";
  }
  tk::Config c;
  c.load(path, {"TRAIN.WD=0.5"});
  std::remove(path.c_str());
  CHECK(c.source() == path);
  CHECK(c.get<double>("TRAIN.LR") == 0.5);
  CHECK(c.get<double>("TRAIN.WD") == 0.5);
  CHECK_THROWS_WITH_AS(c.at("TRAIN.NOPE"), "TRAIN.NOPE: no such key in the resolved configuration", tk::ConfigError);
  CHECK_THROWS_AS(c.get<std::string>("TRAIN.LR"), tk::ConfigError);
}

TEST_CASE("plain scalars follow the YAML 1.2 core schema") {
  using tk::detail::resolve_plain_scalar;
  CHECK(resolve_plain_scalar("1e-7") == 1e-7);
  CHECK(resolve_plain_scalar("1e-7").is_number_float());
  CHECK(resolve_plain_scalar("6.25e-7") == 6.25e-7);
  CHECK(resolve_plain_scalar(".5") == 0.5);
  CHECK(resolve_plain_scalar("8").is_number_integer());
  CHECK(resolve_plain_scalar("-8") == -8);
  CHECK(resolve_plain_scalar("0x10") == 16);
  CHECK(resolve_plain_scalar("true") == true);
  CHECK(resolve_plain_scalar("False") == false);
  CHECK(resolve_plain_scalar("~").is_null());
  CHECK(resolve_plain_scalar("").is_null());
  CHECK(resolve_plain_scalar("dynamic") == "dynamic");
  CHECK(resolve_plain_scalar("yes") == "yes");
  CHECK(resolve_plain_scalar("0,1") == "0,1");
  CHECK(resolve_plain_scalar("1e") == "1e");
  CHECK(std::isinf(resolve_plain_scalar(".inf").get<double>()));
  CHECK(resolve_plain_scalar("99999999999999999999").is_number_float());
}

TEST_CASE("CommandLine: --cfg, --set, --model-dir, --resume") {
  const char* argv[] = {"prog", "--cfg", "a.yaml", "--set", "TRAIN.LR=1e-5", "--set=TRAIN.WD=0",
                        "--model-dir", "/tmp/run", "--resume", "--other"};
  const tk::CommandLine cl = tk::CommandLine::parse(10, argv);
  CHECK(cl.cfg == "a.yaml");
  CHECK(cl.sets == std::vector<std::string>{"TRAIN.LR=1e-5", "TRAIN.WD=0"});
  CHECK(cl.model_dir == "/tmp/run");
  CHECK(cl.resume);
  CHECK(cl.rest == std::vector<std::string>{"--other"});
  const tk::Config c = from_json("{}", cl.overrides());
  CHECK(c.tree()["OUTPUT_PATH"] == "/tmp/run");
  CHECK(c.tree()["TRAIN"]["RESUME"] == true);
  const char* bad[] = {"prog", "--cfg"};
  CHECK_THROWS_AS(tk::CommandLine::parse(2, bad), tk::ConfigError);
}

TEST_CASE("batch sizes are bounded and the total batch never wraps around") {
  // The value that wrapped the total to -9223372036854775808 (signed overflow) is refused by name.
  CHECK_THROWS_WITH_AS(from_json(R"({"TRAIN": {"BATCH_IMAGES": [9223372036854775807, 1]}})"),
                       doctest::Contains("TRAIN.BATCH_IMAGES"), tk::ConfigError);
  CHECK_THROWS_WITH_AS(from_json(R"({"TRAIN": {"GRAD_ACCUMULATE_STEPS": 9223372036854775807}})"),
                       doctest::Contains("TRAIN.GRAD_ACCUMULATE_STEPS"), tk::ConfigError);
  // In bounds, but the product with a huge world size overflows: an error, not a negative total.
  const tk::Config c = from_json(R"({"TRAIN": {"BATCH_IMAGES": [16777216, 16777216], "GRAD_ACCUMULATE_STEPS": 1048576}})");
  CHECK(tk::RunPlan::from(c, 1).total_batch == std::int64_t{1} << 45);
  CHECK_THROWS_WITH_AS(tk::RunPlan::from(c, std::int64_t{1} << 40),
                       doctest::Contains("TRAIN.BATCH_IMAGES: the total batch (world size 1099511627776 x BATCH_IMAGES "
                                         "33554432 x GRAD_ACCUMULATE_STEPS 1048576) does not fit in 64 bits"),
                       tk::ConfigError);
}

}  // namespace test_config
