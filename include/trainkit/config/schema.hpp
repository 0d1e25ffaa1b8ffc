#pragma once
/// A schema library for configuration trees: Field (one key: type, default, range, choices) and
/// Schema (a section's keys and the rules relating them), resolving a tree with every default
/// filled in and every error naming its full key path.
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
  static Field list(Field element, nlohmann::json def = nlohmann::json::array()) {
    Field f(Kind::list, std::move(def));
    f.element_ = std::make_shared<Field>(std::move(element));
    return f;
  }
  /// A nested section (a mapping) with its own schema; absent or empty means its defaults.
  static Field section(Schema schema);
  /// Anything, unchecked (application-defined values such as SCALES).
  static Field any(nlohmann::json def = nullptr) { return Field(Kind::any, std::move(def)); }
  /// The first alternative whose kind matches the value checks it (an integer or a list of
  /// integers; the string 'dynamic' or a number).
  static Field either(std::vector<Field> alternatives, nlohmann::json def) {
    Field f(Kind::either, std::move(def));
    f.alternatives_ = std::move(alternatives);
    return f;
  }

  /// Numbers (integer and number fields): inclusive and exclusive bounds.
  Field& min(double v) { return bound(lower_, v, true); }
  Field& min_exclusive(double v) { return bound(lower_, v, false); }
  Field& max(double v) { return bound(upper_, v, true); }
  Field& max_exclusive(double v) { return bound(upper_, v, false); }
  /// Number fields accept +-inf (YAML `.inf`); by default every number must be finite.
  Field& allow_infinity() {
    infinity_ = true;
    return *this;
  }
  /// String fields: the accepted values (case-sensitive; a near miss is suggested).
  Field& one_of(std::vector<std::string> choices) {
    choices_ = std::move(choices);
    return *this;
  }
  /// List fields: at least one element.
  Field& non_empty() {
    non_empty_ = true;
    return *this;
  }
  /// A check on the normalized value: returns "" when it holds, else what is wrong and what
  /// would be right ("epochs must increase, got [18, 14]; write [14, 18]").
  Field& check(std::function<std::string(const nlohmann::json&)> rule) {
    checks_.push_back(std::move(rule));
    return *this;
  }
  /// Rewrites the checked value (the comma string "14,18" into [14.0, 18.0]); throws
  /// std::invalid_argument with what is wrong.
  Field& transform(std::function<nlohmann::json(const nlohmann::json&)> fn) {
    transform_ = std::move(fn);
    return *this;
  }
  /// One line on what the key is for (printed by `trainkit-config schema`).
  Field& doc(std::string text) {
    doc_ = std::move(text);
    return *this;
  }

  Kind kind() const { return kind_; }
  const nlohmann::json& default_value() const { return default_; }
  const std::string& doc() const { return doc_; }
  const Schema* schema() const { return schema_.get(); }

  /// What the field's type accepts, as a message says it: "a number", "one of SGD, Adam, AdamW".
  std::string expected() const {
    switch (kind_) {
      case Kind::boolean: return "a boolean (true or false)";
      case Kind::integer: return "an integer";
      case Kind::number: return "a number";
      case Kind::string:
        if (choices_.size() == 1) return "\"" + choices_[0] + "\"";
        if (!choices_.empty()) return "one of " + join(choices_);
        return "a string";
      case Kind::list: return "a list";
      case Kind::section: return "a section (a mapping of keys)";
      case Kind::any: return "any value";
      case Kind::either: {
        std::string s;
        for (std::size_t i = 0; i < alternatives_.size(); ++i)
          s += (i == 0 ? "" : i + 1 == alternatives_.size() ? " or " : ", ") + alternatives_[i].expected();
        return s;
      }
    }
    return {};
  }

  /// True when `v` has a kind this field reads (before any range check).
  bool accepts_kind(const nlohmann::json& v) const {
    switch (kind_) {
      case Kind::boolean: return v.is_boolean();
      case Kind::integer: return v.is_number_integer() || (v.is_number_float() && integral(v.get<double>()));
      case Kind::number: return v.is_number();
      case Kind::string: return v.is_string();
      case Kind::list: return v.is_array();
      case Kind::section: return v.is_object() || v.is_null();
      case Kind::any: return true;
      case Kind::either:
        return std::any_of(alternatives_.begin(), alternatives_.end(),
                           [&](const Field& f) { return f.accepts_kind(v); });
    }
    return false;
  }

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
  Field& bound(Bound& b, double v, bool inclusive) {
    b = {true, v, inclusive};
    return *this;
  }
  static bool integral(double x) {
    return std::isfinite(x) && std::floor(x) == x && std::fabs(x) < 9.2e18;
  }
  static std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
    return s;
  }
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
  Field& list(const std::string& key, Field element, nlohmann::json def = nlohmann::json::array()) {
    return add(key, Field::list(std::move(element), std::move(def)));
  }
  Field& section(const std::string& key, Schema schema) { return add(key, Field::section(std::move(schema))); }
  Field& any(const std::string& key, nlohmann::json def = nullptr) { return add(key, Field::any(std::move(def))); }
  /// Adds (or replaces) a key. The returned reference stays valid while the schema lives.
  Field& add(const std::string& key, Field field) {
    if (!fields_.count(key)) order_.push_back(key);
    fields_.erase(key);
    return fields_.emplace(key, std::move(field)).first->second;
  }
  /// A rule over the resolved section (every key present), run after its keys are checked.
  /// Throw ConfigError(path + ".KEY", "...") naming the key to change.
  Schema& rule(std::function<void(const nlohmann::json& section, const std::string& path)> fn) {
    rules_.push_back(std::move(fn));
    return *this;
  }
  /// Keys not in the schema pass through unchecked instead of being errors.
  Schema& allow_unknown_keys(bool allow = true) {
    open_ = allow;
    return *this;
  }

  bool has(const std::string& key) const { return fields_.count(key) != 0; }
  const Field* find(const std::string& key) const {
    auto it = fields_.find(key);
    return it == fields_.end() ? nullptr : &it->second;
  }
  /// Keys in the order they were added.
  const std::vector<std::string>& keys() const { return order_; }

  /// Checks a section's value (a mapping, or null for an empty section) given at `path` and
  /// returns it with every default filled in.
  nlohmann::json resolve(const nlohmann::json& value, const std::string& path) const {
    if (!value.is_null() && !value.is_object())
      throw ConfigError(path, "expected a section (a mapping of keys), got " + detail::describe_value(value));
    nlohmann::json out = nlohmann::json::object();
    if (value.is_object())
      for (const auto& [key, v] : value.items()) {
        const std::string key_path = detail::join_path(path, key);
        const Field* field = find(key);
        if (field) out[key] = field->resolve(v, key_path);
        else if (open_) out[key] = v;
        else throw unknown_key(key, path);
      }
    for (const auto& key : order_)
      if (!out.contains(key)) out[key] = fields_.at(key).resolve_default(detail::join_path(path, key));
    for (const auto& r : rules_) r(out, path);
    return out;
  }

  /// The error for a key this schema does not have: the nearest known key, or the list of keys.
  ConfigError unknown_key(const std::string& key, const std::string& path) const {
    const std::string full = detail::join_path(path, key);
    if (auto near = detail::nearest(key, order_))
      return ConfigError(full, "unknown key; did you mean " + detail::join_path(path, *near) + "?");
    std::string known;
    for (std::size_t i = 0; i < order_.size(); ++i) known += (i ? ", " : "") + order_[i];
    return ConfigError(full, "unknown key; " + (path.empty() ? std::string("the top level") : path) +
                                 " has " + (order_.empty() ? std::string("no keys") : "the keys " + known));
  }

 private:
  std::map<std::string, Field> fields_;
  std::vector<std::string> order_;
  std::vector<std::function<void(const nlohmann::json&, const std::string&)>> rules_;
  bool open_ = false;
};

