#pragma once
/// Configuration files (config.md): VL-BERT's sections and keys, read from JSON (here) or YAML
/// (<trainkit/config_yaml.hpp>, optional), checked against a schema, with `--set` overrides,
/// and the values derived from them (world size, total batch, base LR, trainer key).
///
///   tk::Config config;                                   // toolkit schema: top level + TRAIN
///   config.register_section("NETWORK", network_schema);  // the application's own sections
///   config.load("cfgs/vlbert/vqa/base_1x24G_fp32.yaml", {"TRAIN.LR=2e-5"});
///   double lr = config.get<double>("TRAIN.LR");
///   tk::Derived d = config.derived();                    // world size, total batch, base LR...
///
/// Contract:
///   - Every value of the resolved tree (`tree()`) has passed its schema: unknown keys, wrong
///     types, values out of range and contradicting keys are a ConfigError naming the key's
///     full path and what would be right. Nothing misspelt is ever silently ignored.
///   - Top-level mappings without a registered schema (VL-BERT's NETWORK, DATASET, VAL, TEST...)
///     pass through unchanged and are listed by unvalidated_sections(), unless strict_sections().
///   - A Config owns everything it holds: two Config objects never share values.
/// Needs only nlohmann-json. YAML needs yaml-cpp: include <trainkit/config_yaml.hpp> in one
/// translation unit of the program (and link trainkit::yaml); it is never pulled in from here.
///
/// The parts, one file each: config/error.hpp (ConfigError), config/text.hpp, config/json_reader.hpp,
/// config/schema.hpp (Field, Schema), config/train_schema.hpp (TRAIN and the top level),
/// config/optimizer_settings.hpp, trainer_key.hpp (TrainerKey), command_line.hpp (CommandLine); this
/// header is Config itself and includes them all.
#include <trainkit/command_line.hpp>
#include <trainkit/config/error.hpp>
#include <trainkit/config/json_reader.hpp>
#include <trainkit/config/schema.hpp>
#include <trainkit/config/text.hpp>
#include <trainkit/config/train_schema.hpp>
#include <trainkit/config/optimizer_settings.hpp>
#include <trainkit/schedule.hpp>
#include <trainkit/trainer_key.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

/// Values that follow from the configuration and the launch (world size).
struct Derived {
  std::int64_t world_size = 1;
  std::int64_t batch_images = 1;        ///< per-device micro-batch: sum(TRAIN.BATCH_IMAGES), or from TARGET_BATCH
  std::int64_t accumulation_steps = 1;  ///< TRAIN.GRAD_ACCUMULATE_STEPS
  std::int64_t total_batch = 1;         ///< world_size x batch_images x accumulation_steps
  double base_lr = 0.1;                 ///< LR x total_batch (per_sample) or LR (none)
  TrainerKey trainer;                   ///< as asked for; trainer.dispatched() is what runs
  OptimizerSettings optimizer;
  ScheduleOptions schedule;
};

/// The world size of this launch: the WORLD_SIZE environment variable (set by torchrun), or 1.
inline std::int64_t world_size_from_environment() {
  const char* env = std::getenv("WORLD_SIZE");
  if (!env || !*env) return 1;
  const nlohmann::json v = detail::resolve_plain_scalar(env);
  if (!v.is_number_integer() || v.get<std::int64_t>() < 1)
    throw ConfigError("WORLD_SIZE", std::string("the environment variable WORLD_SIZE=\"") + env +
                                        "\" is not an integer >= 1 (torchrun sets it to the number of processes)");
  return v.get<std::int64_t>();
}

/// A configuration: the file's tree checked against the schema, with every default filled in.
class Config {
 public:
  enum class Format { json, yaml };

  /// A configuration of defaults only (every toolkit key at its default).
  Config() : root_(detail::root_schema()) { resolve(); }

  /// Registers the schema of an application section (NETWORK, DATASET...); the section is
  /// then checked like TRAIN, and an absent or empty one means its defaults.
  Config& register_section(const std::string& name, Schema schema) {
    return register_section(name, Field::section(std::move(schema)));
  }
  /// As above with any field, for a section that is not a mapping (VL-BERT's pretraining
  /// DATASET is a list of mappings: Field::list(Field::section(schema))).
  Config& register_section(const std::string& name, Field field) {
    if (name == "TRAIN" || (root_.has(name) && !registered_.count(name)))
      throw std::invalid_argument("trainkit::Config::register_section: " + name + " is owned by the toolkit");
    root_.add(name, std::move(field));
    registered_.insert(name);
    resolve();
    return *this;
  }
  /// Strict: a top-level section without a registered schema is an error, not passed through.
  Config& strict_sections(bool strict = true) {
    strict_ = strict;
    resolve();
    return *this;
  }

