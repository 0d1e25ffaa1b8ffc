#pragma once
/// BERT's tokenizer in C++: the basic tokenizer, then greedy longest-match-first WordPiece over a
/// BERT directory's vocab.txt. The same ids as Hugging Face's BertTokenizer / tokenizers'
/// BertNormalizer + BertPreTokenizer + WordPiece (tests/bert/check_bert.py compares them).
///
///   const auto tok = vlbert::BertTokenizer::from_directory("model/");   // vocab.txt, tokenizer_config.json
///   tok.tokenize("Héllo, world!")   // {"hello", ",", "world", "!"}
///   tok.encode("unaffable")         // ids of {"una", "##ffa", "##ble"} (no [CLS]/[SEP])
///
/// The basic tokenizer, in BERT's order:
///   1. clean-up: NUL, U+FFFD and control characters (category C*, except tab, newline, return)
///      are dropped; whitespace (space, tab, newline, return, category Zs) becomes a space;
///   2. CJK ideographs get a space on each side (each is its own word);
///   3. uncased models (do_lower_case): lower-cased and accents stripped (NFD, non-spacing marks
///      dropped); Hangul syllables decompose into their jamo, as NFD does;
///   4. split at whitespace, and every punctuation character (category P*, and ASCII's symbols
///      such as $ + < = > ^ ` | ~) is a word of its own.
/// WordPiece: a word longer than 100 characters, or one that no sequence of vocabulary pieces
/// spells (continuations prefixed "##"), is [UNK]. The special tokens ([CLS], [SEP], [MASK],
/// [PAD], [UNK]) written in the text are kept whole, as Hugging Face's tokenizers does.
/// Bytes that are not UTF-8 count as U+FFFD (dropped). The character tables
/// (bert_unicode.hpp) come from Python's unicodedata: tools/unicode/make_bert_tables.py.
#include "bert_unicode.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace vlbert {

