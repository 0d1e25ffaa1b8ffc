#pragma once
/// Text utilities of the configuration code: key paths, values as messages name them, numbers
/// as messages print them, nearest-key suggestions, and YAML 1.2 core-schema plain scalars
/// (also how `--set` values are read).
#include <trainkit/detail/inline.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace trainkit {
namespace detail {

std::string join_path(const std::string& parent, const std::string& key);
std::string index_path(const std::string& parent, std::size_t i);

/// JSON text of `v` for messages and output; bytes that are not UTF-8 print as U+FFFD instead
/// of throwing (the loaders reject such strings, so this is only a safety net).
std::string dump_text(const nlohmann::json& v, int indent = -1);

/// True when `s` is well-formed UTF-8 (what JSON, YAML and every message require).
bool valid_utf8(const std::string& s);

/// A value as a message names it: `the string "fast"`, `the integer 3`, `a list of 2 values`.
std::string describe_value(const nlohmann::json& v);

/// A number as messages print it: integral values without a fraction (128, 1), others in
/// the shortest form that reads back the same (0.1, 1e-07).
std::string format_number(double x);
std::string format_numbers(const std::vector<double>& v);

/// Optimal-string-alignment distance (Levenshtein plus adjacent transpositions), so that
/// TRIAN and TRAIN are 1 apart.
std::size_t edit_distance(const std::string& a, const std::string& b);

std::string upper(std::string s);

/// The candidate nearest to `word`, if it is near enough to be a plausible misspelling: a
/// case-insensitive match always is; otherwise at most max(1, length/4) edits away (two for
/// GRAD_ACCULATE_STEPS -> GRAD_ACCUMULATE_STEPS).
std::optional<std::string> nearest(const std::string& word, const std::vector<std::string>& candidates);

bool all_digits(const std::string& s, std::size_t from, int base);

/// [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?  (YAML 1.2 core schema float)
bool is_core_float(const std::string& s);

/// The value of an unquoted scalar under the YAML 1.2 core schema, which is also how `--set`
/// values are read: `1e-7` and `2.5` are numbers, `8` an integer, `true`/`false` booleans,
/// `~`/`null`/empty null, anything else (`dynamic`, `0,1`, `yes`) a string.
nlohmann::json resolve_plain_scalar(const std::string& s);

}  // namespace detail
}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/config/text-inl.hpp>
#endif
