#pragma once
/// YAML configuration files for trainkit::Config (optional part: needs libyaml, the C parser
/// PyYAML uses; CMake target trainkit::yaml). Including this header anywhere in a program lets
/// Config::load() read .yaml/.yml files and `--set` take YAML flow values ([8, 8], {a: 1}).
///
/// YAML is read into the same JSON tree as the JSON form of the file, with YAML 1.2 core-schema
/// typing of unquoted scalars: `1e-7` and `6.25e-7` are numbers (PyYAML, YAML 1.1, would read
/// `1e-7` as a string), `8` an integer, `true`/`false` booleans, `~`/`null`/empty null; quoted
/// and block scalars ('dynamic', "0,1") are always strings. Syntax errors carry line and column,
/// duplicate keys their path.
///
/// A configuration is input a scheduler hands over from users, so reading one is bounded
/// (YamlLimits): the tree is built from libyaml's events as they come, and every bound is checked
/// before the memory it would cost is taken: nesting depth, values and text once aliases are
/// expanded (an alias is counted at its anchor's full size before it is copied), and the parse's
/// wall time. The file's size is bounded by Config itself (kMaxConfigBytes), for JSON too.
#include <trainkit/config/config.hpp>

#include <yaml.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {
namespace detail {

/// What reading one YAML text may cost; beyond any bound a ConfigError names the file and it.
struct YamlLimits {
  std::size_t depth = 64;                               ///< nesting of lists and mappings
  std::size_t values = 100000;                          ///< values, aliases expanded
  std::size_t expanded_bytes = std::size_t{16} << 20;   ///< keys' and scalars' text, aliases expanded
  double seconds = 10;                                  ///< the parse's wall time
};

/// libyaml's events to the JSON tree Config checks, one pass, no recursion.
class YamlReader {
 public:
  YamlReader(const std::string& text, std::string name, YamlLimits limits = {})
      : text_(text), name_(std::move(name)), limits_(limits) {
    if (!yaml_parser_initialize(&parser_)) throw ConfigError("", name_ + ": the YAML parser could not be initialised (out of memory)");
    yaml_parser_set_input_string(&parser_, reinterpret_cast<const unsigned char*>(text_.data()), text_.size());
  }
  ~YamlReader() { yaml_parser_delete(&parser_); }
  YamlReader(const YamlReader&) = delete;
  YamlReader& operator=(const YamlReader&) = delete;

  /// The document's tree (null for an empty text).
  nlohmann::json read() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(limits_.seconds);
    for (std::size_t n = 0;; ++n) {
      if ((n & 255) == 255 && std::chrono::steady_clock::now() > deadline)
        throw ConfigError("", name_ + ": reading the YAML took more than " + format_number(limits_.seconds) +
                                  " s; a configuration never does");
      Event event(parser_);
      if (!event.ok) throw parse_error();
      if (!take(event.e)) return root_;
    }
  }

 private:
  // One event, deleted however its handling ends.
  struct Event {
    explicit Event(yaml_parser_t& parser) : ok(yaml_parser_parse(&parser, &e) != 0) {}
    ~Event() {
      if (ok) yaml_event_delete(&e);
    }
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;
    yaml_event_t e{};
    bool ok;
  };
  // A list or mapping being filled.
  struct Open {
    nlohmann::json value;
    std::string path;
    std::string anchor;         // "" when none
    std::size_t values_at = 0;  // the totals when it opened (its anchor's cost)
    std::size_t bytes_at = 0;
    std::size_t height = 1;     // levels of lists and mappings in it, itself included
    bool has_key = false;       // a mapping: the key that waits for its value
    std::string key;
  };
  // A complete value under an anchor: what an alias to it copies, and what the copy costs.
  struct Anchored {
    nlohmann::json value;
    std::size_t values = 0, bytes = 0, height = 0;
    bool is_text = false;  // a scalar: an alias to it may be a key
    std::string text;
  };

  // Handles one event; false at the end of the stream.
  bool take(const yaml_event_t& e) {
    switch (e.type) {
      case YAML_STREAM_START_EVENT:
      case YAML_DOCUMENT_END_EVENT:
      case YAML_NO_EVENT: return true;
      case YAML_STREAM_END_EVENT: return false;
      case YAML_DOCUMENT_START_EVENT:
        // One document: a second (after '---') would otherwise be dropped without a word.
        if (documents_++ > 0)
          throw ConfigError::at(name_, line(e.start_mark), column(e.start_mark),
                                "a second YAML document (after '---'); a configuration file holds one document: merge "
                                "them, or pass the second with --set");
        return true;
      case YAML_SCALAR_EVENT: return scalar(e), true;
      case YAML_ALIAS_EVENT: return alias(e), true;
      case YAML_SEQUENCE_START_EVENT:
      case YAML_MAPPING_START_EVENT: return open(e), true;
      case YAML_SEQUENCE_END_EVENT:
      case YAML_MAPPING_END_EVENT: return close(), true;
    }
    return true;
  }

