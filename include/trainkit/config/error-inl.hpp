#pragma once
/// The definitions of trainkit/config/error.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/config/error.hpp>

namespace trainkit {

TRAINKIT_INLINE ConfigError ConfigError::at(const std::string& file, std::int64_t line, std::int64_t column,
                                            const std::string& message) {
  ConfigError e("", file + ":" + std::to_string(line) + ":" + std::to_string(column) + ": " +
                        message);
  e.line_ = line;
  e.column_ = column;
  return e;
}

TRAINKIT_INLINE std::string ConfigError::printable(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f) {
      static const char hex[] = "0123456789abcdef";
      out += "\\u00";
      out += hex[u >> 4];
      out += hex[u & 15];
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace trainkit