  /// Reads `path` (.json, or .yaml/.yml with YAML support), applies `overrides`
  /// ("SECTION.KEY=VALUE", in order) and validates. Replaces whatever was loaded before.
  void load(const std::string& path, const std::vector<std::string>& overrides = {}) {
    const Format format = format_of(path);
    std::ifstream in(path, std::ios::binary);
    if (!in || std::filesystem::is_directory(path)) throw ConfigError("", path + ": cannot open the file (does it exist, and is it readable?)");
    std::ostringstream text;
    text << in.rdbuf();
    load_string(text.str(), format, overrides, path);
  }
  /// As load(), from text; `name` is the file name used in messages.
  void load_string(const std::string& text, Format format, const std::vector<std::string>& overrides = {},
                   const std::string& name = "<string>") {
    nlohmann::json raw = parse_text(text, format, name);
    if (raw.is_null()) raw = nlohmann::json::object();  // an empty file: all defaults
    if (!raw.is_object())
      throw ConfigError("", name + ": the top level must be a mapping of keys and sections, got " +
                                detail::describe_value(raw));
    std::vector<Override> parsed;
    for (const auto& o : overrides) parsed.push_back(parse_override(o));
    // Build and check everything first, so that a failed load leaves this Config unchanged.
    Config next(*this);
    next.raw_ = std::move(raw);
    next.overrides_ = std::move(parsed);
    next.source_ = name;
    next.resolve();
    *this = std::move(next);
  }
  /// Applies one more override ("TRAIN.LR=2e-5") and validates; unchanged on error.
  void set(const std::string& assignment) {
    Config next(*this);
    next.overrides_.push_back(parse_override(assignment));
    next.resolve();
    *this = std::move(next);
  }

  /// The file format by extension: .json, or .yaml / .yml.
  static Format format_of(const std::string& path) {
    const auto dot = path.find_last_of('.');
    const std::string ext = dot == std::string::npos ? "" : detail::upper(path.substr(dot + 1));
    if (ext == "JSON") return Format::json;
    if (ext == "YAML" || ext == "YML") return Format::yaml;
    throw ConfigError("", path + ": unknown configuration format; name the file *.json, *.yaml or *.yml");
  }

  /// The resolved tree: every toolkit key after defaults and overrides; application sections
  /// as registered (checked) or as given (passed through).
  const nlohmann::json& tree() const { return tree_; }
  /// The schema of the top level: the toolkit's keys, TRAIN, and the registered sections.
  const Schema& schema() const { return root_; }
  /// The parsed file before defaults and overrides.
  const nlohmann::json& raw() const { return raw_; }
  /// The file name given to load() ("" when nothing was loaded).
  const std::string& source() const { return source_; }
  /// Top-level sections passed through without a schema, sorted.
  const std::vector<std::string>& unvalidated_sections() const { return unvalidated_; }
  /// Things the run should say once at start (keys accepted for compatibility but unused).
  const std::vector<std::string>& notes() const { return notes_; }

  /// The value at "SECTION.KEY" (dots separate levels).
  const nlohmann::json& at(const std::string& dotted) const {
    const nlohmann::json* node = &tree_;
    std::size_t from = 0;
    while (true) {
      const auto dot = dotted.find('.', from);
      const std::string key = dotted.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
      if (!node->is_object() || !node->contains(key))
        throw ConfigError(dotted, "no such key in the resolved configuration");
      node = &(*node)[key];
      if (dot == std::string::npos) return *node;
      from = dot + 1;
    }
  }
  template <class T>
  T get(const std::string& dotted) const {
    const nlohmann::json& v = at(dotted);
    try {
      return v.get<T>();
    } catch (const nlohmann::json::exception&) {
      throw ConfigError(dotted, "is " + detail::describe_value(v) + ", which the program cannot read as it asks");
    }
  }

  /// TRAIN.END_EPOCH > TRAIN.BEGIN_EPOCH, or a ConfigError: call before training.
  void require_training() const {
    const auto begin = get<std::int64_t>("TRAIN.BEGIN_EPOCH"), end = get<std::int64_t>("TRAIN.END_EPOCH");
    if (end <= begin)
      throw ConfigError("TRAIN.END_EPOCH", "must be > TRAIN.BEGIN_EPOCH (" + std::to_string(begin) +
                                               ") to train, got " + std::to_string(end));
  }