  // The path of the value that comes next (its parent's path and key or index).
  std::string next_path() const {
    if (stack_.empty()) return "";
    const Open& o = stack_.back();
    return o.value.is_object() ? join_path(o.path, o.key) : index_path(o.path, o.value.size());
  }
  bool key_expected() const { return !stack_.empty() && stack_.back().value.is_object() && !stack_.back().has_key; }

  void scalar(const yaml_event_t& e) {
    const auto& s = e.data.scalar;
    std::string text(reinterpret_cast<const char*>(s.value), s.length);
    count(1, text.size());
    const bool key = key_expected();
    const std::string path = key ? stack_.back().path : next_path();
    if (!valid_utf8(text)) throw ConfigError(path, std::string(key ? "a key" : "the value") + " is not valid UTF-8 text" + at(e.start_mark));
    nlohmann::json value = key ? nlohmann::json(text)
                               : typed(text, s.tag ? reinterpret_cast<const char*>(s.tag) : "",
                                       s.style == YAML_PLAIN_SCALAR_STYLE, path, e.start_mark);
    if (s.anchor) {  // the anchor's copy is counted as the values are
      count(1, 2 * text.size());
      anchors_[anchor_name(s.anchor)] = Anchored{value, 1, text.size(), 0, true, text};
    }
    if (key) return set_key(std::move(text), e.start_mark);
    add(std::move(value), 0);
  }

  // A scalar's value: plain ones typed by the core schema, quoted and block ones strings, a tag
  // obeyed where it is one of the core schema's.
  nlohmann::json typed(const std::string& text, const std::string& tag, bool plain, const std::string& path,
                       const yaml_mark_t& mark) const {
    if (tag.empty()) return plain ? resolve_plain_scalar(text) : nlohmann::json(text);
    if (tag == "!" || tag == "tag:yaml.org,2002:str") return text;
    const nlohmann::json v = resolve_plain_scalar(text);
    auto require = [&](bool ok, const char* what) {
      if (!ok) throw ConfigError(path, "the tag " + tag + " needs " + what + ", got " + describe_value(nlohmann::json(text)) + at(mark));
      return v;
    };
    if (tag == "tag:yaml.org,2002:int") return require(v.is_number_integer(), "an integer");
    if (tag == "tag:yaml.org,2002:float") return require(v.is_number(), "a number").get<double>();
    if (tag == "tag:yaml.org,2002:bool") return require(v.is_boolean(), "true or false");
    if (tag == "tag:yaml.org,2002:null") return require(v.is_null(), "an empty value");
    throw ConfigError(path, "unsupported YAML tag " + tag + "; write the value without a tag" + at(mark));
  }

  void alias(const yaml_event_t& e) {
    const std::string name = anchor_name(e.data.alias.anchor);
    const auto it = anchors_.find(name);
    if (it == anchors_.end()) {
      const std::string what = open_anchors_.count(name) ? "refers to a value that holds it (a recursive alias)"
                                                           : "has no anchor &" + name + " before it";
      throw ConfigError(key_expected() ? stack_.back().path : next_path(), "the alias *" + name + " " + what + at(e.start_mark));
    }
    const Anchored& a = it->second;
    if (key_expected()) {
      if (!a.is_text) throw ConfigError(stack_.back().path, "a key must be a plain name, got an alias to a list or mapping" + at(e.start_mark));
      count(1, a.text.size());
      return set_key(a.text, e.start_mark);
    }
    // The bounds first: the copy is made only once it is known to fit.
    if (stack_.size() + a.height > limits_.depth) throw too_deep(e.start_mark);
    count(a.values, a.bytes);
    add(a.value, a.height);
  }

  void open(const yaml_event_t& e) {
    const bool mapping = e.type == YAML_MAPPING_START_EVENT;
    if (key_expected())
      throw ConfigError(stack_.back().path, std::string("a key must be a plain name, got a ") + (mapping ? "mapping" : "list") +
                                                " as a key" + at(e.start_mark));
    if (stack_.size() + 1 > limits_.depth) throw too_deep(e.start_mark);
    const yaml_char_t* anchor = mapping ? e.data.mapping_start.anchor : e.data.sequence_start.anchor;
    count(1, 0);
    Open o;
    o.value = mapping ? nlohmann::json::object() : nlohmann::json::array();
    o.path = next_path();
    if (anchor) {
      o.anchor = anchor_name(anchor);
      open_anchors_.insert(o.anchor);
    }
    o.values_at = values_ - 1;
    o.bytes_at = bytes_;
    stack_.push_back(std::move(o));
  }

