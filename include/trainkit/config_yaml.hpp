#pragma once
/// YAML configuration files for trainkit::Config (optional part: needs yaml-cpp; CMake target
/// trainkit::yaml). Including this header anywhere in a program lets Config::load() read
/// .yaml/.yml files and `--set` take YAML flow values ([8, 8], {a: 1}).
///
/// YAML is read into the same JSON tree as the JSON form of the file, with YAML 1.2 core-schema
/// typing of unquoted scalars: `1e-7` and `6.25e-7` are numbers (PyYAML, YAML 1.1, would read
/// `1e-7` as a string), `8` an integer, `true`/`false` booleans, `~`/`null`/empty null; quoted
/// scalars ('dynamic', "0,1") are always strings. Syntax errors carry line and column,
/// duplicate keys their path.
#include <trainkit/config.hpp>

#include <yaml-cpp/yaml.h>
#if __has_include(<yaml-cpp/depthguard.h>)
#include <yaml-cpp/depthguard.h>  // YAML::DeepRecursion (yaml-cpp >= 0.7)
#define TRAINKIT_YAML_HAS_DEPTH_GUARD 1
#endif

#include <string>
#include <vector>

namespace trainkit {
namespace detail {

class YamlToJson {
 public:
  static constexpr std::size_t max_depth = 64;
  // Aliases can multiply a small file: a bound on the values and on the text once expanded.
  static constexpr std::size_t max_values = 1000000;
  static constexpr std::size_t max_bytes = std::size_t{64} << 20;

  explicit YamlToJson(std::string name) : name_(std::move(name)) {}

  nlohmann::json convert(const YAML::Node& node, const std::string& path, std::size_t depth) {
    if (depth > max_depth)
      throw ConfigError("", name_ + ": values nested more than " + std::to_string(max_depth) + " levels deep under " +
                                path.substr(0, path.find_first_of(".[")) +
                                " (a recursive alias?); a configuration is never that deep");
    if (++values_ > max_values)
      throw ConfigError("", name_ + ": more than " + std::to_string(max_values) +
                                " values once aliases are expanded; a configuration is never that large");
    switch (node.Type()) {
      case YAML::NodeType::Undefined:
      case YAML::NodeType::Null: return nullptr;
      case YAML::NodeType::Scalar: return scalar(node, path);
      case YAML::NodeType::Sequence: {
        nlohmann::json out = nlohmann::json::array();
        std::size_t i = 0;
        for (const auto& item : node) out.push_back(convert(item, index_path(path, i++), depth + 1));
        return out;
      }
      case YAML::NodeType::Map: {
        nlohmann::json out = nlohmann::json::object();
        for (const auto& kv : node) {
          if (!kv.first.IsScalar())
            throw ConfigError(path, "a key must be a plain name, got a " +
                                        std::string(kv.first.IsSequence() ? "list" : "mapping") + " as a key" +
                                        at(kv.first));
          const std::string key = kv.first.Scalar();
          count_bytes(key.size());
          if (!valid_utf8(key)) throw ConfigError(path, "a key is not valid UTF-8 text" + at(kv.first));
          const std::string key_path = join_path(path, key);
          if (out.contains(key)) throw ConfigError(key_path, "duplicate key (the file sets it twice; keep one)" + at(kv.first));
          out[key] = convert(kv.second, key_path, depth + 1);
        }
        return out;
      }
    }
    return nullptr;
  }

 private:
  std::string at(const YAML::Node& node) const {
    const YAML::Mark m = node.Mark();
    if (m.is_null()) return "";
    return " (" + name_ + ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1) + ")";
  }

  void count_bytes(std::size_t n) {
    if ((bytes_ += n) > max_bytes)
      throw ConfigError("", name_ + ": more than " + std::to_string(max_bytes >> 20) +
                                " MiB of text once aliases are expanded; a configuration is never that large");
  }

  nlohmann::json scalar(const YAML::Node& node, const std::string& path) {
    const std::string& text = node.Scalar();
    count_bytes(text.size());
    if (!valid_utf8(text)) throw ConfigError(path, "the value is not valid UTF-8 text" + at(node));
    const std::string& tag = node.Tag();
    if (tag == "?") return resolve_plain_scalar(text);  // plain: typed by the core schema
    if (tag == "!" || tag == "tag:yaml.org,2002:str") return text;  // quoted or block: a string
    const nlohmann::json v = resolve_plain_scalar(text);
    auto require = [&](bool ok, const char* what) {
      if (!ok) throw ConfigError(path, "the tag " + tag + " needs " + what + ", got " + describe_value(nlohmann::json(text)) + at(node));
      return v;
    };
    if (tag == "tag:yaml.org,2002:int") return require(v.is_number_integer(), "an integer");
    if (tag == "tag:yaml.org,2002:float") return require(v.is_number(), "a number").get<double>();
    if (tag == "tag:yaml.org,2002:bool") return require(v.is_boolean(), "true or false");
    if (tag == "tag:yaml.org,2002:null") return require(v.is_null(), "an empty value");
    throw ConfigError(path, "unsupported YAML tag " + tag + "; write the value without a tag" + at(node));
  }

  std::string name_;
  std::size_t values_ = 0, bytes_ = 0;
};

/// YAML text to the JSON tree Config checks.
inline nlohmann::json parse_yaml_text(const std::string& text, const std::string& name) {
  YAML::Node node;
  try {
    // One document: a second one (after `---`) would be dropped without a word by YAML::Load.
    const std::vector<YAML::Node> documents = YAML::LoadAll(text);
    if (documents.size() > 1) {
      const YAML::Mark at = documents[1].Mark();
      const std::string what = "a second YAML document (after '---'); a configuration file holds one document: merge them, "
                               "or pass the second with --set";
      if (at.is_null()) throw ConfigError("", name + ": " + what);
      throw ConfigError::at(name, at.line + 1, at.column + 1, what);
    }
    if (!documents.empty()) node = documents[0];
#if defined(TRAINKIT_YAML_HAS_DEPTH_GUARD)
  } catch (const YAML::DeepRecursion& e) {  // its own message says "bad file"
    throw ConfigError::at(name, e.mark.line + 1, e.mark.column + 1,
                          "invalid YAML: values nested too deeply for a configuration");
#endif
  } catch (const YAML::ParserException& e) {
    throw ConfigError::at(name, e.mark.line + 1, e.mark.column + 1, "invalid YAML: " + e.msg);
  } catch (const YAML::Exception& e) {
    // Other parser verdicts, with their position when known.
    if (!e.mark.is_null()) throw ConfigError::at(name, e.mark.line + 1, e.mark.column + 1, "invalid YAML: " + e.msg);
    throw ConfigError("", name + ": invalid YAML: " + e.msg);
  }
  return YamlToJson(name).convert(node, "", 0);
}

/// Makes Config read YAML in every translation unit of the program once this header is in one.
inline const bool yaml_parser_registered = (yaml_parser() = &parse_yaml_text, true);

}  // namespace detail
}  // namespace trainkit
