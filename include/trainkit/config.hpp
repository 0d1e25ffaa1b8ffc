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
#include <trainkit/schedule.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <filesystem>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
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

/// A configuration that cannot be used. `path()` is the key ("TRAIN.LR", "TRAIN.BATCH_IMAGES[1]";
/// empty for file-level errors), `what()` is "KEY.PATH: what is wrong and what would be right",
/// or "FILE:LINE:COLUMN: ..." for syntax errors (line() and column() are then >= 1).
class ConfigError : public std::runtime_error {
 public:
  ConfigError(std::string path, const std::string& message)
      : std::runtime_error(path.empty() ? message : path + ": " + message),
        path_(std::move(path)),
        message_(message) {}
  /// A file-level error at a position of `file` (line and column from 1).
  static ConfigError at(const std::string& file, std::int64_t line, std::int64_t column,
                        const std::string& message) {
    ConfigError e("", file + ":" + std::to_string(line) + ":" + std::to_string(column) + ": " +
                          message);
    e.line_ = line;
    e.column_ = column;
    return e;
  }
  const std::string& path() const noexcept { return path_; }
  /// The message without the path.
  const std::string& message() const noexcept { return message_; }
  std::int64_t line() const noexcept { return line_; }
  std::int64_t column() const noexcept { return column_; }

 private:
  std::string path_;
  std::string message_;
  std::int64_t line_ = 0;
  std::int64_t column_ = 0;
};

namespace detail {

inline std::string join_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}
inline std::string index_path(const std::string& parent, std::size_t i) {
  return parent + "[" + std::to_string(i) + "]";
}

/// JSON text of `v` for messages and output; bytes that are not UTF-8 print as U+FFFD instead
/// of throwing (the loaders reject such strings, so this is only a safety net).
inline std::string dump_text(const nlohmann::json& v, int indent = -1) {
  return v.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

/// True when `s` is well-formed UTF-8 (what JSON, YAML and every message require).
inline bool valid_utf8(const std::string& s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const std::size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    std::uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (std::size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 0x2) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    // No overlong forms, no surrogates, nothing past U+10FFFF.
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += n;
  }
  return true;
}

/// A value as a message names it: `the string "fast"`, `the integer 3`, `a list of 2 values`.
inline std::string describe_value(const nlohmann::json& v) {
  auto shorten = [](std::string s) { return s.size() > 60 ? s.substr(0, 57) + "..." : s; };
  switch (v.type()) {
    case nlohmann::json::value_t::null: return "an empty value (null)";
    case nlohmann::json::value_t::boolean: return std::string("the boolean ") + (v.get<bool>() ? "true" : "false");
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: return "the integer " + dump_text(v);
    case nlohmann::json::value_t::number_float: return "the number " + dump_text(v);
    case nlohmann::json::value_t::string: return "the string " + shorten(dump_text(v));
    case nlohmann::json::value_t::array:
      return v.empty() ? "an empty list" : "a list of " + std::to_string(v.size()) + " values " + shorten(dump_text(v));
    case nlohmann::json::value_t::object: return v.empty() ? "an empty mapping" : "a mapping";
    default: return "a value of an unsupported kind";
  }
}

/// A number as messages print it: integral values without a fraction (128, 1), others in
/// the shortest form that reads back the same (0.1, 1e-07).
inline std::string format_number(double x) {
  if (std::isfinite(x) && std::floor(x) == x && std::fabs(x) < 1e15) return std::to_string(static_cast<long long>(x));
  return nlohmann::json(x).dump();
}
inline std::string format_numbers(const std::vector<double>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + format_number(v[i]);
  return s + "]";
}