  void close() {
    Open o = std::move(stack_.back());
    stack_.pop_back();
    if (!o.anchor.empty()) {  // the anchor's copy is counted as the values are
      open_anchors_.erase(o.anchor);
      const std::size_t values = values_ - o.values_at, bytes = bytes_ - o.bytes_at;
      count(values, bytes);
      anchors_[o.anchor] = Anchored{o.value, values, bytes, o.height, false, {}};
    }
    add(std::move(o.value), o.height);
  }

  void set_key(std::string key, const yaml_mark_t& mark) {
    Open& o = stack_.back();
    if (o.value.contains(key)) throw ConfigError(join_path(o.path, key), "duplicate key (the file sets it twice; keep one)" + at(mark));
    o.key = std::move(key);
    o.has_key = true;
  }

  // A complete value `height` levels deep into its parent (or as the document).
  void add(nlohmann::json value, std::size_t height) {
    if (stack_.empty()) {
      root_ = std::move(value);
      return;
    }
    Open& o = stack_.back();
    o.height = std::max(o.height, height + 1);
    if (o.value.is_object()) {
      o.value[o.key] = std::move(value);
      o.has_key = false;
    } else {
      o.value.push_back(std::move(value));
    }
  }

  void count(std::size_t values, std::size_t bytes) {
    if ((values_ += values) > limits_.values)
      throw ConfigError("", name_ + ": more than " + std::to_string(limits_.values) +
                                " values once aliases are expanded; a configuration is never that large");
    if ((bytes_ += bytes) > limits_.expanded_bytes)
      throw ConfigError("", name_ + ": more than " + std::to_string(limits_.expanded_bytes >> 20) +
                                " MiB of text once aliases are expanded; a configuration is never that large");
  }

  ConfigError too_deep(const yaml_mark_t& mark) const {
    const std::string path = !stack_.empty() && stack_.front().value.is_object() ? stack_.front().key : "";
    return ConfigError(path, "values nested more than " + std::to_string(limits_.depth) +
                                 " levels deep; a configuration is never that deep" + at(mark));
  }

  // libyaml's verdict, with its line and column (a decoding error: from its byte offset).
  ConfigError parse_error() const {
    std::string what = parser_.problem ? parser_.problem : "unknown error";
    if (parser_.context) what = std::string(parser_.context) + ": " + what;
    switch (parser_.error) {
      case YAML_MEMORY_ERROR: return ConfigError("", name_ + ": the YAML parser ran out of memory");
      case YAML_READER_ERROR: {
        std::size_t l = 1, c = 1;
        for (std::size_t i = 0; i < parser_.problem_offset && i < text_.size(); ++i) {
          if (text_[i] == '\n') ++l, c = 1;
          else if ((static_cast<unsigned char>(text_[i]) & 0xC0) != 0x80) ++c;
        }
        return ConfigError::at(name_, static_cast<std::int64_t>(l), static_cast<std::int64_t>(c),
                               "invalid YAML: " + what + " (a configuration is UTF-8 text)");
      }
      default: return ConfigError::at(name_, line(parser_.problem_mark), column(parser_.problem_mark), "invalid YAML: " + what);
    }
  }

  static std::string anchor_name(const yaml_char_t* a) { return reinterpret_cast<const char*>(a); }
  static std::int64_t line(const yaml_mark_t& m) { return static_cast<std::int64_t>(m.line) + 1; }
  static std::int64_t column(const yaml_mark_t& m) { return static_cast<std::int64_t>(m.column) + 1; }
  std::string at(const yaml_mark_t& m) const {
    return " (" + name_ + ":" + std::to_string(line(m)) + ":" + std::to_string(column(m)) + ")";
  }

  const std::string& text_;
  std::string name_;
  YamlLimits limits_;
  yaml_parser_t parser_{};
  std::vector<Open> stack_;
  std::map<std::string, Anchored> anchors_;
  std::set<std::string> open_anchors_;
  nlohmann::json root_;
  std::size_t values_ = 0, bytes_ = 0, documents_ = 0;
};

/// YAML text to the JSON tree Config checks.
inline nlohmann::json parse_yaml_text(const std::string& text, const std::string& name) {
  return YamlReader(text, name).read();
}

/// Makes Config read YAML in every translation unit of the program once this header is in one.
inline const bool yaml_parser_registered = (yaml_parser() = &parse_yaml_text, true);

}  // namespace detail
}  // namespace trainkit
