// trainkit::Config with YAML files: scalar typing, syntax errors, hostile files and the bounds,
// the JSON twins, and every file in cfgs/ validating to its expected trainer type. Needs libyaml
// (TRAINKIT_WITH_YAML, set by linking trainkit::yaml) and the source tree (TRAINKIT_SOURCE_DIR in the environment).
#include <doctest/doctest.h>

#if defined(TRAINKIT_WITH_YAML)
#include "../support/source_dir.hpp"

#include <trainkit/config/yaml.hpp>
#include <trainkit/run/plan.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace test_config_yaml {  // this file's names, apart from those of the files it shares a unity batch with

namespace tk = trainkit;
using nlohmann::json;

namespace {

tk::Config from_yaml(const std::string& text, const std::vector<std::string>& overrides = {}) {
  tk::Config c;
  c.load_string(text, tk::Config::Format::yaml, overrides, "test.yaml");
  return c;
}
std::string error_of(const std::string& text) {
  try {
    from_yaml(text);
  } catch (const tk::ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("YAML scalars: 1e-7 is a number, 'dynamic' a string, ints stay ints") {
  const tk::Config c = from_yaml(R"(---
TRAIN:
  LR: 1e-7
  WD: 6.25e-7
  BATCH_IMAGES:
  - 8
  - 8
  FP16: true
  FP16_LOSS_SCALE: 'dynamic'
  GRAD_ACCUMULATE_STEPS: 4
  WARMUP_STEPS: 1.0e3
  CLIP_GRAD_NORM: 10
  LR_STEP: '14,18'
  SHUFFLE: false
GPUS: '0,1,2,3'
RNG_SEED: 12345
)");
  const json& t = c.tree()["TRAIN"];
  CHECK(t["LR"].is_number_float());
  CHECK(t["LR"] == 1e-7);
  CHECK(t["WD"] == 6.25e-7);
  CHECK(t["BATCH_IMAGES"] == json({8, 8}));
  CHECK(t["BATCH_IMAGES"][0].is_number_integer());
  CHECK(t["FP16_LOSS_SCALE"] == "dynamic");
  CHECK(t["GRAD_ACCUMULATE_STEPS"].is_number_integer());
  CHECK(t["WARMUP_STEPS"] == 1000);
  CHECK(t["CLIP_GRAD_NORM"] == 10.0);
  CHECK(t["LR_STEP"] == json({14.0, 18.0}));
  CHECK(t["SHUFFLE"] == false);
  CHECK(c.tree()["GPUS"] == "0,1,2,3");
  CHECK(tk::RunPlan::from(c, 1).trainer.name() == "Trainer<FP16Dynamic, Accumulate<4>, ClipNorm>");

  // Quoted scalars are strings, whatever they look like.
  CHECK(error_of("TRAIN:\n  LR: '1e-7'\n") == "TRAIN.LR: expected a number, got the string \"1e-7\"; remove the quotes");
  CHECK(error_of("TRAIN:\n  FP16: \"true\"\n") ==
        "TRAIN.FP16: expected a boolean (true or false), got the string \"true\"; remove the quotes");
  CHECK(error_of("TRAIN:\n  SHUFFLE: yes\n") ==
        "TRAIN.SHUFFLE: expected a boolean (true or false), got the string \"yes\"; write true or false (YAML 1.2 "
        "reads yes/no/on/off as strings)");
  CHECK(error_of("TRAIN:\n  LR:\n") ==
        "TRAIN.LR: got an empty value; give a number, or remove the key to use the default (0.1)");
  CHECK(error_of("TRAIN:\n  LR: fast\n") == "TRAIN.LR: expected a number, got the string \"fast\"");
  CHECK(from_yaml("TRAIN:\n  LR: !!float 1\n").tree()["TRAIN"]["LR"] == 1.0);
  CHECK(error_of("TRAIN:\n  BATCH_IMAGES: !!int x\n") ==
        "TRAIN.BATCH_IMAGES: the tag tag:yaml.org,2002:int needs an integer, got the string \"x\" (test.yaml:2:17)");
}

TEST_CASE("YAML files: the broken ones, with their messages") {
  CHECK(error_of("TRAIN:\n  BATCH_IMAGES: [8, 8]\n  GRAD_ACCULATE_STEPS: 4\n") ==
        "TRAIN.GRAD_ACCULATE_STEPS: unknown key; did you mean TRAIN.GRAD_ACCUMULATE_STEPS?");
  CHECK(error_of("TRAIN:\n  FP16: true\n  BF16: true\n").rfind("TRAIN.BF16: FP16 and BF16 are both true", 0) == 0);
  CHECK(error_of("TRAIN:\n  LR_STEP: [18, 14]\n") ==
        "TRAIN.LR_STEP: epochs must be in increasing order, got [18, 14]; write [14, 18]");
  CHECK(error_of("TRAIN:\n  LR: 0.1\n  LR: 0.2\n") ==
        "TRAIN.LR: duplicate key (the file sets it twice; keep one) (test.yaml:3:3)");
  // Syntax errors: the parser's line and column.
  CHECK(error_of("---\nTRAIN:\n  LR: 0.1\n   WD: 0.0001\n") ==
        "test.yaml:4:6: invalid YAML: mapping values are not allowed in this context");
  CHECK(error_of("TRAIN:\n  BATCH_IMAGES: [8, 8\n") ==
        "test.yaml:3:1: invalid YAML: while parsing a flow sequence: did not find expected ',' or ']'");
  try {
    from_yaml("TRAIN:\n  LR: [1\n");
    FAIL("expected a ConfigError");
  } catch (const tk::ConfigError& e) {
    CHECK(e.line() == 3);
    CHECK(e.column() == 1);
  }
  // Hostile files end in an error, not a crash.
  CHECK(error_of("a: &a [*a]\n") == "a[0]: the alias *a refers to a value that holds it (a recursive alias) (test.yaml:1:8)");
  CHECK(error_of("a: *b\n") == "a: the alias *b has no anchor &b before it (test.yaml:1:4)");
  CHECK(error_of(std::string(5000, '[')) ==
        "values nested more than 64 levels deep; a configuration is never that deep (test.yaml:1:65)");
  CHECK(error_of("? [a]\n: 1\n") == "a key must be a plain name, got a list as a key (test.yaml:1:3)");
  CHECK(error_of("x: !foo 1\n") == "x: unsupported YAML tag !foo; write the value without a tag (test.yaml:1:4)");
  // Bytes that are not UTF-8, and control characters: the parser refuses them where they are.
  CHECK(error_of("TRAIN:\n  BATCH_IMAGES:\n  - 8\x8a\n") ==
        "test.yaml:3:6: invalid YAML: invalid leading UTF-8 octet (a configuration is UTF-8 text)");
  CHECK(error_of("TRAIN:\n  L\xffR: 1\n") == "test.yaml:2:4: invalid YAML: invalid leading UTF-8 octet (a configuration is UTF-8 text)");
  CHECK(error_of("TRAIN:\n  \"L\x1b[31mR\": 1\n") ==
        "test.yaml:2:5: invalid YAML: control characters are not allowed (a configuration is UTF-8 text)");
  // One written as an escape is text, and escaped again in messages, not sent to the terminal.
  CHECK(error_of("TRAIN:\n  \"L\\u001b[31mR\": 1\n").rfind("TRAIN.L\\u001b[31mR: unknown key", 0) == 0);
  // An alias bomb: 10 KB of text referenced 10^4 times is 100 MB once expanded, in few values.
  std::string bomb = "a: &a \"" + std::string(10000, 'x') + "\"\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n";
  for (const char* level : {"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n", "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n",
                            "e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n"})
    bomb += level;
  CHECK(error_of(bomb) == "test.yaml: more than 16 MiB of text once aliases are expanded; a configuration is never that large");
}

// Files that took yaml-cpp 0.7 (the parser before libyaml) into an endless loop of allocations
// (past 20 GB, or std::bad_alloc under a cap): a JSON fragment spliced into a scenario file, a
// lone comma. Each is a syntax error at its place, at once.
TEST_CASE("YAML files that exhausted the old parser's memory are syntax errors with their place") {
  std::ifstream in(trainkit_testing::source_dir() / "cfgs/scenarios/base_4x16G_fp16.yaml");
  std::stringstream file;
  file << in.rdbuf();
  REQUIRE(!file.str().empty());
  const std::string spliced = std::string("- macro: exclude_commands\n"
                              "  condition:\n"
                              "    (user.uid = 1001 and user.loginuid in (-1, 1001) and proc.exepath = \"/usr/bin/script\" and proc.args in (\n"
                              "\"/usr/local/bin/script_metrics.sh\",\n"
                              "    \"-c rsync\"\n"
                              "    )  )  \n"
                              "    )\n") + file.str();
  const auto started = std::chrono::steady_clock::now();
  const std::string e = error_of(spliced);
  CHECK(e.find("invalid YAML: while scanning a simple key: could not find expected ':'") != std::string::npos);
  CHECK(e.rfind("test.yaml:", 0) == 0);
  CHECK(error_of("\n,\n") == "test.yaml:2:1: invalid YAML: while parsing a block node: did not find expected node content");
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(5));  // (yaml-cpp: until memory ran out)
}

TEST_CASE("what a YAML file may cost is bounded, each bound named") {
  // Values once aliases are expanded: 10 mappings of 10,001 values, 1,000 times.
  std::string many = "a: &a [";
  for (int i = 0; i < 10000; ++i) many += "1, ";
  many += "1]\nb: [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n";
  CHECK(error_of(many) == "test.yaml: more than 100000 values once aliases are expanded; a configuration is never that large");
  // Depth through an alias: the anchored value's depth counts where it is copied.
  const std::string deep = "a: &a " + std::string(40, '[') + std::string(40, ']') + "\nb: " + std::string(30, '[') + "*a" +
                           std::string(30, ']') + "\n";
  CHECK(error_of(deep) == "b: values nested more than 64 levels deep; a configuration is never that deep (test.yaml:2:34)");
  // The parse's time (a bound of 0 s: the first check fails).
  std::string long_list = "a: [";
  for (int i = 0; i < 1000; ++i) long_list += "1, ";
  long_list += "1]\n";
  tk::detail::YamlLimits instant;
  instant.seconds = 0;
  try {
    tk::detail::YamlReader(long_list, "test.yaml", instant).read();
    FAIL("expected a ConfigError");
  } catch (const tk::ConfigError& e) {
    CHECK(std::string(e.what()) == "test.yaml: reading the YAML took more than 0 s; a configuration never does");
  }
  // The text's size, for YAML and JSON alike, before any parser sees it.
  const std::string big = "a: \"" + std::string(tk::Config::kMaxConfigBytes, 'x') + "\"\n";
  CHECK(error_of(big) == "test.yaml: " + std::to_string(big.size()) +
                             " bytes; a configuration is at most 4 MiB (Config::kMaxConfigBytes), and never comes near it");
  tk::Config c;
  CHECK_THROWS_WITH_AS(c.load_string(big, tk::Config::Format::json, {}, "big.json"),
                       ("big.json: " + std::to_string(big.size()) +
                        " bytes; a configuration is at most 4 MiB (Config::kMaxConfigBytes), and never comes near it").c_str(),
                       tk::ConfigError);
}

TEST_CASE("only ConfigError leaves Config::load: running out of memory is one, naming the file") {
  const tk::detail::YamlParser yaml = tk::detail::yaml_parser();
  tk::detail::yaml_parser() = [](const std::string&, const std::string&) -> nlohmann::json { throw std::bad_alloc(); };
  std::string e;
  try {
    from_yaml("TRAIN: {}\n");
  } catch (const tk::ConfigError& error) {
    e = error.what();
  } catch (...) {
    e = "another exception type";
  }
  tk::detail::yaml_parser() = yaml;
  CHECK(e == "test.yaml: ran out of memory while reading the configuration");
}

TEST_CASE("an empty YAML file or section means defaults") {
  const tk::Config defaults;
  CHECK(from_yaml("").tree() == defaults.tree());
  CHECK(from_yaml("---\n").tree() == defaults.tree());
  CHECK(from_yaml("TRAIN:\n").tree() == defaults.tree());
  CHECK(from_yaml("TRAIN: {}\n").tree() == defaults.tree());
}

TEST_CASE("--set takes YAML flow values once YAML is built in") {
  const tk::Config c = from_yaml("TRAIN:\n  LR: 0.1\n", {"TRAIN.BATCH_IMAGES=[4, 4]", "TRAIN.LR_MULT=[[vlbert, 0.5]]",
                                                       "NETWORK.VLBERT={hidden_size: 64}"});
  CHECK(c.tree()["TRAIN"]["BATCH_IMAGES"] == json({4, 4}));
  CHECK(c.tree()["TRAIN"]["LR_MULT"] == json::parse(R"([["vlbert", 0.5]])"));
  CHECK(c.tree()["NETWORK"]["VLBERT"]["hidden_size"] == 64);
}

TEST_CASE("without the YAML parser, a YAML file says how to enable it") {
  struct Unregister {  // as in a program that does not include <trainkit/config/yaml.hpp>
    tk::detail::YamlParser saved = tk::detail::yaml_parser();
    Unregister() { tk::detail::yaml_parser() = nullptr; }
    ~Unregister() { tk::detail::yaml_parser() = saved; }
  } unregister;
  CHECK(error_of("TRAIN: {}\n") ==
        "test.yaml: YAML support is not built in; #include <trainkit/config/yaml.hpp> and link libyaml (CMake: "
        "target_link_libraries(<target> PRIVATE trainkit::yaml)), or use the JSON form of this file");
}

using trainkit_testing::source_dir;

TEST_CASE("every file in cfgs/ validates and resolves to its trainer type") {
  // Adding a file to cfgs/ means adding its expected trainer type here.
  const std::map<std::string, std::string> expected = {
      {"vlbert/pretrain/base_1x24G_fp32.yaml", "Trainer<FP32, Accumulate<Dynamic>, ClipNorm>"},
      {"vlbert/pretrain/base_1x24G_fp32.json", "Trainer<FP32, Accumulate<Dynamic>, ClipNorm>"},
      {"vlbert/vqa/base_1x24G_fp32.yaml", "Trainer<FP32, Accumulate<Dynamic>, ClipNorm>"},
      {"vlbert/pretrain/minilm_1x24G_fp32.yaml", "Trainer<FP32, Accumulate<Dynamic>, ClipNorm>"},
      {"vlbert/vqa/minilm_1x24G_fp32.yaml", "Trainer<FP32, Accumulate<Dynamic>, ClipNorm>"},
      {"scenarios/base_1x24G_fp32.yaml", "Trainer<FP32, Accumulate<Dynamic>, ClipNorm>"},
      {"scenarios/base_4x16G_fp16.yaml", "Trainer<FP16Dynamic, Accumulate<Dynamic>, ClipNorm>"},
      {"scenarios/base_1x8G_fp32.yaml", "Trainer<FP32, Accumulate<Dynamic>, ClipNorm>"},
  };
  const std::filesystem::path cfgs = source_dir() / "cfgs";
  REQUIRE(std::filesystem::is_directory(cfgs));
  std::size_t seen = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(cfgs)) {
    if (!entry.is_regular_file()) continue;
    const std::string rel = std::filesystem::relative(entry.path(), cfgs).generic_string();
    CAPTURE(rel);
    const auto it = expected.find(rel);
    REQUIRE_MESSAGE(it != expected.end(), "cfgs/" << rel << " has no expected trainer type in this test");
    tk::Config c;
    CHECK_NOTHROW(c.load(entry.path().string()));
    CHECK_NOTHROW(tk::RunPlan::from(c, 1).require_training());
    CHECK(tk::RunPlan::from(c, 1).trainer.dispatched().name() == it->second);
    // VL-BERT's file layout: application sections pass through, listed as not validated.
    const auto& sections = c.unvalidated_sections();
    const bool vlbert_layout = sections == std::vector<std::string>{"DATASET", "NETWORK", "VAL"} ||
                               sections == std::vector<std::string>{"DATASET", "NETWORK", "TEST", "VAL"};
    CHECK(vlbert_layout);
    ++seen;
  }
  CHECK(seen == expected.size());
}

TEST_CASE("the scenarios' derived values") {
  tk::Config one, many, small;
  one.load((source_dir() / "cfgs/scenarios/base_1x24G_fp32.yaml").string());
  many.load((source_dir() / "cfgs/scenarios/base_4x16G_fp16.yaml").string());
  small.load((source_dir() / "cfgs/scenarios/base_1x8G_fp32.yaml").string());
  CHECK(tk::RunPlan::from(one, 1).total_batch == 64);
  CHECK(tk::RunPlan::from(many, 4).total_batch == 64);
  CHECK(tk::RunPlan::from(small, 1).total_batch == 32);
  CHECK(tk::RunPlan::from(one, 1).base_lr == doctest::Approx(1.28e-3));
  CHECK(tk::RunPlan::from(many, 4).base_lr == doctest::Approx(1.28e-3));
  CHECK(tk::RunPlan::from(small, 1).base_lr == doctest::Approx(6.4e-4));
  CHECK(one.tree()["TRAIN"]["BATCH_IMAGES"] == json({8, 8}));
  CHECK(small.tree()["TRAIN"]["BATCH_IMAGES"] == json({4, 4}));
}

TEST_CASE("a YAML file and its JSON twin give the same tree") {
  tk::Config yaml, json_twin;
  yaml.load((source_dir() / "cfgs/vlbert/pretrain/base_1x24G_fp32.yaml").string());
  json_twin.load((source_dir() / "cfgs/vlbert/pretrain/base_1x24G_fp32.json").string());
  CHECK(yaml.raw() == json_twin.raw());
  CHECK(yaml.tree() == json_twin.tree());
}

TEST_CASE("a VL-BERT pretraining file passes, its application sections listed as not validated") {
  // The layout of VL-BERT's cfgs/pretrain/*.yaml: DATASET as a list of data sets, NETWORK with
  // VLBERT, TRAIN with its own keys, VAL and TEST.
  const tk::Config c = from_yaml(R"(---
RNG_SEED: 12345
OUTPUT_PATH: './output/pretrain/vl-bert'
MODULE: ResNetVLBERTForPretrainingMultitask
GPUS: '0,1,2,3'
LOG_FREQUENT: 100
VAL_FREQUENT: 1
CHECKPOINT_FREQUENT: 1
MODEL_PREFIX: 'vl-bert_base_res101_pretrain_multitask'
NUM_WORKERS_PER_GPU: 4
SCALES:
- 600
- 1000

DATASET:

- DATASET: conceptual_captions
  APPEND_INDEX: false
  ZIP_MODE: false
- DATASET: general_corpus
  SEQ_LEN: 64

NETWORK:
  PARTIAL_PRETRAIN: ""
  PARTIAL_PRETRAIN_PREFIX_CHANGES: []
  PIXEL_MEANS:
  - 102.9801
  - 115.9465
  VLBERT:
    hidden_size: 768
    num_hidden_layers: 12

TRAIN:
  SHUFFLE: true
  FLIP_PROB: 0.5
  BATCH_IMAGES:
  - 8
  - 8
  ASPECT_GROUPING: false
  RESUME: false
  AUTO_RESUME: true
  BEGIN_EPOCH: 0
  END_EPOCH: 10
  OPTIMIZER: 'AdamW'
  CLIP_GRAD_NORM: 10
  LR: 1.0e-7
  LR_SCHEDULE: 'triangle'
  WD: 0.0001
  WARMUP: true
  WARMUP_METHOD: 'linear'
  WARMUP_FACTOR: 0.0
  WARMUP_STEPS: 16000
  FP16: true
  FP16_LOSS_SCALE: 'dynamic'
  LOSS_LOGGERS:
  - "mlm_loss_wvc,MLMLossWVC"
  - "mvrc_loss,MVRCLoss"

VAL:
  SHUFFLE: false
  FLIP_PROB: 0
  BATCH_IMAGES:
  - 8
  - 8

TEST:
  SHUFFLE: false
  FLIP_PROB: 0
  TEST_EPOCH: 0
  BATCH_IMAGES:
  - 8
  - 8
)");
  CHECK(c.unvalidated_sections() == std::vector<std::string>{"DATASET", "NETWORK", "TEST", "VAL"});
  CHECK(c.tree()["DATASET"][1]["SEQ_LEN"] == 64);
  const tk::RunPlan d = tk::RunPlan::from(c, 16);
  CHECK(d.total_batch == 256);
  CHECK(d.base_lr == doctest::Approx(2.56e-5));
  CHECK(d.trainer.name() == "Trainer<FP16Dynamic, Accumulate<1>, ClipNorm>");
  CHECK(tk::describe(d.schedule) == "triangle(warmup linear 16000 steps from 0; linear to 0 at epoch 10)");
}

TEST_CASE("a second YAML document is refused, not dropped") {
  CHECK(error_of("TRAIN:\n  END_EPOCH: 1\n---\nTRAIN:\n  END_EPOCH: 5\n") ==
        "test.yaml:3:1: a second YAML document (after '---'); a configuration file holds one document: merge them, or pass "
        "the second with --set");
  CHECK(error_of("---\nTRAIN:\n  END_EPOCH: 1\n").empty());  // one document, introduced by ---
}

}  // namespace test_config_yaml

#else
TEST_CASE("YAML configuration tests") {
  MESSAGE("skipped: built without YAML support (link trainkit::yaml, which defines TRAINKIT_WITH_YAML)");
}
#endif
