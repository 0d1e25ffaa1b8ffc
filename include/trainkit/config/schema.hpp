#pragma once
/// A schema library for configuration trees: Field (one key: type, default, range, choices) and
/// Schema (a section's keys and the rules relating them), resolving a tree with every default
/// filled in and every error naming its full key path.
#include <trainkit/detail/inline.hpp>
#include <trainkit/config/error.hpp>
#include <trainkit/config/text.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

class Schema;

/// One key of a schema: its type, default and checks. Built fluently:
///   schema.number("LR", 0.1).min_exclusive(0).doc("per-sample learning rate");
///   schema.add("BATCH_IMAGES", Field::either({Field::integer(1).min(1),
///                                             Field::list(Field::integer(1).min(1)).non_empty()}, 1));
class Field {
 public:
  enum class Kind { boolean, integer, number, string, list, section, any, either };

  static Field boolean(bool def) { return Field(Kind::boolean, def); }
  static Field integer(std::int64_t def) { return Field(Kind::integer, def); }
  static Field number(double def) { return Field(Kind::number, def); }
  static Field string(std::string def) { return Field(Kind::string, std::move(def)); }
  /// A list whose every element is checked by `element`.
  static Field list(Field element, nlohmann::json def = nlohmann::json::array());
  /// A nested section (a mapping) with its own schema; absent or empty means its defaults.
  static Field section(Schema schema);
  /// Anything, unchecked (application-defined values such as SCALES).
  static Field any(nlohmann::json def = nullptr) { return Field(Kind::any, std::move(def)); }
  /// The first alternative whose kind matches the value checks it (an integer or a list of
  /// integers; the string 'dynamic' or a number).
  static Field either(std::vector<Field> alternatives, nlohmann::json def);

  /// Numbers (integer and number fields): inclusive and exclusive bounds.
  Field& min(double v) { return bound(lower_, v, true); }
  Field& min_exclusive(double v) { return bound(lower_, v, false); }
  Field& max(double v) { return bound(upper_, v, true); }
  Field& max_exclusive(double v) { return bound(upper_, v, false); }
  /// Number fields accept +-inf (YAML `.inf`); by default every number must be finite.
  Field& allow_infinity();
  /// String fields: the accepted values (case-sensitive; a near miss is suggested).
  Field& one_of(std::vector<std::string> choices);
  /// List fields: at least one element.
  Field& non_empty();
  /// A check on the normalized value: returns "" when it holds, else what is wrong and what
  /// would be right ("epochs must increase, got [18, 14]; write [14, 18]").
  Field& check(std::function<std::string(const nlohmann::json&)> rule);
  /// Rewrites the checked value (the comma string "14,18" into [14.0, 18.0]); throws
  /// std::invalid_argument with what is wrong.
  Field& transform(std::function<nlohmann::json(const nlohmann::json&)> fn);
  /// One line on what the key is for (printed by `trainkit-config schema`).
  Field& doc(std::string text);

  Kind kind() const { return kind_; }
  const nlohmann::json& default_value() const { return default_; }
  const std::string& doc() const { return doc_; }
  const Schema* schema() const { return schema_.get(); }

  /// What the field's type accepts, as a message says it: "a number", "one of SGD, Adam, AdamW".
  std::string expected() const;

  /// True when `v` has a kind this field reads (before any range check).
  bool accepts_kind(const nlohmann::json& v) const;

  /// Checks `value` (given at `path`) and returns it normalized: integers as int64, numbers
  /// as double, sections with every default filled in.
  nlohmann::json resolve(const nlohmann::json& value, const std::string& path) const;
  /// The value of an absent key: the default (a section's defaults for sections).
  nlohmann::json resolve_default(const std::string& path) const;

 private:
  struct Bound {
    bool set = false;
    double value = 0;
    bool inclusive = true;
  };
  Field(Kind kind, nlohmann::json def) : kind_(kind), default_(std::move(def)) {}
  Field& bound(Bound& b, double v, bool inclusive);
  static bool integral(double x);
  static std::string join(const std::vector<std::string>& v);
  [[noreturn]] void type_error(const nlohmann::json& v, const std::string& path) const;
  void check_range(double x, const nlohmann::json& shown, const std::string& path) const;

  Kind kind_;
  nlohmann::json default_;
  std::string doc_;
  Bound lower_, upper_;
  bool infinity_ = false;
  bool non_empty_ = false;
  std::vector<std::string> choices_;
  std::shared_ptr<const Field> element_;
  std::shared_ptr<const Schema> schema_;
  std::vector<Field> alternatives_;
  std::vector<std::function<std::string(const nlohmann::json&)>> checks_;
  std::function<nlohmann::json(const nlohmann::json&)> transform_;
};

/// The keys of one section, with their fields, and the rules that relate keys to each other.
class Schema {
 public:
  Field& boolean(const std::string& key, bool def) { return add(key, Field::boolean(def)); }
  Field& integer(const std::string& key, std::int64_t def) { return add(key, Field::integer(def)); }
  Field& number(const std::string& key, double def) { return add(key, Field::number(def)); }
  Field& string(const std::string& key, std::string def) { return add(key, Field::string(std::move(def))); }
  Field& list(const std::string& key, Field element, nlohmann::json def = nlohmann::json::array());
  Field& section(const std::string& key, Schema schema) { return add(key, Field::section(std::move(schema))); }
  Field& any(const std::string& key, nlohmann::json def = nullptr) { return add(key, Field::any(std::move(def))); }
  /// Adds (or replaces) a key. The returned reference stays valid while the schema lives.
  Field& add(const std::string& key, Field field);
  /// A rule over the resolved section (every key present), run after its keys are checked.
  /// Throw ConfigError(path + ".KEY", "...") naming the key to change.
  Schema& rule(std::function<void(const nlohmann::json& section, const std::string& path)> fn);
  /// Keys not in the schema pass through unchecked instead of being errors.
  Schema& allow_unknown_keys(bool allow = true);

  bool has(const std::string& key) const { return fields_.count(key) != 0; }
  const Field* find(const std::string& key) const;
  /// Keys in the order they were added.
  const std::vector<std::string>& keys() const { return order_; }

  /// Checks a section's value (a mapping, or null for an empty section) given at `path` and
  /// returns it with every default filled in.
  nlohmann::json resolve(const nlohmann::json& value, const std::string& path) const;

  /// The error for a key this schema does not have: the nearest known key, or the list of keys.
  ConfigError unknown_key(const std::string& key, const std::string& path) const;

 private:
  std::map<std::string, Field> fields_;
  std::vector<std::string> order_;
  std::vector<std::function<void(const nlohmann::json&, const std::string&)>> rules_;
  bool open_ = false;
};






}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/config/schema-inl.hpp>
#endif
