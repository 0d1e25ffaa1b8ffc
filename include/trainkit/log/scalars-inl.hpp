#pragma once
/// The definitions of trainkit/log/scalars.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/log/scalars.hpp>

namespace trainkit {

TRAINKIT_INLINE void ScalarSink::add_scalar(std::string_view tag, double value, std::int64_t step) {
  record(tag, value, step, detail::unix_time_now());
}

TRAINKIT_INLINE void ScalarSink::add_scalar(std::string_view tag, double value, std::int64_t step, double wall_time) {
  record(tag, value, step, wall_time);
}

TRAINKIT_INLINE void ScalarRecorder::record(std::string_view tag, double value, std::int64_t step, double wall_time) {
  scalars_.push_back({std::string(tag), value, step, wall_time});
}

}  // namespace trainkit
namespace trainkit {
namespace detail {

TRAINKIT_INLINE std::string format_double(double value, const char* const (&nan_inf)[3]) {
  if (std::isnan(value)) return nan_inf[0];
  if (std::isinf(value)) return nan_inf[value > 0 ? 1 : 2];
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

TRAINKIT_INLINE std::string format_wall_time(double wall_time) {
  char text[40];
  std::snprintf(text, sizeof text, "%.6f", wall_time);
  return text;
}

TRAINKIT_INLINE void TextScalarLog::record(std::string_view tag, double value, std::int64_t step, double wall_time) {
  file_.append(line(tag, value, step, wall_time));
  file_.end_record();
}

TRAINKIT_INLINE LogFile TextScalarLog::open(const std::string& path, const TextLogOptions& options,
                                            const std::string& what, std::string_view header) {
  const auto slash = path.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    make_directories(path.substr(0, slash), what + " '" + path + "'");
  }
  const int fd = open_for_writing(path, O_CREAT | (options.append ? O_APPEND : O_TRUNC));
  if (fd < 0) throw_file_error("open", what, path, errno);
  struct stat st {};
  const bool fresh = ::fstat(fd, &st) == 0 && st.st_size == 0;
  LogFile file(fd, path, what, options.flush.every_records, options.flush.every_seconds);
  if (fresh) file.append(header);
  return file;
}

}  // namespace detail
}  // namespace trainkit
namespace trainkit {

TRAINKIT_INLINE std::string CsvScalarWriter::line(std::string_view tag, double value, std::int64_t step,
                                                  double wall_time) const {
  static const char* const nan_inf[3] = {"nan", "inf", "-inf"};
  std::string text = std::to_string(step) + ',';
  if (tag.find_first_of(",\"\r\n") == std::string_view::npos) {
    text += tag;
  } else {
    text += '"';
    for (const char c : tag) text += c == '"' ? std::string("\"\"") : std::string(1, c);
    text += '"';
  }
  return text + ',' + detail::format_double(value, nan_inf) + ',' +
         detail::format_wall_time(wall_time) + '\n';
}

TRAINKIT_INLINE std::string JsonlScalarWriter::line(std::string_view tag, double value, std::int64_t step,
                                                    double wall_time) const {
  static const char* const nan_inf[3] = {"\"NaN\"", "\"Infinity\"", "\"-Infinity\""};
  std::string text = "{\"step\":" + std::to_string(step) + ",\"tag\":\"";
  for (const char c : tag) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      text += '\\';
      text += c;
    } else if (u < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", u);
      text += escaped;
    } else {
      text += c;  // UTF-8 passes through
    }
  }
  return text + "\",\"value\":" + detail::format_double(value, nan_inf) +
         ",\"wall_time\":" + detail::format_wall_time(wall_time) + "}\n";
}

TRAINKIT_INLINE std::size_t drop_points_after(const std::string& path, std::int64_t last_step) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return 0;
    detail::throw_file_error("open", "scalar log", path, errno);
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  std::string text;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) detail::throw_file_error("read", "scalar log", path, errno);
    if (n == 0) break;
    text.append(buffer, static_cast<std::size_t>(n));
  }
  // The step a line starts with: `{"step":N,` (JSON lines) or `N,` (CSV); none for other lines.
  const auto step_of = [](std::string_view line) -> std::optional<std::int64_t> {
    constexpr std::string_view json_head = "{\"step\":";
    if (line.substr(0, json_head.size()) == json_head) line.remove_prefix(json_head.size());
    std::int64_t step = 0;
    const auto [end, error] = std::from_chars(line.data(), line.data() + line.size(), step);
    if (error != std::errc() || end == line.data() + line.size() || *end != ',') return std::nullopt;
    return step;
  };
  // The start of the line that ends at text[end - 1] (its newline, or the torn end).
  const auto line_start = [&](std::size_t end) {
    const std::size_t newline = end < 2 ? std::string::npos : text.rfind('\n', end - 2);
    return newline == std::string::npos ? 0 : newline + 1;
  };
  std::size_t keep = text.size(), dropped = 0;
  if (keep > 0 && text[keep - 1] != '\n') keep = line_start(keep + 1), ++dropped;  // a torn last line
  while (keep > 0) {
    const std::size_t start = line_start(keep);
    const auto step = step_of(std::string_view(text).substr(start, keep - 1 - start));
    if (!step || *step <= last_step) break;
    keep = start;
    ++dropped;
  }
  if (keep < text.size() && ::ftruncate(fd, static_cast<off_t>(keep)) != 0)
    detail::throw_file_error("truncate", "scalar log", path, errno);
  return dropped;
}

TRAINKIT_INLINE ScalarSink& ScalarFanout::add(std::unique_ptr<ScalarSink> sink) {
  sinks_.push_back(std::move(sink));
  return *sinks_.back();
}

TRAINKIT_INLINE void ScalarFanout::flush() {
  for_each([](ScalarSink& s) { s.flush(); });
}

TRAINKIT_INLINE void ScalarFanout::close() {
  for_each([](ScalarSink& s) { s.close(); });
}

TRAINKIT_INLINE void ScalarFanout::record(std::string_view tag, double value, std::int64_t step, double wall_time) {
  for_each([&](ScalarSink& s) { s.add_scalar(tag, value, step, wall_time); });
}

}  // namespace trainkit
