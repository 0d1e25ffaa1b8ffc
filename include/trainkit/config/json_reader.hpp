#pragma once
/// Configuration text to a JSON tree: JSON through a SAX builder (duplicate keys are errors with
/// their path, syntax errors carry line and column), and the hook through which
/// <trainkit/config_yaml.hpp> registers its YAML parser.
#include <trainkit/config/error.hpp>
#include <trainkit/config/text.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {
namespace detail {

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
}  // namespace trainkit
