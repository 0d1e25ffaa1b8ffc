#pragma once
/// The definitions of trainkit/config/schema.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/config/schema.hpp>

namespace trainkit {

TRAINKIT_INLINE Field Field::list(Field element, nlohmann::json def) {
  Field f(Kind::list, std::move(def));
  f.element_ = std::make_shared<Field>(std::move(element));
  return f;
}

TRAINKIT_INLINE Field Field::either(std::vector<Field> alternatives, nlohmann::json def) {
  Field f(Kind::either, std::move(def));
  f.alternatives_ = std::move(alternatives);
  return f;
}

TRAINKIT_INLINE Field& Field::allow_infinity() {
  infinity_ = true;
  return *this;
}

TRAINKIT_INLINE Field& Field::one_of(std::vector<std::string> choices) {
  choices_ = std::move(choices);
  return *this;
}

TRAINKIT_INLINE Field& Field::non_empty() {
  non_empty_ = true;
  return *this;
}

TRAINKIT_INLINE Field& Field::check(std::function<std::string(const nlohmann::json&)> rule) {
  checks_.push_back(std::move(rule));
  return *this;
}

TRAINKIT_INLINE Field& Field::transform(std::function<nlohmann::json(const nlohmann::json&)> fn) {
  transform_ = std::move(fn);
  return *this;
}

TRAINKIT_INLINE Field& Field::doc(std::string text) {
  doc_ = std::move(text);
  return *this;
}

TRAINKIT_INLINE std::string Field::expected() const {
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

TRAINKIT_INLINE bool Field::accepts_kind(const nlohmann::json& v) const {
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

TRAINKIT_INLINE Field& Field::bound(Bound& b, double v, bool inclusive) {
  b = {true, v, inclusive};
  return *this;
}

TRAINKIT_INLINE bool Field::integral(double x) {
  return std::isfinite(x) && std::floor(x) == x && std::fabs(x) < 9.2e18;
}

TRAINKIT_INLINE std::string Field::join(const std::vector<std::string>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

TRAINKIT_INLINE Field& Schema::list(const std::string& key, Field element, nlohmann::json def) {
  return add(key, Field::list(std::move(element), std::move(def)));
}

TRAINKIT_INLINE Field& Schema::add(const std::string& key, Field field) {
  if (!fields_.count(key)) order_.push_back(key);
  fields_.erase(key);
  return fields_.emplace(key, std::move(field)).first->second;
}

TRAINKIT_INLINE Schema& Schema::rule(std::function<void(const nlohmann::json& section, const std::string& path)> fn) {
  rules_.push_back(std::move(fn));
  return *this;
}

TRAINKIT_INLINE Schema& Schema::allow_unknown_keys(bool allow) {
  open_ = allow;
  return *this;
}

TRAINKIT_INLINE const Field* Schema::find(const std::string& key) const {
  auto it = fields_.find(key);
  return it == fields_.end() ? nullptr : &it->second;
}

TRAINKIT_INLINE nlohmann::json Schema::resolve(const nlohmann::json& value, const std::string& path) const {
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

TRAINKIT_INLINE ConfigError Schema::unknown_key(const std::string& key, const std::string& path) const {
  const std::string full = detail::join_path(path, key);
  if (auto near = detail::nearest(key, order_))
    return ConfigError(full, "unknown key; did you mean " + detail::join_path(path, *near) + "?");
  std::string known;
  for (std::size_t i = 0; i < order_.size(); ++i) known += (i ? ", " : "") + order_[i];
  return ConfigError(full, "unknown key; " + (path.empty() ? std::string("the top level") : path) +
                               " has " + (order_.empty() ? std::string("no keys") : "the keys " + known));
}

TRAINKIT_INLINE Field Field:: section(Schema schema) {
  Field f(Kind::section, nlohmann::json::object());
  f.schema_ = std::make_shared<const Schema>(std::move(schema));
  return f;
}

TRAINKIT_INLINE void Field:: type_error(const nlohmann::json& v, const std::string& path) const {
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

TRAINKIT_INLINE void Field:: check_range(double x, const nlohmann::json& shown, const std::string& path) const {
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

TRAINKIT_INLINE nlohmann::json Field:: resolve(const nlohmann::json& value, const std::string& path) const {
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

TRAINKIT_INLINE nlohmann::json Field:: resolve_default(const std::string& path) const {
  if (kind_ == Kind::section) return schema_->resolve(nlohmann::json::object(), path);
  return default_;
}

}  // namespace trainkit
