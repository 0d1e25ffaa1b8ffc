#pragma once
/// The definitions of trainkit/config/config.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/config/config.hpp>

namespace trainkit {

TRAINKIT_INLINE Config& Config::register_section(const std::string& name, Schema schema) {
  return register_section(name, Field::section(std::move(schema)));
}

TRAINKIT_INLINE Config& Config::register_section(const std::string& name, Field field) {
  if (name == "TRAIN" || (root_.has(name) && !registered_.count(name)))
    throw std::invalid_argument("trainkit::Config::register_section: " + name + " is owned by the toolkit");
  root_.add(name, std::move(field));
  registered_.insert(name);
  resolve();
  return *this;
}

TRAINKIT_INLINE Config& Config::strict_sections(bool strict) {
  strict_ = strict;
  resolve();
  return *this;
}

TRAINKIT_INLINE void Config::load(const std::string& path, const std::vector<std::string>& overrides) {
  guarded(path, [&] {
    const Format format = format_of(path);
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) throw ConfigError("", path + ": is a directory, not a configuration file");
    const auto bytes = std::filesystem::file_size(path, ec);
    if (!ec) check_size(bytes, path);
    std::ifstream in(path, std::ios::binary);
    if (!in) throw ConfigError("", path + ": cannot open the file (does it exist, and is it readable?)");
    std::string text;
    text.resize(kMaxConfigBytes + 1);  // at most the bound and one byte: a file that grew is caught too
    in.read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<std::size_t>(in.gcount()));
    load_string(text, format, overrides, path);
  });
}

TRAINKIT_INLINE void Config::load_string(const std::string& text, Format format,
                                         const std::vector<std::string>& overrides, const std::string& name) {
  guarded(name, [&] { load_checked(text, format, overrides, name); });
}

TRAINKIT_INLINE void Config::set(const std::string& assignment) {
  guarded("--set " + assignment, [&] {
    Config next(*this);
    next.overrides_.push_back(parse_override(assignment));
    next.resolve();
    *this = std::move(next);
  });
}

TRAINKIT_INLINE void Config::check_size(std::uintmax_t bytes, const std::string& name) {
  if (bytes > kMaxConfigBytes)
    throw ConfigError("", name + ": " + std::to_string(bytes) + " bytes; a configuration is at most " +
                              std::to_string(kMaxConfigBytes >> 20) + " MiB (Config::kMaxConfigBytes), and never comes near it");
}

TRAINKIT_INLINE void Config::load_checked(const std::string& text, Format format,
                                          const std::vector<std::string>& overrides, const std::string& name) {
  check_size(text.size(), name);
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

TRAINKIT_INLINE Config::Format Config::format_of(const std::string& path) {
  const auto dot = path.find_last_of('.');
  const std::string ext = dot == std::string::npos ? "" : detail::upper(path.substr(dot + 1));
  if (ext == "JSON") return Format::json;
  if (ext == "YAML" || ext == "YML") return Format::yaml;
  throw ConfigError("", path + ": unknown configuration format; name the file *.json, *.yaml or *.yml");
}

TRAINKIT_INLINE const nlohmann::json* Config::find(const nlohmann::json& root, const std::string& dotted) {
  const nlohmann::json* node = &root;
  std::size_t from = 0;
  while (true) {
    const auto dot = dotted.find('.', from);
    const std::string key = dotted.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
    if (!node->is_object() || !node->contains(key)) return nullptr;
    node = &(*node)[key];
    if (dot == std::string::npos) return node;
    from = dot + 1;
  }
}

TRAINKIT_INLINE const nlohmann::json& Config::at(const std::string& dotted) const {
  if (const nlohmann::json* node = find(tree_, dotted)) return *node;
  throw ConfigError(dotted, "no such key in the resolved configuration");
}

TRAINKIT_INLINE bool Config::given(const std::string& dotted) const {
  const nlohmann::json* node = find(given_, dotted);
  return node != nullptr && !node->is_null();
}

TRAINKIT_INLINE nlohmann::json Config::parse_text(const std::string& text, Format format, const std::string& name) {
  if (format == Format::json) return detail::parse_json_text(text, name);
  const detail::YamlParser parser = detail::yaml_parser();
  if (!parser)
    throw ConfigError("", name + ": YAML support is not built in; #include <trainkit/config/yaml.hpp> and link "
                                 "libyaml (CMake: target_link_libraries(<target> PRIVATE trainkit::yaml)), "
                                 "or use the JSON form of this file");
  return parser(text, name);
}

TRAINKIT_INLINE Config::Override Config::parse_override(const std::string& text) {
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
    } else if (value.empty()) {  // TRAIN.KEY= : the empty string, as a shell user means it
      o.value = std::string();
    } else {
      o.value = detail::resolve_plain_scalar(value);
    }
  } catch (const ConfigError& e) {
    throw ConfigError("", where + ": the value is not a valid YAML or JSON value (" + e.what() + ")");
  }
  return o;
}

TRAINKIT_INLINE void Config::apply(nlohmann::json& tree, const Override& o) {
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

TRAINKIT_INLINE void Config::resolve() {
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

TRAINKIT_INLINE void Config::resolve_tree(const nlohmann::json& given) {
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
  given_ = given;
  tree_ = std::move(tree);
  unvalidated_ = std::move(unvalidated);
  notes_ = std::move(notes);
}

}  // namespace trainkit
