#pragma once
/// The definitions of trainkit/config/text.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/config/text.hpp>

namespace trainkit {
namespace detail {

TRAINKIT_INLINE std::string join_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

TRAINKIT_INLINE std::string index_path(const std::string& parent, std::size_t i) {
  return parent + "[" + std::to_string(i) + "]";
}

TRAINKIT_INLINE std::string dump_text(const nlohmann::json& v, int indent) {
  return v.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

TRAINKIT_INLINE bool valid_utf8(const std::string& s) {
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

TRAINKIT_INLINE std::string describe_value(const nlohmann::json& v) {
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

TRAINKIT_INLINE std::string format_number(double x) {
  if (std::isfinite(x) && std::floor(x) == x && std::fabs(x) < 1e15) return std::to_string(static_cast<long long>(x));
  return nlohmann::json(x).dump();
}

TRAINKIT_INLINE std::string format_numbers(const std::vector<double>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + format_number(v[i]);
  return s + "]";
}

TRAINKIT_INLINE std::size_t edit_distance(const std::string& a, const std::string& b) {
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

TRAINKIT_INLINE std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

TRAINKIT_INLINE std::optional<std::string> nearest(const std::string& word,
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

TRAINKIT_INLINE bool all_digits(const std::string& s, std::size_t from, int base) {
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

TRAINKIT_INLINE bool is_core_float(const std::string& s) {
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

TRAINKIT_INLINE nlohmann::json resolve_plain_scalar(const std::string& s) {
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

}  // namespace detail
}  // namespace trainkit