  /// The trainer type this configuration needs (before the registry's Dynamic fallback).
  TrainerKey trainer_key() const {
    const nlohmann::json& t = tree_["TRAIN"];
    TrainerKey key;
    if (t["BF16"].get<bool>()) key.precision = PrecisionKind::BF16;
    else if (t["FP16"].get<bool>())
      key.precision = t["FP16_LOSS_SCALE"].is_string() ? PrecisionKind::FP16Dynamic : PrecisionKind::FP16Static;
    key.master_weights = t["MASTER_WEIGHTS"].get<bool>();
    key.accumulation = static_cast<int>(t["GRAD_ACCUMULATE_STEPS"].get<std::int64_t>());
    if (t["CLIP_GRAD_NORM"].get<double>() > 0) key.clip = ClipKind::ClipNorm;
    else if (t["CLIP_GRAD_VALUE"].get<double>() > 0) key.clip = ClipKind::ClipValue;
    return key;
  }

  /// The schedule's settings (positions in epochs; see make_schedule for steps).
  ScheduleOptions schedule_options() const {
    const nlohmann::json& t = tree_["TRAIN"];
    ScheduleOptions o;
    o.name = t["LR_SCHEDULE"].get<std::string>();
    o.warmup.method = t["WARMUP_METHOD"].get<std::string>() == "constant" ? WarmupMethod::constant : WarmupMethod::linear;
    o.warmup.factor = t["WARMUP_FACTOR"].get<double>();
    o.warmup.steps = t["WARMUP"].get<bool>() ? t["WARMUP_STEPS"].get<std::int64_t>() : 0;  // VL-BERT: 0 when off
    o.factor = t["LR_FACTOR"].get<double>();
    o.milestones = t["LR_STEP"].get<std::vector<double>>();
    o.end_epoch = static_cast<double>(t["END_EPOCH"].get<std::int64_t>());
    return o;
  }
  /// How epochs map to applied optimizer steps with `micro_batches_per_epoch` micro-batches
  /// per epoch on each rank (the loader's length), by GRAD_ACCUMULATE_STEPS and PARTIAL_WINDOW.
  EpochClock epoch_clock(std::int64_t micro_batches_per_epoch) const {
    const nlohmann::json& t = tree_["TRAIN"];
    const auto n = t["GRAD_ACCUMULATE_STEPS"].get<std::int64_t>();
    const auto partial = t["PARTIAL_WINDOW"].get<std::string>();
    if (micro_batches_per_epoch < 1)
      throw ConfigError("TRAIN", "an epoch needs at least one micro-batch, got " + std::to_string(micro_batches_per_epoch));
    if (partial == "span") return EpochClock::span(micro_batches_per_epoch, n);
    if (partial == "drop") return EpochClock::drop(micro_batches_per_epoch, n);
    return EpochClock::flush(micro_batches_per_epoch, n);
  }
  /// The LR schedule of TRAIN with epoch milestones converted by epoch_clock().
  std::shared_ptr<Schedule> make_schedule(std::int64_t micro_batches_per_epoch) const {
    const ScheduleOptions options = schedule_options();
    const EpochClock clock = epoch_clock(micro_batches_per_epoch);
    if ((options.name == "triangle" || options.name == "cosine") && clock.step_at(options.end_epoch) < 1)
      throw ConfigError("TRAIN.END_EPOCH", options.name + " decays to 0 at END_EPOCH, so END_EPOCH must be > 0 "
                                           "(and at least one optimizer step), got " + detail::dump_text(tree_["TRAIN"]["END_EPOCH"]));
    try {
      return trainkit::make_schedule(options, clock);
    } catch (const std::invalid_argument& e) {
      throw ConfigError("TRAIN.LR_SCHEDULE", e.what());
    }
  }

