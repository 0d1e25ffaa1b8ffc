#pragma once
/// ConfigError: what every configuration error is, with the key path it names.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace trainkit {

/// A configuration that cannot be used. `path()` is the key ("TRAIN.LR", "TRAIN.BATCH_IMAGES[1]";
/// empty for file-level errors), `what()` is "KEY.PATH: what is wrong and what would be right",
/// or "FILE:LINE:COLUMN: ..." for syntax errors (line() and column() are then >= 1).
/// Control characters of a key or value quoted in the message (a file's bytes) are escaped as
/// \u00XX: a message never moves the terminal's cursor or changes its colours.
class ConfigError : public std::runtime_error {
 public:
  ConfigError(std::string path, const std::string& message)
      : std::runtime_error(printable(path.empty() ? message : path + ": " + message)),
        path_(std::move(path)),
        message_(printable(message)) {}
  /// A file-level error at a position of `file` (line and column from 1).
  static ConfigError at(const std::string& file, std::int64_t line, std::int64_t column, const std::string& message);
  const std::string& path() const noexcept { return path_; }
  /// The message without the path.
  const std::string& message() const noexcept { return message_; }
  std::int64_t line() const noexcept { return line_; }
  std::int64_t column() const noexcept { return column_; }

  /// `text` with its control characters but newlines and tabs written as \u00XX.
  static std::string printable(const std::string& text);

 private:
  std::string path_;
  std::string message_;
  std::int64_t line_ = 0;
  std::int64_t column_ = 0;
};

inline ConfigError ConfigError::at(const std::string& file, std::int64_t line, std::int64_t column,
                                   const std::string& message) {
  ConfigError e("", file + ":" + std::to_string(line) + ":" + std::to_string(column) + ": " +
                        message);
  e.line_ = line;
  e.column_ = column;
  return e;
}

inline std::string ConfigError::printable(const std::string& text) {
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
