#pragma once
/// Configuration text to a JSON tree: JSON through a SAX builder (duplicate keys are errors with
/// their path, syntax errors carry line and column), and the hook through which
/// <trainkit/config/yaml.hpp> registers its YAML parser.
#include <trainkit/detail/inline.hpp>
#include <trainkit/config/error.hpp>
#include <trainkit/config/text.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {
namespace detail {

/// Parses YAML text into JSON; registered by <trainkit/config/yaml.hpp>. A plain function
/// pointer in a function-local static: a capability of the program (is libyaml linked?), not
/// state of any Config.
using YamlParser = nlohmann::json (*)(const std::string& text, const std::string& name);
YamlParser& yaml_parser();

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
  TRAINKIT_INLINE bool number_unsigned(number_unsigned_t v) override;
  bool number_float(number_float_t v, const string_t&) override { return add(v); }
  bool string(string_t& v) override { return add(v); }
  bool binary(binary_t&) override { return add(nullptr); }
  bool start_object(std::size_t) override { return open(nlohmann::json::object()); }
  bool start_array(std::size_t) override { return open(nlohmann::json::array()); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  TRAINKIT_INLINE bool key(string_t& k) override;
  TRAINKIT_INLINE bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override;

 private:
  struct Frame {
    nlohmann::json* node;
    std::string key;  // objects: the key being read
  };
  // The path of key `last` of the innermost (object) frame: each frame sits in its parent at
  // the parent's current key, or at the parent's last index for arrays.
  std::string path_of(const std::string& last) const;
  nlohmann::json* place(nlohmann::json v);
  bool add(nlohmann::json v);
  bool open(nlohmann::json v);
  bool close();

  std::string name_;
  nlohmann::json root_;
  std::vector<Frame> frames_;
};

/// JSON text to a tree; syntax errors carry line and column, duplicate keys their path.
nlohmann::json parse_json_text(const std::string& text, const std::string& name);

}  // namespace detail
}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/config/json_reader-inl.hpp>
#endif