  /// World size (WORLD_SIZE or 1 unless given), total batch, base LR, trainer key, optimizer.
  Derived derived(std::optional<std::int64_t> world_size = std::nullopt) const {
    const nlohmann::json& t = tree_["TRAIN"];
    Derived d;
    d.world_size = world_size ? *world_size : world_size_from_environment();
    if (d.world_size < 1) throw ConfigError("WORLD_SIZE", "must be >= 1, got " + std::to_string(d.world_size));
    const nlohmann::json& b = t["BATCH_IMAGES"];
    // Checked arithmetic: a list of huge entries, or a huge world size, is an error, never a
    // wrapped (negative) total.
    const auto overflow = [&](const std::string& what) {
      return ConfigError("TRAIN.BATCH_IMAGES", what + " does not fit in 64 bits; BATCH_IMAGES is the per-device micro-batch");
    };
    d.batch_images = 0;
    if (b.is_array()) {
      for (const auto& x : b)
        if (__builtin_add_overflow(d.batch_images, x.get<std::int64_t>(), &d.batch_images)) throw overflow("the sum of the list");
    } else {
      d.batch_images = b.get<std::int64_t>();
    }
    d.accumulation_steps = t["GRAD_ACCUMULATE_STEPS"].get<std::int64_t>();
    if (const auto target = t["TARGET_BATCH"].get<std::int64_t>(); target > 0) {  // in place of BATCH_IMAGES
      const std::int64_t per_device = target / (d.world_size * d.accumulation_steps);
      if (per_device * d.world_size * d.accumulation_steps != target)
        throw ConfigError("TRAIN.TARGET_BATCH", "the effective batch " + std::to_string(target) +
                                                    " is not a multiple of world size " + std::to_string(d.world_size) +
                                                    " x GRAD_ACCUMULATE_STEPS " + std::to_string(d.accumulation_steps) +
                                                    "; choose a multiple, or set GRAD_ACCUMULATE_STEPS: 1 and let "
                                                    "TRAIN.MEMORY_BUDGET split the batch");
      d.batch_images = per_device;
    }
    if (__builtin_mul_overflow(d.world_size, d.batch_images, &d.total_batch) ||
        __builtin_mul_overflow(d.total_batch, d.accumulation_steps, &d.total_batch))
      throw overflow("the total batch (world size " + std::to_string(d.world_size) + " x BATCH_IMAGES " +
                     std::to_string(d.batch_images) + " x GRAD_ACCUMULATE_STEPS " + std::to_string(d.accumulation_steps) + ")");
    const double lr = t["LR"].get<double>();
    d.base_lr = t["LR_SCALING"].get<std::string>() == "per_sample" ? lr * static_cast<double>(d.total_batch) : lr;
    d.trainer = trainer_key();
    OptimizerSettings& o = d.optimizer;
    o.name = t["OPTIMIZER"].get<std::string>();
    o.lr = d.base_lr;
    o.weight_decay = t["WD"].get<double>();
    o.momentum = t["MOMENTUM"].get<double>();
    o.eps = o.name == "AdamW" ? 1e-6 : 1e-8;  // VL-BERT's AdamW; torch.optim.Adam's default
    d.schedule = schedule_options();
    return d;
  }

  /// The resolved tree as JSON text.
  std::string dump(int indent = 2) const { return detail::dump_text(tree_, indent); }

 private:
  struct Override {
    std::string text;               // as given, for messages
    std::vector<std::string> keys;  // the path
    nlohmann::json value;
  };

  static nlohmann::json parse_text(const std::string& text, Format format, const std::string& name) {
    if (format == Format::json) return detail::parse_json_text(text, name);
    const detail::YamlParser parser = detail::yaml_parser();
    if (!parser)
      throw ConfigError("", name + ": YAML support is not built in; #include <trainkit/config_yaml.hpp> and link "
                                   "yaml-cpp (CMake: target_link_libraries(<target> PRIVATE trainkit::yaml)), "
                                   "or use the JSON form of this file");
    return parser(text, name);
  }

  /// "SECTION.KEY=VALUE": the value is read as a YAML/JSON scalar (2e-5 a number, dynamic a
  /// string, [8, 8] a list, 'x' or "x" a string).
  static Override parse_override(const std::string& text) {
    if (!detail::valid_utf8(text)) throw ConfigError("", "--set: the argument is not valid UTF-8 text");
    const auto eq = text.find('=');
    const std::string where = "--set " + text;
    if (eq == std::string::npos || eq == 0)
      throw ConfigError("", where + ": expected SECTION.KEY=VALUE, such as TRAIN.LR=2e-5");
    Override o;
    o.text = text;
    std::string key = text.substr(0, eq);
    std::size_t from = 0;
    while (true) {
      const auto dot = key.find('.', from);
      const std::string part = key.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
      if (part.empty()) throw ConfigError("", where + ": \"" + key + "\" has an empty key between dots");
      o.keys.push_back(part);
      if (dot == std::string::npos) break;
      from = dot + 1;
    }
    std::string value = text.substr(eq + 1);
    value.erase(0, value.find_first_not_of(" \t"));
    value.erase(value.find_last_not_of(" \t") + 1);
    try {
      if (!value.empty() && value.front() == '\'' && value.size() >= 2 && value.back() == '\'') {
        std::string s = value.substr(1, value.size() - 2);
        for (std::size_t p = s.find("''"); p != std::string::npos; p = s.find("''", p + 1)) s.erase(p, 1);
        o.value = s;
      } else if (!value.empty() && (value.front() == '"' || value.front() == '[' || value.front() == '{')) {
        const detail::YamlParser yaml = detail::yaml_parser();
        o.value = yaml ? yaml(value, where) : detail::parse_json_text(value, where);
      } else {
        o.value = detail::resolve_plain_scalar(value);
      }
    } catch (const ConfigError& e) {
      throw ConfigError("", where + ": the value is not a valid YAML or JSON value (" + e.what() + ")");
    }
    return o;
  }