/// Optimal-string-alignment distance (Levenshtein plus adjacent transpositions), so that
/// TRIAN and TRAIN are 1 apart.
inline std::size_t edit_distance(const std::string& a, const std::string& b) {
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<std::size_t>> d(n + 1, std::vector<std::size_t>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= n; ++i)
    for (std::size_t j = 1; j <= m; ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

inline std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

/// The candidate nearest to `word`, if it is near enough to be a plausible misspelling: a
/// case-insensitive match always is; otherwise at most max(1, length/4) edits away (two for
/// GRAD_ACCULATE_STEPS -> GRAD_ACCUMULATE_STEPS).
inline std::optional<std::string> nearest(const std::string& word,
                                          const std::vector<std::string>& candidates) {
  std::optional<std::string> best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  for (const auto& c : candidates) {
    const std::size_t d = upper(c) == upper(word) ? 0 : edit_distance(upper(word), upper(c));
    if (d < best_distance) best_distance = d, best = c;
  }
  const std::size_t limit = std::max<std::size_t>(1, word.size() / 4);
  if (best && best_distance <= limit) return best;
  return std::nullopt;
}

inline bool all_digits(const std::string& s, std::size_t from, int base) {
  if (from >= s.size()) return false;
  for (std::size_t i = from; i < s.size(); ++i) {
    const char c = s[i];
    const bool ok = base == 16 ? std::isxdigit(static_cast<unsigned char>(c)) != 0
                  : base == 8  ? (c >= '0' && c <= '7')
                               : (c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

/// [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?  (YAML 1.2 core schema float)
inline bool is_core_float(const std::string& s) {
  std::size_t i = 0;
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
  std::size_t int_digits = 0, frac_digits = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++int_digits;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++frac_digits;
  }
  if (int_digits == 0 && frac_digits == 0) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
    std::size_t exp_digits = 0;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++exp_digits;
    if (exp_digits == 0) return false;
  }
  return i == s.size();
}

/// The value of an unquoted scalar under the YAML 1.2 core schema, which is also how `--set`
/// values are read: `1e-7` and `2.5` are numbers, `8` an integer, `true`/`false` booleans,
/// `~`/`null`/empty null, anything else (`dynamic`, `0,1`, `yes`) a string.
inline nlohmann::json resolve_plain_scalar(const std::string& s) {
  if (s.empty() || s == "~" || s == "null" || s == "Null" || s == "NULL") return nullptr;
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  auto parse_int = [&](std::size_t from, int base, bool negative) -> nlohmann::json {
    std::uint64_t u = 0;
    const auto r = std::from_chars(s.data() + from, s.data() + s.size(), u, base);
    const std::uint64_t limit = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    if (r.ec == std::errc() && r.ptr == s.data() + s.size()) {
      if (!negative && u <= limit) return static_cast<std::int64_t>(u);
      if (negative && u <= limit + 1) return u == limit + 1 ? std::numeric_limits<std::int64_t>::min()
                                                            : -static_cast<std::int64_t>(u);
    }
    // Too large for int64: keep it as a (rounded) number rather than failing.
    double x = 0;
    for (std::size_t i = from; i < s.size(); ++i)
      x = x * base + std::stoi(std::string(1, s[i]), nullptr, base);
    return negative ? -x : x;
  };
  {
    const bool sign = s[0] == '-' || s[0] == '+';
    if (all_digits(s, sign ? 1 : 0, 10)) return parse_int(sign ? 1 : 0, 10, s[0] == '-');
    if (s.size() > 2 && s[0] == '0' && s[1] == 'x' && all_digits(s, 2, 16)) return parse_int(2, 16, false);
    if (s.size() > 2 && s[0] == '0' && s[1] == 'o' && all_digits(s, 2, 8)) return parse_int(2, 8, false);
  }
  if (is_core_float(s)) {
    double x = 0;
    const std::size_t from = s[0] == '+' ? 1 : 0;
    const auto r = std::from_chars(s.data() + from, s.data() + s.size(), x);
    // from_chars rejects a leading '.' on some libraries; strtod in the "C" locale agrees
    // with it otherwise, and out-of-range values come back as +-inf or 0 from either.
    if (r.ec == std::errc() && r.ptr == s.data() + s.size()) return x;
    return std::strtod(s.c_str(), nullptr);
  }
  for (const char* inf : {".inf", ".Inf", ".INF"}) {
    if (s == inf || s == std::string("+") + inf) return std::numeric_limits<double>::infinity();
    if (s == std::string("-") + inf) return -std::numeric_limits<double>::infinity();
  }
  if (s == ".nan" || s == ".NaN" || s == ".NAN") return std::numeric_limits<double>::quiet_NaN();
  return s;
}

/// Parses YAML text into JSON; registered by <trainkit/config_yaml.hpp>. A plain function
/// pointer in a function-local static: a capability of the program (is yaml-cpp linked?), not
/// state of any Config.
using YamlParser = nlohmann::json (*)(const std::string& text, const std::string& name);
inline YamlParser& yaml_parser() {
  static YamlParser parser = nullptr;
  return parser;
}

/// Builds the JSON tree from nlohmann's SAX events, so that a duplicate key is an error with
/// its path (the DOM parser keeps the last one silently) and nesting is bounded.
class JsonTreeBuilder : public nlohmann::json_sax<nlohmann::json> {
 public:
  static constexpr std::size_t max_depth = 64;
  explicit JsonTreeBuilder(std::string name) : name_(std::move(name)) {}
  nlohmann::json& result() { return root_; }

  bool null() override { return add(nullptr); }
  bool boolean(bool v) override { return add(v); }
  bool number_integer(number_integer_t v) override { return add(v); }
  bool number_unsigned(number_unsigned_t v) override {
    if (v <= static_cast<number_unsigned_t>(std::numeric_limits<std::int64_t>::max()))
      return add(static_cast<std::int64_t>(v));
    return add(static_cast<double>(v));
  }
  bool number_float(number_float_t v, const string_t&) override { return add(v); }
  bool string(string_t& v) override { return add(v); }
  bool binary(binary_t&) override { return add(nullptr); }
  bool start_object(std::size_t) override { return open(nlohmann::json::object()); }
  bool start_array(std::size_t) override { return open(nlohmann::json::array()); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool key(string_t& k) override {
    Frame& f = frames_.back();
    if (f.node->contains(k)) throw ConfigError(path_of(k), "duplicate key (the file sets it twice; keep one)");
    f.key = k;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override {
    // nlohmann's message: "[json.exception.parse_error.101] parse error at line 3, column 12: ..."
    const std::string what = ex.what();
    std::int64_t line = 0, column = 0;
    std::string message = what;
    const auto at = what.find("at line ");
    if (at != std::string::npos) {
      std::istringstream in(what.substr(at + 8));
      char comma = 0;
      std::string word;
      in >> line >> comma >> word >> column;
      const auto colon = what.find(": ", at);
      if (colon != std::string::npos) message = what.substr(colon + 2);
    } else {
      const auto bracket = what.find("] ");
      if (bracket != std::string::npos) message = what.substr(bracket + 2);
    }
    throw ConfigError::at(name_, std::max<std::int64_t>(line, 1), std::max<std::int64_t>(column, 1),
                          "invalid JSON: " + message);
  }

 private:
  struct Frame {
    nlohmann::json* node;
    std::string key;  // objects: the key being read
  };
  // The path of key `last` of the innermost (object) frame: each frame sits in its parent at
  // the parent's current key, or at the parent's last index for arrays.
  std::string path_of(const std::string& last) const {
    std::string p;
    for (std::size_t i = 1; i < frames_.size(); ++i) {
      const Frame& parent = frames_[i - 1];
      p = parent.node->is_array() ? index_path(p, parent.node->size() - 1) : join_path(p, parent.key);
    }
    return join_path(p, last);
  }
  nlohmann::json* place(nlohmann::json v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = frames_.back();
    if (f.node->is_array()) {
      f.node->push_back(std::move(v));
      return &f.node->back();
    }
    return &((*f.node)[f.key] = std::move(v));
  }
  bool add(nlohmann::json v) {
    place(std::move(v));
    return true;
  }
  bool open(nlohmann::json v) {
    if (frames_.size() >= max_depth)
      throw ConfigError("", name_ + ": values nested more than " + std::to_string(max_depth) +
                                " levels deep; a configuration is never that deep");
    nlohmann::json* node = place(std::move(v));
    frames_.push_back({node, {}});
    return true;
  }
  bool close() {
    frames_.pop_back();
    return true;
  }

  std::string name_;
  nlohmann::json root_;
  std::vector<Frame> frames_;
};

/// JSON text to a tree; syntax errors carry line and column, duplicate keys their path.
inline nlohmann::json parse_json_text(const std::string& text, const std::string& name) {
  JsonTreeBuilder builder(name);
  nlohmann::json::sax_parse(text, &builder, nlohmann::json::input_format_t::json, /*strict=*/true,
                            /*ignore_comments=*/false);
  return std::move(builder.result());
}

}  // namespace detail

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
    if (!unquoted.is_string() && !unquoted.is_null() && accepts_kind(unquoted))
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

/// The precision a configuration asks for (the PrecisionPolicy tag it dispatches to).
enum class PrecisionKind { FP32, BF16, FP16Static, FP16Dynamic };
/// The clipping a configuration asks for (the ClipPolicy tag it dispatches to).
enum class ClipKind { NoClip, ClipNorm, ClipValue };

inline const char* to_string(PrecisionKind p) {
  switch (p) {
    case PrecisionKind::FP32: return "FP32";
    case PrecisionKind::BF16: return "BF16";
    case PrecisionKind::FP16Static: return "FP16Static";
    case PrecisionKind::FP16Dynamic: return "FP16Dynamic";
  }
  return "?";
}
inline const char* to_string(ClipKind c) {
  switch (c) {
    case ClipKind::NoClip: return "NoClip";
    case ClipKind::ClipNorm: return "ClipNorm";
    case ClipKind::ClipValue: return "ClipValue";
  }
  return "?";
}

/// Which Trainer type a configuration needs: the three policies as values. Mirrors
/// `Trainer<PrecisionPolicy<P>, AccumulationPolicy<N>, ClipPolicy<C>>` without needing torch.
struct TrainerKey {
  /// AccumulationPolicy<Dynamic>: the window length is read at run time.
  static constexpr int dynamic = -1;
  PrecisionKind precision = PrecisionKind::FP32;
  int accumulation = 1;  ///< micro-batches per window, or `dynamic`
  ClipKind clip = ClipKind::NoClip;
  /// PrecisionPolicy<MasterWeights<precision>> (precision BF16 or FP16*; TRAIN.MASTER_WEIGHTS).
  bool master_weights = false;

  /// The key the registry (registry.hpp) runs: the same with AccumulationPolicy<Dynamic>, whose
  /// window length is then the run-time TrainerOptions::accumulation_steps. A fixed count
  /// generates the same step (measured: benchmarks/accumulation_fixed_vs_dynamic), so the
  /// registry compiles Dynamic only.
  TrainerKey dispatched() const {
    TrainerKey k = *this;
    k.accumulation = dynamic;
    return k;
  }
  /// Trainer<...>::name() of this key: "Trainer<FP16Dynamic, Accumulate<4>, ClipNorm>".
  std::string name() const {
    const std::string n = accumulation == dynamic ? "Dynamic" : std::to_string(accumulation);
    const std::string p = master_weights ? std::string("MasterWeights<") + to_string(precision) + ">"
                                         : std::string(to_string(precision));
    return "Trainer<" + p + ", Accumulate<" + n + ">, " + to_string(clip) + ">";
  }
  friend bool operator==(const TrainerKey& a, const TrainerKey& b) {
    return a.precision == b.precision && a.accumulation == b.accumulation && a.clip == b.clip &&
           a.master_weights == b.master_weights;
  }
  friend bool operator!=(const TrainerKey& a, const TrainerKey& b) { return !(a == b); }
};

/// The optimizer a configuration asks for, with VL-BERT's settings (AdamW: betas (0.9, 0.999),
/// eps 1e-6, decay on every parameter; Adam: torch.optim.Adam's defaults; SGD: dampening 0).
struct OptimizerSettings {
  std::string name = "SGD";  ///< "SGD", "Adam" or "AdamW"
  double lr = 0.1;           ///< the base learning rate (after LR_SCALING)
  double weight_decay = 1e-4;
  double momentum = 0.9;     ///< SGD only
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
};

/// Values that follow from the configuration and the launch (world size).
struct Derived {
  std::int64_t world_size = 1;
  std::int64_t batch_images = 1;        ///< per-device micro-batch: sum(TRAIN.BATCH_IMAGES)
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

namespace detail {

/// "14,18" or "14, 18.5" -> [14.0, 18.5] (VL-BERT's LR_STEP string form).
inline nlohmann::json parse_epoch_list(const nlohmann::json& v) {
  const std::string s = v.get<std::string>();
  nlohmann::json out = nlohmann::json::array();
  if (s.find_first_not_of(" \t") == std::string::npos) return out;
  std::size_t from = 0;
  while (true) {
    const std::size_t comma = s.find(',', from);
    std::string item = s.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    const nlohmann::json x = resolve_plain_scalar(item);
    if (!x.is_number() || !std::isfinite(x.get<double>()) || x.get<double>() < 0)
      throw std::invalid_argument("expected epochs as numbers >= 0 separated by commas (\"14,18\") or a list "
                                  "([14, 18]), got the string " + dump_text(v));
    out.push_back(x.get<double>());
    if (comma == std::string::npos) break;
    from = comma + 1;
  }
  return out;
}

inline std::string check_increasing(const nlohmann::json& epochs) {
  for (std::size_t i = 1; i < epochs.size(); ++i)
    if (epochs[i].get<double>() < epochs[i - 1].get<double>()) {
      std::vector<double> given = epochs.get<std::vector<double>>(), sorted = given;
      std::sort(sorted.begin(), sorted.end());
      return "epochs must be in increasing order, got " + format_numbers(given) + "; write " + format_numbers(sorted);
    }
  return {};
}

/// The TRAIN section of config.md: VL-BERT's keys, then trainkit's.
inline Schema train_schema() {
  Schema s;
  // --- VL-BERT's keys -------------------------------------------------------------------
  s.list("LR_MULT", Field::any().check([](const nlohmann::json& p) -> std::string {
     if (p.is_array() && p.size() == 2 && p[0].is_string() && p[1].is_number() &&
         std::isfinite(p[1].get<double>()) && p[1].get<double>() >= 0)
       return {};
     return "expected a pair [name-substring, multiplier >= 0] such as [\"vlbert\", 0.1], got " + describe_value(p);
   })).doc("parameter groups: [name-substring, LR multiplier] pairs; the first match wins");
  s.number("VISUAL_SCALE_TEXT_LR_MULT", 1.0).doc("accepted for compatibility with VL-BERT; unused");
  s.number("VISUAL_SCALE_OBJECT_LR_MULT", 1.0).doc("accepted for compatibility with VL-BERT; unused");
  s.number("VISUAL_SCALE_CLIP_GRAD_NORM", -1.0).doc("accepted for compatibility with VL-BERT; unused");
  s.boolean("SHUFFLE", true).doc("shuffle the training data");
  s.number("FLIP_PROB", 0.5).min(0).max(1).doc("application-defined augmentation probability");
  s.add("BATCH_IMAGES", Field::either({Field::integer(1).min(1),
                                       Field::list(Field::integer(1).min(1)).non_empty()}, 1))
      .doc("per-device micro-batch; a list (one per data set) is summed");
  s.boolean("ASPECT_GROUPING", true).doc("application-defined batching");
  s.boolean("RESUME", false).doc("resume from the checkpoint of BEGIN_EPOCH - 1");
  s.boolean("AUTO_RESUME", true).doc("resume from the newest complete checkpoint, if any");
  s.integer("BEGIN_EPOCH", 0).min(0).doc("first epoch");
  s.integer("END_EPOCH", 0).min(0).doc("end epoch (exclusive); must be > BEGIN_EPOCH to train");
  s.string("OPTIMIZER", "SGD").one_of({"SGD", "Adam", "AdamW"});
  s.number("CLIP_GRAD_NORM", -1.0).doc("> 0: clip the global gradient norm to this (ClipNorm)");
  s.integer("GRAD_ACCUMULATE_STEPS", 1).min(1).doc("micro-batches per optimizer step");
  s.number("LR", 0.1).min_exclusive(0).doc("per-sample learning rate (LR_SCALING per_sample)");
  s.string("LR_SCHEDULE", "step").one_of({"step", "triangle", "plateau", "cosine", "constant"});
  s.number("LR_FACTOR", 0.1).min_exclusive(0).doc("decay factor of step and plateau");
  s.add("LR_STEP", Field::either({Field::list(Field::number(0).min(0)),
                                  Field::string("").transform(parse_epoch_list),
                                  Field::number(0).min(0).transform([](const nlohmann::json& x) {
                                    return nlohmann::json::array({x});
                                  })},
                                 nlohmann::json::array())
                       .check(check_increasing))
      .doc("decay epochs of step: \"14,18\" or [14, 18]");
  s.boolean("WARMUP", false);
  s.string("WARMUP_METHOD", "linear").one_of({"linear", "constant"});
  s.number("WARMUP_FACTOR", 1.0 / 3).min(0).doc("starting LR factor of warmup");
  s.integer("WARMUP_STEPS", 1000).min(0).doc("warmup length in optimizer steps");
  s.number("WD", 1e-4).min(0).doc("weight decay");
  s.number("MOMENTUM", 0.9).min(0).max_exclusive(1).doc("SGD momentum");
  s.boolean("FP16", false).doc("FP16 mixed precision");
  s.add("FP16_LOSS_SCALE", Field::either({Field::string("dynamic").one_of({"dynamic"}),
                                          Field::number(128.0).min_exclusive(0)}, 128.0))
      .doc("'dynamic' (FP16Dynamic) or a fixed scale > 0 (FP16Static)");
  s.list("LOSS_LOGGERS", Field::string("").check([](const nlohmann::json& v) -> std::string {
     const std::string t = v.get<std::string>();
     const auto comma = t.find(',');
     if (comma != std::string::npos && comma > 0 && comma + 1 < t.size() && t.find(',', comma + 1) == std::string::npos)
       return {};
     return "expected \"output_key,DisplayName\" (one comma), got " + dump_text(v);
   })).doc("extra losses to log, as \"output_key,DisplayName\"");
  // --- trainkit's additions ---------------------------------------------------------------
  s.boolean("BF16", false).doc("BF16 mixed precision (exclusive with FP16)");
  s.number("FP16_INIT_SCALE", 65536.0).min_exclusive(0).doc("initial dynamic loss scale");
  s.number("FP16_GROWTH_FACTOR", 2.0).min_exclusive(1);
  s.number("FP16_BACKOFF_FACTOR", 0.5).min_exclusive(0).max_exclusive(1);
  s.integer("FP16_GROWTH_INTERVAL", 2000).min(1);
  s.integer("FP16_HYSTERESIS", 1).min(1).doc("overflows in a row before the scale is cut");
  s.number("FP16_MIN_LOSS_SCALE", 1.0).min(0);
  s.number("FP16_MAX_LOSS_SCALE", 16777216.0).min_exclusive(0).allow_infinity();
  s.number("CLIP_GRAD_VALUE", -1.0).doc("> 0: clamp every gradient to [-v, v] (ClipValue)");
  s.string("LR_SCALING", "per_sample").one_of({"per_sample", "none"})
      .doc("per_sample: base LR = LR x total batch (VL-BERT); none: LR is the base LR");
  s.string("PARTIAL_WINDOW", "flush").one_of({"flush", "span", "drop"});
  s.string("NONFINITE", "skip").one_of({"skip", "abort"});
  s.boolean("MASTER_WEIGHTS", false)
      .doc("with FP16 or BF16: the model stored in half precision, fp32 master weights in the trainer (Apex O2)");
  s.integer("CHECKPOINT_KEEP", 3).min(1).doc("complete checkpoints kept (plus the best)");

  s.rule([](const nlohmann::json& t, const std::string& path) {
    if (t["FP16"].get<bool>() && t["BF16"].get<bool>())
      throw ConfigError(join_path(path, "BF16"),
                        "FP16 and BF16 are both true; set one of them to false (FP16: float16 with loss "
                        "scaling; BF16: bfloat16, no scaling)");
    if (t["MASTER_WEIGHTS"].get<bool>() && !t["FP16"].get<bool>() && !t["BF16"].get<bool>())
      throw ConfigError(join_path(path, "MASTER_WEIGHTS"),
                        "needs FP16 or BF16 (master weights are the fp32 copies of a half-precision model); "
                        "set FP16: true or BF16: true, or MASTER_WEIGHTS: false");
    const double norm = t["CLIP_GRAD_NORM"].get<double>(), value = t["CLIP_GRAD_VALUE"].get<double>();
    if (norm > 0 && value > 0)
      throw ConfigError(join_path(path, "CLIP_GRAD_VALUE"),
                        "CLIP_GRAD_NORM (" + format_number(norm) + ") and CLIP_GRAD_VALUE (" + format_number(value) +
                            ") are both > 0; clip by norm or by value, and set the other to -1");
    const double lo = t["FP16_MIN_LOSS_SCALE"].get<double>(), hi = t["FP16_MAX_LOSS_SCALE"].get<double>();
    if (!(hi > lo))
      throw ConfigError(join_path(path, "FP16_MAX_LOSS_SCALE"),
                        "must be > FP16_MIN_LOSS_SCALE (" + format_number(lo) + "), got " + format_number(hi));
    if (t["LR_SCHEDULE"].get<std::string>() == "plateau" && !(t["LR_FACTOR"].get<double>() < 1))
      throw ConfigError(join_path(path, "LR_FACTOR"), "plateau cuts the LR by LR_FACTOR, so it must be < 1, got " +
                                                          format_number(t["LR_FACTOR"].get<double>()));
    const double init = t["FP16_INIT_SCALE"].get<double>();
    if (t["FP16"].get<bool>() && t["FP16_LOSS_SCALE"].is_string() && !(init >= lo && init <= hi))
      throw ConfigError(join_path(path, "FP16_INIT_SCALE"),
                        "must lie within [FP16_MIN_LOSS_SCALE, FP16_MAX_LOSS_SCALE] = [" + format_number(lo) + ", " +
                            format_number(hi) + "], got " + format_number(init));
  });
  return s;
}

/// The top level of config.md (TRAIN included); application sections are added to it.
inline Schema root_schema() {
  Schema s;
  s.integer("RNG_SEED", -1).min(-1).doc("seed of every RNG the toolkit touches; -1: random (printed)");
  s.string("OUTPUT_PATH", "./output").doc("root of checkpoints and logs (--model-dir overrides)");
  s.string("MODEL_PREFIX", "model").doc("checkpoint file prefix");
  s.add("GPUS", Field::either({Field::string(""), Field::integer(0).min(0).transform([](const nlohmann::json& v) {
                                 return nlohmann::json(std::to_string(v.get<std::int64_t>()));
                               })},
                              "")
                    .check([](const nlohmann::json& v) -> std::string {
                      const std::string s = v.get<std::string>();
                      bool ok = true, digit = false;
                      for (char c : s) {
                        if (c == ',') ok = ok && digit, digit = false;
                        else if (c >= '0' && c <= '9') digit = true;
                        else if (c != ' ') ok = false;
                      }
                      if (ok && (digit || s.empty())) return {};
                      return "expected device numbers separated by commas such as '0,1,2,3' (empty: CPU, or the "
                             "local rank's GPU), got " + dump_text(v);
                    }))
      .doc("device list such as '0,1,2,3'; empty: CPU, or the local rank's GPU when distributed");
  s.integer("LOG_FREQUENT", 50).min(1).doc("log every N optimizer steps");
  s.integer("VAL_FREQUENT", 1).min(1).doc("validate every N epochs");
  s.integer("CHECKPOINT_FREQUENT", 1).min(1).doc("checkpoint every N epochs");
  s.integer("NUM_WORKERS_PER_GPU", 4).min(0).doc("data-loading workers");
  s.string("MODULE", "").doc("the application's model name");
  s.list("SCALES", Field::any()).doc("application-defined (image scales in VL-BERT)");
  s.section("TRAIN", train_schema());
  return s;
}

/// Section names a VL-BERT file uses; a top-level key near one of them (NETWROK) is a typo,
/// not an application section of its own.
inline const std::vector<std::string>& well_known_sections() {
  static const std::vector<std::string> names = {"TRAIN", "NETWORK", "DATASET", "VAL", "TEST"};
  return names;
}

}  // namespace detail

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
    d.batch_images = 0;
    if (b.is_array()) for (const auto& x : b) d.batch_images += x.get<std::int64_t>();
    else d.batch_images = b.get<std::int64_t>();
    d.accumulation_steps = t["GRAD_ACCUMULATE_STEPS"].get<std::int64_t>();
    d.total_batch = d.world_size * d.batch_images * d.accumulation_steps;
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

/// The command line of an example driver: --cfg FILE, --set K=V (repeatable), --model-dir DIR,
/// --resume; anything else is kept in `rest` for the program.
struct CommandLine {
  std::string cfg;
  std::vector<std::string> sets;
  std::string model_dir;
  bool resume = false;
  std::vector<std::string> rest;

  static CommandLine parse(int argc, const char* const* argv) {
    CommandLine c;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&](const std::string& flag) -> std::string {
        if (a.size() > flag.size() && a.compare(0, flag.size() + 1, flag + "=") == 0) return a.substr(flag.size() + 1);
        if (i + 1 >= argc) throw ConfigError("", flag + ": expected a value after it");
        return argv[++i];
      };
      auto is = [&](const std::string& flag) { return a == flag || a.rfind(flag + "=", 0) == 0; };
      if (is("--cfg")) c.cfg = value("--cfg");
      else if (is("--set")) c.sets.push_back(value("--set"));
      else if (is("--model-dir")) c.model_dir = value("--model-dir");
      else if (a == "--resume") c.resume = true;
      else c.rest.push_back(a);
    }
    return c;
  }
  /// The overrides these flags mean, in order: the --set values, then OUTPUT_PATH=--model-dir
  /// and TRAIN.RESUME=true.
  std::vector<std::string> overrides() const {
    std::vector<std::string> o = sets;
    if (!model_dir.empty()) o.push_back("OUTPUT_PATH=" + detail::dump_text(nlohmann::json(model_dir)));
    if (resume) o.push_back("TRAIN.RESUME=true");
    return o;
  }
};

}  // namespace trainkit

