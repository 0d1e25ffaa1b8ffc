#pragma once
/// The definitions of trainkit/config/json_reader.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/config/json_reader.hpp>

namespace trainkit {
namespace detail {

TRAINKIT_INLINE YamlParser& yaml_parser() {
  static YamlParser parser = nullptr;
  return parser;
}

TRAINKIT_INLINE bool JsonTreeBuilder::number_unsigned(number_unsigned_t v) {
  if (v <= static_cast<number_unsigned_t>(std::numeric_limits<std::int64_t>::max()))
    return add(static_cast<std::int64_t>(v));
  return add(static_cast<double>(v));
}

TRAINKIT_INLINE bool JsonTreeBuilder::key(string_t& k) {
  Frame& f = frames_.back();
  if (f.node->contains(k)) throw ConfigError(path_of(k), "duplicate key (the file sets it twice; keep one)");
  f.key = k;
  return true;
}

TRAINKIT_INLINE bool JsonTreeBuilder::parse_error(std::size_t, const std::string&,
                                                  const nlohmann::detail::exception& ex) {
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

TRAINKIT_INLINE std::string JsonTreeBuilder::path_of(const std::string& last) const {
  std::string p;
  for (std::size_t i = 1; i < frames_.size(); ++i) {
    const Frame& parent = frames_[i - 1];
    p = parent.node->is_array() ? index_path(p, parent.node->size() - 1) : join_path(p, parent.key);
  }
  return join_path(p, last);
}

TRAINKIT_INLINE nlohmann::json* JsonTreeBuilder::place(nlohmann::json v) {
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

TRAINKIT_INLINE bool JsonTreeBuilder::add(nlohmann::json v) {
  place(std::move(v));
  return true;
}

TRAINKIT_INLINE bool JsonTreeBuilder::open(nlohmann::json v) {
  if (frames_.size() >= max_depth)
    throw ConfigError("", name_ + ": values nested more than " + std::to_string(max_depth) +
                              " levels deep; a configuration is never that deep");
  nlohmann::json* node = place(std::move(v));
  frames_.push_back({node, {}});
  return true;
}

TRAINKIT_INLINE bool JsonTreeBuilder::close() {
  frames_.pop_back();
  return true;
}

TRAINKIT_INLINE nlohmann::json parse_json_text(const std::string& text, const std::string& name) {
  JsonTreeBuilder builder(name);
  nlohmann::json::sax_parse(text, &builder, nlohmann::json::input_format_t::json, /*strict=*/true,
                            /*ignore_comments=*/false);
  return std::move(builder.result());
}

}  // namespace detail
}  // namespace trainkit