  static void apply(nlohmann::json& tree, const Override& o) {
    nlohmann::json* node = &tree;
    std::string path;
    for (std::size_t i = 0; i + 1 < o.keys.size(); ++i) {
      path = detail::join_path(path, o.keys[i]);
      nlohmann::json& child = (*node)[o.keys[i]];
      if (child.is_null()) child = nlohmann::json::object();
      if (!child.is_object())
        throw ConfigError(path, "is " + detail::describe_value(child) + ", not a section; --set " + o.text +
                                    " cannot set a key inside it");
      node = &child;
    }
    (*node)[o.keys.back()] = o.value;
  }

  /// raw_ + overrides_ -> tree_, checking everything.
  void resolve() {
    nlohmann::json given = raw_;
    for (const auto& o : overrides_) apply(given, o);
    try {
      resolve_tree(given);
    } catch (const ConfigError& e) {
      // Say which --set put a bad value there.
      for (const auto& o : overrides_) {
        std::string p;
        for (const auto& k : o.keys) p = detail::join_path(p, k);
        const std::string& ep = e.path();
        if (!ep.empty() && (ep == p || ep.rfind(p + ".", 0) == 0 || ep.rfind(p + "[", 0) == 0))
          throw ConfigError(ep, e.message() + " (from --set " + o.text + ")");
      }
      throw;
    }
  }

  void resolve_tree(const nlohmann::json& given) {
    nlohmann::json tree = nlohmann::json::object();
    std::vector<std::string> unvalidated;
    for (const auto& [key, value] : given.items()) {
      if (root_.has(key)) {
        tree[key] = root_.find(key)->resolve(value, key);
        continue;
      }
      const bool section_like =
          value.is_object() || value.is_null() ||
          (value.is_array() && !value.empty() && std::all_of(value.begin(), value.end(), [](const nlohmann::json& v) {
             return v.is_object();
           }));
      if (!section_like) throw root_.unknown_key(key, "");
      std::vector<std::string> sections = detail::well_known_sections();
      for (const auto& r : registered_) sections.push_back(r);
      const bool known_name = std::find(sections.begin(), sections.end(), key) != sections.end();
      if (!known_name)
        if (auto near = detail::nearest(key, sections))
          throw ConfigError(key, "unknown section; did you mean " + *near + "? (an application's own section "
                                 "needs a schema: Config::register_section(\"" + key + "\", ...))");
      if (strict_) {
        std::string names;
        for (const auto& r : registered_) names += (names.empty() ? "" : ", ") + r;
        throw ConfigError(key, "unknown section; the sections with a schema are TRAIN" +
                                   (names.empty() ? std::string() : ", " + names));
      }
      tree[key] = value;
      unvalidated.push_back(key);
    }
    for (const auto& key : root_.keys())
      if (!tree.contains(key)) tree[key] = root_.find(key)->resolve_default(key);

    std::vector<std::string> notes;
    const nlohmann::json* given_train = given.contains("TRAIN") && given["TRAIN"].is_object() ? &given["TRAIN"] : nullptr;
    for (const char* k : {"VISUAL_SCALE_TEXT_LR_MULT", "VISUAL_SCALE_OBJECT_LR_MULT", "VISUAL_SCALE_CLIP_GRAD_NORM"})
      if (given_train && given_train->contains(k))
        notes.push_back(std::string("TRAIN.") + k + " is accepted for compatibility with VL-BERT and not used");
    if (given_train && given_train->contains("BATCH_IMAGES") && tree["TRAIN"]["TARGET_BATCH"].get<std::int64_t>() > 0)
      notes.push_back("TRAIN.BATCH_IMAGES is not used: TRAIN.TARGET_BATCH sets the per-device batch");

    std::sort(unvalidated.begin(), unvalidated.end());
    tree_ = std::move(tree);
    unvalidated_ = std::move(unvalidated);
    notes_ = std::move(notes);
  }

  Schema root_;
  std::set<std::string> registered_;
  bool strict_ = false;
  nlohmann::json raw_ = nlohmann::json::object();
  std::vector<Override> overrides_;
  std::string source_;
  nlohmann::json tree_;
  std::vector<std::string> unvalidated_;
  std::vector<std::string> notes_;
};

}  // namespace trainkit
