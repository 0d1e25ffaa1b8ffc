#pragma once
/// Configuration files (docs/guide/configs.md; every key: docs/config-reference.md): VL-BERT's sections and keys, read from JSON (here) or YAML
/// (<trainkit/config/yaml.hpp>, optional), checked against a schema, with `--set` overrides.
/// What the values mean for a run (the trainer type, the total batch, the base LR, the loop's
/// options) is read once from the validated tree by tk::RunPlan (plan.hpp).
///
///   tk::Config config;                                   // toolkit schema: top level + TRAIN
///   config.register_section("NETWORK", network_schema);  // the application's own sections
///   config.load("cfgs/vlbert/vqa/base_1x24G_fp32.yaml", {"TRAIN.LR=2e-5"});
///   double lr = config.get<double>("TRAIN.LR");
///   tk::RunPlan plan = tk::RunPlan::from(config);        // plan.hpp: trainer, batch, base LR...
///
/// Contract:
///   - Every value of the resolved tree (`tree()`) has passed its schema: unknown keys, wrong
///     types, values out of range and contradicting keys are a ConfigError naming the key's
///     full path and what would be right. Nothing misspelt is ever silently ignored.
///   - Top-level mappings without a registered schema (VL-BERT's NETWORK, DATASET, VAL, TEST...)
///     pass through unchanged and are listed by unvalidated_sections(), unless strict_sections().
///   - A Config owns everything it holds: two Config objects never share values.
/// Needs only nlohmann-json. YAML needs libyaml: include <trainkit/config/yaml.hpp> in one
/// translation unit of the program (and link trainkit::yaml); it is never pulled in from here.
///
/// The parts, one file each: config/error.hpp (ConfigError), config/text.hpp, config/json_reader.hpp,
/// config/schema.hpp (Field, Schema), config/train_schema.hpp (TRAIN and the top level),
/// command_line.hpp (CommandLine); this header is Config itself and includes them all.
#include <trainkit/detail/inline.hpp>
#include <trainkit/config/command_line.hpp>
#include <trainkit/config/error.hpp>
#include <trainkit/config/json_reader.hpp>
#include <trainkit/config/schema.hpp>
#include <trainkit/config/text.hpp>
#include <trainkit/config/train_schema.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

/// A configuration: the file's tree checked against the schema, with every default filled in.
class Config {
 public:
  enum class Format { json, yaml };

  /// A configuration of defaults only (every toolkit key at its default).
  Config() : root_(detail::root_schema()) { resolve(); }

  /// Registers the schema of an application section (NETWORK, DATASET...); the section is
  /// then checked like TRAIN, and an absent or empty one means its defaults.
  Config& register_section(const std::string& name, Schema schema);
  /// As above with any field, for a section that is not a mapping (VL-BERT's pretraining
  /// DATASET is a list of mappings: Field::list(Field::section(schema))).
  Config& register_section(const std::string& name, Field field);
  /// Strict: a top-level section without a registered schema is an error, not passed through.
  Config& strict_sections(bool strict = true);

  /// Reads `path` (.json, or .yaml/.yml with YAML support), applies `overrides`
  /// ("SECTION.KEY=VALUE", in order) and validates. Replaces whatever was loaded before.
  /// Every failure is a ConfigError naming the file (running out of memory included), and a
  /// file over kMaxConfigBytes is refused before it is read.
  void load(const std::string& path, const std::vector<std::string>& overrides = {});
  /// As load(), from text; `name` is the file name used in messages.
  void load_string(const std::string& text, Format format, const std::vector<std::string>& overrides = {},
                   const std::string& name = "<string>");
  /// Applies one more override ("TRAIN.LR=2e-5") and validates; unchanged on error.
  void set(const std::string& assignment);

  /// The largest configuration text read (JSON or YAML): no configuration comes near it, and a
  /// parser is never handed more than this.
  static constexpr std::size_t kMaxConfigBytes = std::size_t{4} << 20;

 private:
  // Runs `f`: a ConfigError passes through; anything else becomes one naming `name`.
  template <class F>
  static void guarded(const std::string& name, F&& f) {
    try {
      f();
    } catch (const ConfigError&) {
      throw;
    } catch (const std::bad_alloc&) {
      throw ConfigError("", name + ": ran out of memory while reading the configuration");
    } catch (const std::exception& e) {
      throw ConfigError("", name + ": " + e.what());
    }
  }
  static void check_size(std::uintmax_t bytes, const std::string& name);
  void load_checked(const std::string& text, Format format, const std::vector<std::string>& overrides,
                    const std::string& name);

 public:

  /// The file format by extension: .json, or .yaml / .yml.
  static Format format_of(const std::string& path);

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
  const nlohmann::json& at(const std::string& dotted) const;
  /// Whether the file or a --set gave "SECTION.KEY" (false where the value is its default):
  /// for a program that takes a value from elsewhere unless the configuration names one.
  bool given(const std::string& dotted) const;
  template <class T>
  T get(const std::string& dotted) const {
    const nlohmann::json& v = at(dotted);
    try {
      return v.get<T>();
    } catch (const nlohmann::json::exception&) {
      throw ConfigError(dotted, "is " + detail::describe_value(v) + ", which the program cannot read as it asks");
    }
  }

  /// The resolved tree as JSON text.
  std::string dump(int indent = 2) const { return detail::dump_text(tree_, indent); }

 private:
  struct Override {
    std::string text;               // as given, for messages
    std::vector<std::string> keys;  // the path
    nlohmann::json value;
  };

  static nlohmann::json parse_text(const std::string& text, Format format, const std::string& name);

  /// The node at "SECTION.KEY" under `root` (dots separate levels), or null where there is none.
  static const nlohmann::json* find(const nlohmann::json& root, const std::string& dotted);

  /// "SECTION.KEY=VALUE": the value is read as a YAML/JSON scalar (2e-5 a number, dynamic a
  /// string, [8, 8] a list, 'x' or "x" a string); nothing after '=' is the empty string.
  static Override parse_override(const std::string& text);

  static void apply(nlohmann::json& tree, const Override& o);

  /// raw_ + overrides_ -> tree_, checking everything.
  void resolve();

  void resolve_tree(const nlohmann::json& given);

  Schema root_;
  std::set<std::string> registered_;
  bool strict_ = false;
  nlohmann::json raw_ = nlohmann::json::object();
  std::vector<Override> overrides_;
  std::string source_;
  nlohmann::json tree_;
  nlohmann::json given_ = nlohmann::json::object();  // raw_ with the overrides applied
  std::vector<std::string> unvalidated_;
  std::vector<std::string> notes_;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/config/config-inl.hpp>
#endif