namespace unicode {

/// BERT's class of a code point (kBertClasses; Other where no range holds it).
inline Class class_of(char32_t c) {
  const auto it = std::upper_bound(std::begin(kBertClasses), std::end(kBertClasses), c,
                                   [](char32_t v, const ClassRange& r) { return v < r.first; });
  if (it == std::begin(kBertClasses)) return Class::Other;
  const ClassRange& r = *(it - 1);
  return c <= r.last ? r.cls : Class::Other;
}

/// BERT's CJK ideograph blocks (its _is_chinese_char).
inline bool is_cjk(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B820 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

/// Appends what an uncased model reads for `c`: lower-cased, decomposed, without its
/// non-spacing marks (kBertFold; Hangul syllables by Unicode's algorithm).
inline void append_folded(char32_t c, std::u32string& out) {
  if (c >= 0xAC00 && c <= 0xD7A3) {  // Hangul: L V (T)
    const char32_t s = c - 0xAC00;
    out.push_back(0x1100 + s / 588);
    out.push_back(0x1161 + (s % 588) / 28);
    if (s % 28 != 0) out.push_back(0x11A7 + s % 28);
    return;
  }
  const auto it = std::upper_bound(std::begin(kBertFold), std::end(kBertFold), c,
                                   [](char32_t v, const FoldRange& r) { return v < r.first; });
  if (it == std::begin(kBertFold) || c > (it - 1)->last) {
    out.push_back(c);
    return;
  }
  const FoldRange& r = *(it - 1);
  switch (r.kind) {
    case Fold::Delta: out.push_back(static_cast<char32_t>(static_cast<std::int64_t>(c) + r.value)); break;
    case Fold::Remove: break;
    case Fold::Pool: out.append(kBertFoldPool + r.value, r.length); break;
  }
}

/// UTF-8 to code points; a byte that does not start a well-formed sequence is U+FFFD.
inline std::u32string decode_utf8(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const int n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
    char32_t c = n == 1 ? b : n == 2 ? (b & 0x1F) : n == 3 ? (b & 0x0F) : (b & 0x07);
    bool ok = n > 0 && i + static_cast<std::size_t>(n) <= s.size();
    for (int k = 1; ok && k < n; ++k) {
      const auto cb = static_cast<unsigned char>(s[i + static_cast<std::size_t>(k)]);
      ok = (cb & 0xC0) == 0x80;
      c = (c << 6) | (cb & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8 either.
    ok = ok && !(n == 2 && c < 0x80) && !(n == 3 && c < 0x800) && !(n == 4 && (c < 0x10000 || c > 0x10FFFF)) &&
         !(c >= 0xD800 && c <= 0xDFFF);
    out.push_back(ok ? c : 0xFFFD);
    i += ok ? static_cast<std::size_t>(n) : 1;
  }
  return out;
}

inline void append_utf8(char32_t c, std::string& out) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

inline std::string encode_utf8(const std::u32string& s) {
  std::string out;
  out.reserve(s.size());
  for (const char32_t c : s) append_utf8(c, out);
  return out;
}

}  // namespace unicode

/// BERT's tokenizer options (tokenizer_config.json's keys).
struct TokenizerOptions {
  bool lower_case = true;           // do_lower_case
  bool strip_accents = true;        // strip_accents (null in the file: as do_lower_case)
  bool chinese_chars = true;        // tokenize_chinese_chars
  std::size_t max_chars_per_word = 100;
};

class BertTokenizer {
 public:
  /// A vocabulary, one token per line (vocab.txt); a token's id is its line number from 0.
  BertTokenizer(std::vector<std::string> vocab, TokenizerOptions options, std::string source = "vocabulary")
      : vocab_(std::move(vocab)), options_(options), source_(std::move(source)) {
    for (std::size_t i = 0; i < vocab_.size(); ++i) index_.emplace(vocab_[i], static_cast<std::int64_t>(i));
    for (const char* s : {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}) {
      if (!index_.count(s)) throw std::runtime_error(source_ + ": no " + s + " token: not a BERT vocabulary");
      specials_.emplace_back(s);
    }
    // The tables hold one folding, an uncased model's (lower-case and strip accents) and a cased
    // model does neither: the other two mixes of the options are refused, not approximated.
    if (options_.lower_case != options_.strip_accents)
      throw std::invalid_argument(source_ + ": do_lower_case " + (options_.lower_case ? "true" : "false") + " with strip_accents " +
                                  (options_.strip_accents ? "true" : "false") +
                                  " is not supported (uncased models: both true; cased: both false)");
  }

  /// `dir`/vocab.txt, with `dir`/tokenizer_config.json's options where the file is there (else
  /// an uncased model's, BERT's defaults).
  static BertTokenizer from_directory(const std::string& dir) {
    const std::string path = dir + "/vocab.txt";
    std::ifstream in(path);
    if (!in) throw std::runtime_error("BERT directory '" + dir + "': cannot open " + path);
    std::vector<std::string> vocab;
    for (std::string line; std::getline(in, line);) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      vocab.push_back(line);
    }
    TokenizerOptions o;
    const std::string config = dir + "/tokenizer_config.json";
    if (std::ifstream c{config}) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(c);
        if (j.contains("do_lower_case")) o.lower_case = j["do_lower_case"].get<bool>();
        o.strip_accents = j.contains("strip_accents") && !j["strip_accents"].is_null() ? j["strip_accents"].get<bool>() : o.lower_case;
        if (j.contains("tokenize_chinese_chars")) o.chinese_chars = j["tokenize_chinese_chars"].get<bool>();
      } catch (const nlohmann::json::exception& e) {
        throw std::runtime_error(config + ": " + e.what());
      }
    }
    return BertTokenizer(std::move(vocab), o, path);
  }

  /// BERT's basic tokens of `text` (before WordPiece).
  std::vector<std::string> basic(std::string_view text) const {
    std::vector<std::string> words;
    std::u32string word;
    auto end_word = [&] {
      if (!word.empty()) words.push_back(unicode::encode_utf8(word));
      word.clear();
    };
    for (const char32_t c : unicode::decode_utf8(text)) {
      if (c == 0 || c == 0xFFFD) continue;
      const unicode::Class k = unicode::class_of(c);
      if (k == unicode::Class::Control) continue;
      if (k == unicode::Class::Space) {
        end_word();
        continue;
      }
      if (options_.chinese_chars && unicode::is_cjk(c)) {
        end_word();
        word.push_back(c);
        end_word();
        continue;
      }
      std::u32string folded;
      if (options_.lower_case) unicode::append_folded(c, folded);  // (lower_case == strip_accents: the constructor)
      else folded.push_back(c);
      for (const char32_t f : folded) {
        if (unicode::class_of(f) == unicode::Class::Punctuation) {
          end_word();
          word.push_back(f);
          end_word();
        } else {
          word.push_back(f);
        }
      }
    }
    end_word();
    return words;
  }

  /// WordPiece: greedy longest match first, continuations prefixed "##"; [UNK] for a word that
  /// cannot be spelled or is longer than max_chars_per_word characters.
  std::vector<std::string> wordpiece(const std::string& word) const {
    const std::u32string chars = unicode::decode_utf8(word);
    if (chars.size() > options_.max_chars_per_word) return {"[UNK]"};
    std::vector<std::string> pieces;
    for (std::size_t start = 0; start < chars.size();) {
      std::size_t end = chars.size();
      std::string found;
      for (; end > start; --end) {
        std::string piece = (start > 0 ? "##" : "") + unicode::encode_utf8(chars.substr(start, end - start));
        if (index_.count(piece)) {
          found = std::move(piece);
          break;
        }
      }
      if (found.empty()) return {"[UNK]"};
      pieces.push_back(std::move(found));
      start = end;
    }
    return pieces;
  }

  /// The tokens of `text`: basic tokens, each as WordPiece spells it; special tokens written in
  /// the text ("[MASK]") kept whole.
  std::vector<std::string> tokenize(std::string_view text) const {
    std::vector<std::string> tokens;
    while (!text.empty()) {
      std::size_t at = std::string_view::npos, length = 0;
      for (const auto& s : specials_) {
        const auto p = text.find(s);
        if (p < at) at = p, length = s.size();
      }
      for (const auto& w : basic(text.substr(0, at))) {
        auto pieces = wordpiece(w);
        tokens.insert(tokens.end(), std::make_move_iterator(pieces.begin()), std::make_move_iterator(pieces.end()));
      }
      if (at == std::string_view::npos) break;
      tokens.emplace_back(text.substr(at, length));
      text.remove_prefix(at + length);
    }
    return tokens;
  }

  /// The ids of tokenize(text) (no [CLS]/[SEP]).
  std::vector<std::int64_t> encode(std::string_view text) const {
    std::vector<std::int64_t> ids;
    for (const auto& t : tokenize(text)) ids.push_back(id(t));
    return ids;
  }

  /// A token's id; throws naming the token and the vocabulary where it has none.
  std::int64_t id(const std::string& token) const {
    const auto it = index_.find(token);
    if (it == index_.end()) throw std::out_of_range(source_ + ": no token '" + token + "'");
    return it->second;
  }
  bool contains(const std::string& token) const { return index_.count(token) != 0; }
  const std::string& token(std::int64_t id) const { return vocab_.at(static_cast<std::size_t>(id)); }
  std::int64_t size() const { return static_cast<std::int64_t>(vocab_.size()); }
  const TokenizerOptions& options() const { return options_; }
  const std::string& source() const { return source_; }

 private:
  std::vector<std::string> vocab_;
  TokenizerOptions options_;
  std::string source_;
  std::unordered_map<std::string, std::int64_t> index_;
  std::vector<std::string> specials_;
};

}  // namespace vlbert