inline Field Field::section(Schema schema) {
  Field f(Kind::section, nlohmann::json::object());
  f.schema_ = std::make_shared<const Schema>(std::move(schema));
  return f;
}

inline void Field::type_error(const nlohmann::json& v, const std::string& path) const {
  std::string hint;
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    const nlohmann::json unquoted = detail::resolve_plain_scalar(s);
    if (s.empty() && !accepts_kind(v))
      hint = " (an empty --set value, KEY=, is the empty string; remove the --set to keep the default)";
    else if (!unquoted.is_string() && !unquoted.is_null() && accepts_kind(unquoted))
      hint = "; remove the quotes";
    else if (kind_ == Kind::boolean || (kind_ == Kind::either && accepts_kind(true))) {
      static const std::set<std::string> yaml11 = {"yes", "no", "on", "off", "y", "n",
                                                   "Yes", "No", "On", "Off", "YES", "NO", "ON", "OFF"};
      if (yaml11.count(s)) hint = "; write true or false (YAML 1.2 reads yes/no/on/off as strings)";
    }
  }
  if (v.is_null()) {
    std::string def = default_.is_null() ? std::string() : " (" + detail::dump_text(default_) + ")";
    throw ConfigError(path, "got an empty value; give " + expected() + ", or remove the key to use the default" + def);
  }
  throw ConfigError(path, "expected " + expected() + ", got " + detail::describe_value(v) + hint);
}

inline void Field::check_range(double x, const nlohmann::json& shown, const std::string& path) const {
  if (std::isnan(x)) throw ConfigError(path, "expected " + expected() + ", got NaN");
  if (std::isinf(x) && !infinity_)
    throw ConfigError(path, "must be finite, got " + std::string(x > 0 ? "+" : "-") + "infinity");
  auto fail = [&](const char* op, double bound) {
    throw ConfigError(path, std::string("must be ") + op + " " + detail::format_number(bound) + ", got " +
                                (shown.is_number_integer() ? detail::dump_text(shown) : detail::dump_text(nlohmann::json(x))));
  };
  if (lower_.set && (lower_.inclusive ? !(x >= lower_.value) : !(x > lower_.value)))
    fail(lower_.inclusive ? ">=" : ">", lower_.value);
  if (upper_.set && (upper_.inclusive ? !(x <= upper_.value) : !(x < upper_.value)))
    fail(upper_.inclusive ? "<=" : "<", upper_.value);
}

inline nlohmann::json Field::resolve(const nlohmann::json& value, const std::string& path) const {
  nlohmann::json out;
  switch (kind_) {
    case Kind::boolean:
      if (!value.is_boolean()) type_error(value, path);
      out = value;
      break;
    case Kind::integer: {
      if (!accepts_kind(value)) {
        if (value.is_number_float() && std::isfinite(value.get<double>()))
          throw ConfigError(path, "expected an integer, got the number " + detail::dump_text(value));
        type_error(value, path);
      }
      const std::int64_t i = value.is_number_float() ? static_cast<std::int64_t>(value.get<double>())
                                                     : value.get<std::int64_t>();
      check_range(static_cast<double>(i), nlohmann::json(i), path);
      out = i;
      break;
    }
    case Kind::number: {
      if (!value.is_number()) type_error(value, path);
      const double x = value.get<double>();
      check_range(x, value, path);
      out = x;
      break;
    }
    case Kind::string: {
      if (!value.is_string()) type_error(value, path);
      const std::string s = value.get<std::string>();
      if (!choices_.empty() && std::find(choices_.begin(), choices_.end(), s) == choices_.end()) {
        std::string msg = "expected " + expected() + ", got " + detail::describe_value(value);
        if (auto near = detail::nearest(s, choices_)) msg += "; did you mean " + *near + "?";
        throw ConfigError(path, msg);
      }
      out = s;
      break;
    }
    case Kind::list: {
      if (!value.is_array()) type_error(value, path);
      if (non_empty_ && value.empty()) throw ConfigError(path, "expected a list with at least one value, got an empty list");
      out = nlohmann::json::array();
      for (std::size_t i = 0; i < value.size(); ++i)
        out.push_back(element_->resolve(value[i], detail::index_path(path, i)));
      break;
    }
    case Kind::section:
      out = schema_->resolve(value, path);
      break;
    case Kind::any:
      out = value;
      break;
    case Kind::either: {
      const Field* chosen = nullptr;
      for (const auto& f : alternatives_)
        if (f.accepts_kind(value)) {
          chosen = &f;
          break;
        }
      if (!chosen) type_error(value, path);
      out = chosen->resolve(value, path);
      break;
    }
  }
  if (transform_) {
    try {
      out = transform_(out);
    } catch (const std::invalid_argument& e) {
      throw ConfigError(path, e.what());
    }
  }
  for (const auto& rule : checks_) {
    const std::string problem = rule(out);
    if (!problem.empty()) throw ConfigError(path, problem);
  }
  return out;
}

inline nlohmann::json Field::resolve_default(const std::string& path) const {
  if (kind_ == Kind::section) return schema_->resolve(nlohmann::json::object(), path);
  return default_;
}

}  // namespace trainkit
