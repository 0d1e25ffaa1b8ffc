#pragma once
/// The synthetic visual-linguistic data set of the VL-BERT example, generated in-process.
///
/// A scene holds 2..MAX_OBJECTS objects, each with a category (its shape), a colour, a size and a
/// position. What the model "sees" are region features: a noisy sum of one random prototype
/// vector per attribute value (a stand-in for a detector's RoI features), plus each region's box.
/// What it reads are words: a caption listing the objects from left to right (pre-training), or
/// a question whose answer follows from the scene (VQA). Questions refer to objects by words
/// and ask about what only the picture shows (which colour, is it left of, how many), so neither
/// the words alone nor the picture alone answer them.
///
/// Everything is a pure function of (seed, split, index): scene i of the training split is the
/// same in every run and on every rank, validation is a fixed, separate split, and the batch at
/// (epoch, index) is reproducible (its text masking is drawn from (seed, epoch, sample)).
#include "tokenizer.hpp"

#include <torch/types.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace vlbert {

// --- randomness: one counter-based stream per (seed, purpose, index) ------------------------

inline std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// A small generator with its own distributions (std's are implementation-defined), so a seed
/// gives the same data with every standard library.
class Rng {
 public:
  Rng(std::uint64_t seed, std::uint64_t stream, std::uint64_t index = 0)
      : state_(mix(mix(mix(seed) ^ stream) ^ index)) {}
  std::uint64_t next() { return state_ = mix(state_); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  int below(int n) { return static_cast<int>(uniform() * n); }
  bool chance(double p) { return uniform() < p; }
  double normal() {  // Box-Muller
    const double u = 1.0 - uniform(), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }

 private:
  std::uint64_t state_;
};

enum Stream : std::uint64_t { kPrototypes = 1, kTrainScenes, kValScenes, kQuestions, kMasks, kShuffle };

// --- words ---------------------------------------------------------------------------------

inline const std::array<const char*, 6> kColours = {"red", "green", "blue", "yellow", "purple", "orange"};
inline const std::array<const char*, 6> kShapes = {"circle", "square", "triangle", "star", "cross", "diamond"};
inline const std::array<const char*, 6> kShapesPlural = {"circles", "squares", "triangles", "stars", "crosses", "diamonds"};
inline const std::array<const char*, 2> kSizes = {"small", "large"};
inline const std::array<const char*, 7> kCounts = {"zero", "one", "two", "three", "four", "five", "six"};
inline constexpr int kMaxObjects = 6;  // counts are words up to "six"

/// The word vocabulary: special tokens first ([PAD] is 0), then every word the generator writes.
class Vocabulary {
 public:
  enum Special : std::int64_t { PAD = 0, CLS, SEP, MASK, IMG, END, kSpecials };
  Vocabulary() {
    for (const char* w : {"[PAD]", "[CLS]", "[SEP]", "[MASK]", "[IMG]", "[END]"}) add(w);
    for (auto* list : {&kColours, &kShapes, &kShapesPlural}) for (const char* w : *list) add(w);
    for (const char* w : kSizes) add(w);
    for (const char* w : kCounts) add(w);
    for (const char* w : {"a", "the", "is", "there", "what", "colour", "shape", "size", "how", "many",
                          "objects", "object", "are", "of", "left", "right", "leftmost", "rightmost",
                          "yes", "no", "?"})
      add(w);
  }
  std::int64_t operator()(const std::string& w) const {
    auto it = index_.find(w);
    if (it == index_.end()) throw std::logic_error("vlbert::Vocabulary: no word '" + w + "'");
    return it->second;
  }
  const std::string& word(std::int64_t id) const { return words_.at(static_cast<std::size_t>(id)); }
  std::int64_t size() const { return static_cast<std::int64_t>(words_.size()); }
  /// Every word, by id (the special tokens first).
  const std::vector<std::string>& words() const { return words_; }

 private:
  void add(const std::string& w) {
    index_.emplace(w, size());
    words_.push_back(w);
  }
  std::vector<std::string> words_;
  std::map<std::string, std::int64_t> index_;
};

/// How the data set writes its words as ids: the example's own Vocabulary (one id per word), or a
/// BERT tokenizer's WordPiece ids (NETWORK.BERT_MODEL_NAME: "leftmost" may be two pieces), with
/// its special tokens. Every word the generator writes is looked up once, up front.
class Lexicon {
 public:
  /// The built-in vocabulary.
  Lexicon() : cls_(Vocabulary::CLS), sep_(Vocabulary::SEP), mask_(Vocabulary::MASK), pad_(Vocabulary::PAD) {
    const Vocabulary v;
    for (std::int64_t id = Vocabulary::kSpecials; id < v.size(); ++id) {
      pieces_[v.word(id)] = {id};
      random_.push_back(id);
    }
  }
  /// A BERT tokenizer's ids; throws naming the vocabulary where it spells a generator's word as
  /// [UNK] (it could not learn it).
  explicit Lexicon(const BertTokenizer& t) : cls_(t.id("[CLS]")), sep_(t.id("[SEP]")), mask_(t.id("[MASK]")), pad_(t.id("[PAD]")) {
    const Vocabulary v;
    for (std::int64_t id = Vocabulary::kSpecials; id < v.size(); ++id) {
      const auto& word = v.word(id);
      auto ids = t.encode(word);
      if (std::find(ids.begin(), ids.end(), t.id("[UNK]")) != ids.end())
        throw std::runtime_error(t.source() + ": the data set's word '" + word + "' is [UNK] in this vocabulary");
      for (const auto i : ids)
        if (std::find(random_.begin(), random_.end(), i) == random_.end()) random_.push_back(i);
      pieces_[word] = std::move(ids);
    }
  }

  /// The ids of a word the generator writes.
  const std::vector<std::int64_t>& ids(const std::string& word) const {
    const auto it = pieces_.find(word);
    if (it == pieces_.end()) throw std::logic_error("vlbert::Lexicon: no word '" + word + "'");
    return it->second;
  }
  /// BERT's random replacement of a masked token: one of the data set's own pieces.
  std::int64_t random_token(Rng& rng) const { return random_[static_cast<std::size_t>(rng.below(static_cast<int>(random_.size())))]; }
  std::int64_t cls() const { return cls_; }
  std::int64_t sep() const { return sep_; }
  std::int64_t mask() const { return mask_; }
  std::int64_t pad() const { return pad_; }

 private:
  std::int64_t cls_, sep_, mask_, pad_;
  std::map<std::string, std::vector<std::int64_t>> pieces_;
  std::vector<std::int64_t> random_;  // in the vocabulary's order of the words
};

/// The answers of the VQA task (the classifier's classes): colours, shapes, sizes, yes/no, counts.
inline std::vector<std::string> answer_words() {
  std::vector<std::string> a(kColours.begin(), kColours.end());
  a.insert(a.end(), kShapes.begin(), kShapes.end());
  a.insert(a.end(), kSizes.begin(), kSizes.end());
  a.insert(a.end(), {"yes", "no"});
  a.insert(a.end(), kCounts.begin(), kCounts.end());
  return a;
}

// --- scenes --------------------------------------------------------------------------------

struct Object {
  int category, colour, size;
  float x, y;  // centre, in [0, 1]
  /// The box (x1, y1, x2, y2): large objects are bigger.
  std::array<float, 4> box() const {
    const float h = size ? 0.12f : 0.07f;
    return {x - h, y - h, x + h, y + h};
  }
};

struct Scene {
  std::vector<Object> objects;
  std::vector<float> features;  // objects.size() x feature_dim: the region features
};

/// The generator's sizes (DATASET section).
struct SceneOptions {
  std::int64_t seed = 0;
  int min_objects = 2, max_objects = 5;
  int feature_dim = 32;
  double feature_noise = 1.0;  // standard deviation of the noise per feature
};

/// Region features: prototype(category) + prototype(colour) + prototype(size) + noise. The
/// prototypes are fixed for a seed; training and validation scenes share them.
class SceneGenerator {
 public:
  explicit SceneGenerator(SceneOptions o) : o_(o) {
    if (o_.min_objects < 1 || o_.max_objects < o_.min_objects || o_.max_objects > kMaxObjects)
      throw std::invalid_argument("SceneGenerator: need 1 <= MIN_OBJECTS <= MAX_OBJECTS <= " +
                                  std::to_string(kMaxObjects));
    Rng rng(static_cast<std::uint64_t>(o_.seed), kPrototypes);
    prototypes_.resize(static_cast<std::size_t>((6 + 6 + 2) * o_.feature_dim));
    for (float& v : prototypes_) v = static_cast<float>(rng.normal());
  }
  const SceneOptions& options() const { return o_; }

  /// Scene `index` of the training (`val` false) or validation split.
  Scene scene(bool val, std::int64_t index) const {
    Rng rng(static_cast<std::uint64_t>(o_.seed), val ? kValScenes : kTrainScenes, static_cast<std::uint64_t>(index));
    Scene s;
    const int n = o_.min_objects + rng.below(o_.max_objects - o_.min_objects + 1);
    while (static_cast<int>(s.objects.size()) < n) {
      Object obj{rng.below(6), rng.below(6), rng.below(2), static_cast<float>(0.1 + 0.8 * rng.uniform()),
                 static_cast<float>(0.1 + 0.8 * rng.uniform())};
      // Centres at least 0.08 apart horizontally, so "left of" is never a close call.
      const bool clear = std::all_of(s.objects.begin(), s.objects.end(),
                                     [&](const Object& o) { return std::fabs(o.x - obj.x) >= 0.08f; });
      if (clear) s.objects.push_back(obj);
    }
    const int d = o_.feature_dim;
    s.features.resize(static_cast<std::size_t>(n * d));
    for (int i = 0; i < n; ++i) {
      const Object& obj = s.objects[static_cast<std::size_t>(i)];
      const float* parts[3] = {&prototypes_[static_cast<std::size_t>(obj.category * d)],
                               &prototypes_[static_cast<std::size_t>((6 + obj.colour) * d)],
                               &prototypes_[static_cast<std::size_t>((12 + obj.size) * d)]};
      for (int k = 0; k < d; ++k)
        s.features[static_cast<std::size_t>(i * d + k)] =
            parts[0][k] + parts[1][k] + parts[2][k] + static_cast<float>(o_.feature_noise * rng.normal());
    }
    return s;
  }

 private:
  SceneOptions o_;
  std::vector<float> prototypes_;  // 14 x feature_dim: 6 categories, 6 colours, 2 sizes
};

// --- text: captions and questions ------------------------------------------------------------

/// The pre-training caption: every object from left to right, "a small red circle a large ...".
inline std::vector<std::string> caption(const Scene& s) {
  std::vector<const Object*> order;
  for (const auto& o : s.objects) order.push_back(&o);
  std::sort(order.begin(), order.end(), [](const Object* a, const Object* b) { return a->x < b->x; });
  std::vector<std::string> words;
  for (const Object* o : order) words.insert(words.end(), {"a", kSizes[o->size], kColours[o->colour], kShapes[o->category]});
  return words;
}

enum class QuestionType { colour_of, shape_of, size_of, exists, count, left_of, extreme, kCount };
inline const char* name(QuestionType t) {
  static const char* names[] = {"colour_of", "shape_of", "size_of", "exists", "count", "left_of", "extreme"};
  return names[static_cast<int>(t)];
}

struct Question {
  QuestionType type;
  std::vector<std::string> words;
  std::string answer;
};

namespace detail {
template <class Key>
std::vector<int> unique_by(const Scene& s, Key key) {  // objects whose key no other object shares
  std::vector<int> out;
  for (std::size_t i = 0; i < s.objects.size(); ++i) {
    int same = 0;
    for (const auto& o : s.objects) same += key(o) == key(s.objects[i]);
    if (same == 1) out.push_back(static_cast<int>(i));
  }
  return out;
}
}  // namespace detail

/// A question about `s` with its answer, each type equally likely; a type that the scene
/// cannot ask unambiguously (no object with a unique description) is redrawn.
inline Question question(const Scene& s, Rng& rng) {
  const auto& obj = s.objects;
  const auto colour_shape = [](const Object& o) { return o.colour * 6 + o.category; };
  while (true) {
    const auto type = static_cast<QuestionType>(rng.below(static_cast<int>(QuestionType::kCount)));
    switch (type) {
      case QuestionType::colour_of: {  // "what colour is the circle ?" (the only circle)
        const auto c = detail::unique_by(s, [](const Object& o) { return o.category; });
        if (c.empty()) break;
        const Object& o = obj[static_cast<std::size_t>(c[static_cast<std::size_t>(rng.below(static_cast<int>(c.size())))])];
        return {type, {"what", "colour", "is", "the", kShapes[o.category], "?"}, kColours[o.colour]};
      }
      case QuestionType::shape_of: {  // "what shape is the red object ?"
        const auto c = detail::unique_by(s, [](const Object& o) { return o.colour; });
        if (c.empty()) break;
        const Object& o = obj[static_cast<std::size_t>(c[static_cast<std::size_t>(rng.below(static_cast<int>(c.size())))])];
        return {type, {"what", "shape", "is", "the", kColours[o.colour], "object", "?"}, kShapes[o.category]};
      }
      case QuestionType::size_of: {  // "what size is the red circle ?"
        const auto c = detail::unique_by(s, colour_shape);
        if (c.empty()) break;
        const Object& o = obj[static_cast<std::size_t>(c[static_cast<std::size_t>(rng.below(static_cast<int>(c.size())))])];
        return {type, {"what", "size", "is", "the", kColours[o.colour], kShapes[o.category], "?"}, kSizes[o.size]};
      }
      case QuestionType::exists: {  // "is there a red circle ?": half yes, half no
        int colour, shape;
        const bool yes = rng.chance(0.5);
        if (yes) {
          const Object& o = obj[static_cast<std::size_t>(rng.below(static_cast<int>(obj.size())))];
          colour = o.colour, shape = o.category;
        } else {
          do colour = rng.below(6), shape = rng.below(6);
          while (std::any_of(obj.begin(), obj.end(), [&](const Object& o) { return o.colour == colour && o.category == shape; }));
        }
        return {type, {"is", "there", "a", kColours[colour], kShapes[shape], "?"}, yes ? "yes" : "no"};
      }
      case QuestionType::count: {  // "how many red objects are there ?" / "how many circles are there ?"
        const bool by_colour = rng.chance(0.5);
        // Mostly a value that is present, so that counts other than zero are common.
        const int v = rng.chance(0.75) ? (by_colour ? obj[static_cast<std::size_t>(rng.below(static_cast<int>(obj.size())))].colour
                                                    : obj[static_cast<std::size_t>(rng.below(static_cast<int>(obj.size())))].category)
                                       : rng.below(6);
        const auto n = std::count_if(obj.begin(), obj.end(), [&](const Object& o) { return (by_colour ? o.colour : o.category) == v; });
        std::vector<std::string> w = {"how", "many"};
        if (by_colour) w.insert(w.end(), {kColours[v], "objects"});
        else w.push_back(kShapesPlural[v]);
        w.insert(w.end(), {"are", "there", "?"});
        return {type, w, kCounts[n]};
      }
      case QuestionType::left_of: {  // "is the red circle left of the blue star ?" (or right of)
        const auto c = detail::unique_by(s, colour_shape);
        if (c.size() < 2) break;
        const int i = rng.below(static_cast<int>(c.size()));
        int j = rng.below(static_cast<int>(c.size()) - 1);
        j += j >= i;
        const Object& a = obj[static_cast<std::size_t>(c[static_cast<std::size_t>(i)])];
        const Object& b = obj[static_cast<std::size_t>(c[static_cast<std::size_t>(j)])];
        const bool left = rng.chance(0.5);
        const bool yes = left ? a.x < b.x : a.x > b.x;
        return {type,
                {"is", "the", kColours[a.colour], kShapes[a.category], left ? "left" : "right", "of", "the",
                 kColours[b.colour], kShapes[b.category], "?"},
                yes ? "yes" : "no"};
      }
      case QuestionType::extreme: {  // "what colour is the leftmost object ?" (or shape, rightmost)
        const bool leftmost = rng.chance(0.5), colour = rng.chance(0.5);
        const Object& o = *std::min_element(obj.begin(), obj.end(), [&](const Object& a, const Object& b) {
          return leftmost ? a.x < b.x : a.x > b.x;
        });
        return {type,
                {"what", colour ? "colour" : "shape", "is", "the", leftmost ? "leftmost" : "rightmost", "object", "?"},
                colour ? kColours[o.colour] : kShapes[o.category]};
      }
      case QuestionType::kCount: break;
    }
  }
}

// --- batches ---------------------------------------------------------------------------------

/// One micro-batch, in the layout the model reads. Text: [CLS] words [SEP], padded with [PAD]
/// (VQA: [CLS] question [MASK] [SEP]; the answer is read at the [MASK]). Regions: index 0 is
/// the whole image (ADD_IMAGE_AS_A_BOX: mean feature, box (0, 0, 1, 1)), then the objects.
struct Batch {
  torch::Tensor text;         // [B, T] word ids, 0 = [PAD]
  torch::Tensor features;     // [B, R, D] region features (0 where masked or padding)
  torch::Tensor boxes;        // [B, R, 4] (x1, y1, x2, y2)
  torch::Tensor regions;      // [B, R] 1 for a region, 0 for padding
  torch::Tensor mlm_labels;   // [B, T] the masked word's id, -1 elsewhere (pre-training)
  torch::Tensor mvrc_labels;  // [B, R] the masked region's category, -1 elsewhere (pre-training)
  torch::Tensor answers;      // [B] answer index (VQA)
  torch::Tensor answer_at;    // [B] position of the [MASK] that the answer is read from (VQA)
  std::vector<int> types;     // question types (VQA), for per-type accuracy
  torch::Tensor mlm_at;       // [N] the labelled entries of mlm_labels, as row * T + column, in order
                              // (pre-training): the MLM head scores only these against the vocabulary
  torch::Tensor mvrc_at;      // [M] the labelled entries of mvrc_labels, as row * R + column (pre-training)
  // Host: where each row's entries begin in mlm_at and mvrc_at (one more for the end), so that
  // rows() cuts them without reading the device.
  std::vector<std::int64_t> mlm_from, mvrc_from;
  std::int64_t size() const { return text.size(0); }
  /// The loss terms' items, host values with no device read (the sizes of mlm_at, mvrc_at):
  /// labelled words (MLM) and labelled regions (MVRC).
  std::int64_t mlm_count() const { return mlm_at.defined() ? mlm_at.numel() : 0; }
  std::int64_t mvrc_count() const { return mvrc_at.defined() ? mvrc_at.numel() : 0; }
  /// mlm_at of `labels` [B, T] (nonzero: a host sync where the labels are on a GPU: the batches
  /// are built on the host, and rows() cuts these with the host offsets).
  static torch::Tensor labelled(const torch::Tensor& labels) {
    return labels.defined() ? labels.reshape({-1}).ge(0).nonzero().squeeze(1) : labels;
  }
  /// Where each row's entries of labelled(labels) begin, and their end (host values).
  static std::vector<std::int64_t> row_starts(const torch::Tensor& labels) {
    std::vector<std::int64_t> from{0};
    if (!labels.defined()) return from;
    const auto per_row = labels.ge(0).sum(1).cpu();  // (on the host when it is built)
    for (std::int64_t i = 0; i < per_row.size(0); ++i) from.push_back(from.back() + per_row[i].item<std::int64_t>());
    return from;
  }
  /// Rows [begin, end) (padding kept at the batch's widths).
  Batch rows(std::int64_t begin, std::int64_t end) const {
    auto cut = [&](const torch::Tensor& t) { return t.defined() ? t.narrow(0, begin, end - begin) : t; };
    // The rows' labelled entries, renumbered from `begin`: no device read.
    auto cut_at = [&](const torch::Tensor& at, const std::vector<std::int64_t>& from, const torch::Tensor& labels) {
      std::vector<std::int64_t> starts;
      if (!at.defined() || from.size() != static_cast<size_t>(size()) + 1)
        return std::make_pair(labelled(cut(labels)), labels.defined() ? row_starts(cut(labels)) : starts);
      for (auto i = begin; i <= end; ++i) starts.push_back(from[static_cast<size_t>(i)] - from[static_cast<size_t>(begin)]);
      const auto first = from[static_cast<size_t>(begin)], n = from[static_cast<size_t>(end)] - first;
      return std::make_pair(at.narrow(0, first, n) - begin * labels.size(1), starts);
    };
    std::vector<int> kept;
    if (!types.empty()) kept.assign(types.begin() + begin, types.begin() + end);
    const auto [piece_mlm_at, piece_mlm_from] = cut_at(mlm_at, mlm_from, mlm_labels);
    const auto [piece_mvrc_at, piece_mvrc_from] = cut_at(mvrc_at, mvrc_from, mvrc_labels);
    return {cut(text), cut(features), cut(boxes), cut(regions), cut(mlm_labels), cut(mvrc_labels), cut(answers),
            cut(answer_at), kept, piece_mlm_at, piece_mvrc_at, piece_mlm_from, piece_mvrc_from};
  }
  /// `parts` batches of consecutive rows, sizes differing by at most one (tk::Task::split).
  std::vector<Batch> split(std::int64_t parts) const {
    parts = std::max<std::int64_t>(1, std::min(parts, size()));
    std::vector<Batch> pieces;
    for (std::int64_t k = 0, begin = 0; k < parts; ++k) {
      const std::int64_t end = begin + size() / parts + (k < size() % parts ? 1 : 0);
      pieces.push_back(rows(begin, end));
      begin = end;
    }
    return pieces;
  }
  /// The same batch on `device` (the model's): every tensor moved, `types` kept. To a GPU from
  /// pinned memory without waiting (a copy from pageable memory blocks the host until it has
  /// run: a host sync per tensor per micro-batch); the caching host allocator keeps each pinned
  /// buffer until its copy has run.
  Batch to(torch::Device device) const {
    if (device == text.device()) return *this;
    const bool pin = device.is_cuda() && text.device().is_cpu();
    auto move = [&](const torch::Tensor& t) {
      if (!t.defined()) return t;
      return pin ? t.pin_memory().to(device, /*non_blocking=*/true) : t.to(device);
    };
    return {move(text), move(features), move(boxes), move(regions), move(mlm_labels), move(mvrc_labels),
            move(answers), move(answer_at), types, move(mlm_at), move(mvrc_at), mlm_from, mvrc_from};
  }
};

/// What a batch hides, for the single-modality baselines: the image (no regions at all, so not
/// even their number shows) or the question (the text is just [CLS] [MASK] [SEP]).
enum class Blank { none, image, question };

/// Lays out samples as a Batch. Text and region lists are given per sample.
class BatchBuilder {
 public:
  BatchBuilder(int feature_dim, bool image_box, const Lexicon& lexicon = {})
      : d_(feature_dim), image_box_(image_box), cls_(lexicon.cls()), sep_(lexicon.sep()), mask_(lexicon.mask()), pad_(lexicon.pad()) {}

  struct Sample {
    std::vector<std::int64_t> text;  // without [CLS]/[SEP]
    std::vector<std::int64_t> mlm;   // -1 or the id the masked position had; same length as text
    const Scene* scene;
    std::vector<int> masked_regions;  // object indices whose features are hidden (MVRC)
    std::int64_t answer = -1;
    int type = -1;
  };

  Batch build(const std::vector<Sample>& samples, Blank blank = Blank::none) const {
    const auto b = static_cast<std::int64_t>(samples.size());
    std::int64_t t = 0, r = 0;
    for (const auto& s : samples) {
      t = std::max<std::int64_t>(t, static_cast<std::int64_t>(s.text.size()) + 2);
      r = std::max<std::int64_t>(r, static_cast<std::int64_t>(s.scene->objects.size()) + (image_box_ ? 1 : 0));
    }
    if (blank == Blank::question) t = 3;
    Batch out;
    out.text = torch::full({b, t}, pad_, torch::kLong);
    out.mlm_labels = torch::full({b, t}, -1, torch::kLong);
    out.features = torch::zeros({b, r, d_});
    out.boxes = torch::zeros({b, r, 4});
    out.regions = torch::zeros({b, r});
    out.mvrc_labels = torch::full({b, r}, -1, torch::kLong);
    out.answers = torch::full({b}, -1, torch::kLong);
    out.answer_at = torch::zeros({b}, torch::kLong);
    auto text = out.text.accessor<std::int64_t, 2>();
    auto mlm = out.mlm_labels.accessor<std::int64_t, 2>();
    auto feat = out.features.accessor<float, 3>();
    auto box = out.boxes.accessor<float, 3>();
    auto reg = out.regions.accessor<float, 2>();
    auto mvrc = out.mvrc_labels.accessor<std::int64_t, 2>();
    for (std::int64_t i = 0; i < b; ++i) {
      const Sample& s = samples[static_cast<std::size_t>(i)];
      std::vector<std::int64_t> words = s.text;
      if (blank == Blank::question) words = {mask_};
      text[i][0] = cls_;
      for (std::size_t k = 0; k < words.size(); ++k) {
        text[i][static_cast<std::int64_t>(k) + 1] = words[k];
        if (words[k] == mask_ && s.answer >= 0) out.answer_at[i] = static_cast<std::int64_t>(k) + 1;
        if (k < s.mlm.size() && blank != Blank::question) mlm[i][static_cast<std::int64_t>(k) + 1] = s.mlm[k];
      }
      text[i][static_cast<std::int64_t>(words.size()) + 1] = sep_;
      out.answers[i] = s.answer;
      out.types.push_back(s.type);
      if (blank == Blank::image) continue;
      const Scene& sc = *s.scene;
      const std::int64_t first = image_box_ ? 1 : 0;
      // The whole image sees every object except the masked ones (VL-BERT blanks their pixels).
      const float visible = static_cast<float>(sc.objects.size() - s.masked_regions.size());
      for (std::size_t o = 0; o < sc.objects.size(); ++o) {
        const std::int64_t j = first + static_cast<std::int64_t>(o);
        const bool masked = std::find(s.masked_regions.begin(), s.masked_regions.end(), static_cast<int>(o)) != s.masked_regions.end();
        reg[i][j] = 1;
        const auto bx = sc.objects[o].box();
        for (int k = 0; k < 4; ++k) box[i][j][k] = bx[static_cast<std::size_t>(k)];
        if (masked) mvrc[i][j] = sc.objects[o].category;
        for (int k = 0; k < d_; ++k) {
          const float v = sc.features[o * static_cast<std::size_t>(d_) + static_cast<std::size_t>(k)];
          if (masked) continue;
          feat[i][j][k] = v;
          if (image_box_) feat[i][0][k] += v / visible;
        }
      }
      if (image_box_) {
        reg[i][0] = 1;
        box[i][0][2] = box[i][0][3] = 1;
      }
    }
    out.mlm_at = Batch::labelled(out.mlm_labels);  // on the host, here
    out.mvrc_at = Batch::labelled(out.mvrc_labels);
    out.mlm_from = Batch::row_starts(out.mlm_labels);
    out.mvrc_from = Batch::row_starts(out.mvrc_labels);
    return out;
  }

 private:
  int d_;
  bool image_box_;
  std::int64_t cls_, sep_, mask_, pad_;
};

// --- the data set -----------------------------------------------------------------------------

/// The DATASET section's values.
struct DataOptions {
  SceneOptions scenes;
  std::int64_t train_scenes = 4000, val_scenes = 500;
  int questions_per_scene = 2;      // VQA samples per scene
  bool image_box = true;            // ADD_IMAGE_AS_A_BOX
  double text_mask_prob = 0.15;     // MLM: each caption word is masked with this probability
  double region_mask_prob = 0.15;   // MVRC: each region is masked with this probability
  Blank blank = Blank::none;
};

/// Training and validation samples of both tasks, with batches addressed by (epoch, index): the
/// batch at a position is a pure function of the seed, the epoch and the index.
class SyntheticData {
 public:
  explicit SyntheticData(DataOptions o, Lexicon lexicon = {})
      : o_(o), generator_(o.scenes), lexicon_(std::move(lexicon)), builder_(o.scenes.feature_dim, o.image_box, lexicon_) {
    for (std::int64_t i = 0; i < o_.train_scenes; ++i) train_.push_back(generator_.scene(false, i));
    for (std::int64_t i = 0; i < o_.val_scenes; ++i) val_.push_back(generator_.scene(true, i));
    auto ask = [&](const std::vector<Scene>& scenes, bool val, std::vector<Asked>& out) {
      for (std::size_t i = 0; i < scenes.size(); ++i) {
        Rng rng(seed(), kQuestions + (val ? 1000 : 0), i);
        for (int q = 0; q < o_.questions_per_scene; ++q) out.push_back({i, question(scenes[i], rng)});
      }
    };
    ask(train_, false, train_questions_);
    ask(val_, true, val_questions_);
  }

  struct Asked {
    std::size_t scene;
    Question question;
  };

  const DataOptions& options() const { return o_; }
  const Lexicon& lexicon() const { return lexicon_; }
  const std::vector<std::string>& answers() const { return answers_; }
  const std::vector<Scene>& scenes(bool val) const { return val ? val_ : train_; }
  const std::vector<Asked>& questions(bool val) const { return val ? val_questions_ : train_questions_; }
  std::int64_t answer_index(const std::string& a) const {
    return std::find(answers_.begin(), answers_.end(), a) - answers_.begin();
  }

  /// Samples of a task per split: scenes (pre-training) or (scene, question) pairs (VQA).
  std::int64_t samples(bool vqa, bool val) const {
    return static_cast<std::int64_t>(vqa ? questions(val).size() : scenes(val).size());
  }
  static std::int64_t batches(std::int64_t samples, std::int64_t batch_size) { return (samples + batch_size - 1) / batch_size; }

  /// Micro-batch `index` of `epoch` (validation: the epoch is ignored, masks are fixed).
  Batch batch(bool vqa, bool val, std::int64_t epoch, std::int64_t index, std::int64_t batch_size, bool shuffle) const {
    const std::int64_t n = samples(vqa, val);
    if (index < 0 || index * batch_size >= n) throw std::out_of_range("SyntheticData::batch: index " + std::to_string(index) + " past the end");
    const auto& order = val || !shuffle ? identity(n) : permutation(n, epoch);
    const auto begin = order.begin() + index * batch_size;
    return batch_of(vqa, val, epoch, {begin, order.begin() + std::min(n, (index + 1) * batch_size)});
  }

  /// The batch of the samples `indices` (e.g. a tk::DistributedSampler's batch) in `epoch`:
  /// each sample's masks depend on the seed, the epoch and the sample only.
  Batch batch_of(bool vqa, bool val, std::int64_t epoch, const std::vector<std::int64_t>& indices) const {
    const std::int64_t n = samples(vqa, val);
    std::vector<BatchBuilder::Sample> samples;
    for (const std::int64_t i : indices) {
      if (i < 0 || i >= n) throw std::out_of_range("SyntheticData::batch_of: sample " + std::to_string(i) + " of " + std::to_string(n));
      Rng rng(seed() ^ mix(static_cast<std::uint64_t>(val ? -1 : epoch)), kMasks, static_cast<std::uint64_t>(i));
      samples.push_back(vqa ? vqa_sample(val, i) : pretrain_sample(val, i, rng));
    }
    return builder_.build(samples, o_.blank);
  }

  /// The best a model that reads only the question can do on this generator: the most frequent
  /// training answer of each question type (answers do not depend on the question's other words),
  /// scored on the validation questions.
  double question_prior_accuracy() const {
    std::int64_t right = 0;
    for (const auto& [type, tally] : question_prior_tally()) right += tally.first;
    return val_questions_.empty() ? 0.0 : static_cast<double>(right) / static_cast<double>(val_questions_.size());
  }
  /// The same, per question type (by name): what a type's accuracy must beat to show that the
  /// model looked at the picture.
  std::map<std::string, double> question_prior_by_type() const {
    std::map<std::string, double> out;
    for (const auto& [type, tally] : question_prior_tally())
      out[name(static_cast<QuestionType>(type))] = static_cast<double>(tally.first) / static_cast<double>(tally.second);
    return out;
  }

 private:
  std::uint64_t seed() const { return static_cast<std::uint64_t>(o_.scenes.seed); }

  /// Per question type: (validation questions whose answer is the type's most frequent training
  /// answer, validation questions).
  std::map<int, std::pair<std::int64_t, std::int64_t>> question_prior_tally() const {
    std::map<int, std::map<std::string, int>> counts;
    for (const auto& a : train_questions_) ++counts[static_cast<int>(a.question.type)][a.question.answer];
    std::map<int, std::pair<std::int64_t, std::int64_t>> tally;
    for (const auto& a : val_questions_) {
      const int type = static_cast<int>(a.question.type);
      const auto& c = counts[type];
      const auto best = std::max_element(c.begin(), c.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
      tally[type].first += best != c.end() && best->first == a.question.answer;
      tally[type].second += 1;
    }
    return tally;
  }

  BatchBuilder::Sample pretrain_sample(bool val, std::int64_t i, Rng& rng) const {
    const Scene& sc = scenes(val)[static_cast<std::size_t>(i)];
    BatchBuilder::Sample s{{}, {}, &sc, {}, -1, -1};
    // BERT's masking: a chosen word becomes [MASK] (80%), a random word (10%) or stays (10%).
    for (const auto& w : caption(sc))
      for (const auto id : lexicon_.ids(w)) s.text.push_back(id);
    s.mlm.assign(s.text.size(), -1);
    for (std::size_t k = 0; k < s.text.size(); ++k) {  // per token, as BERT's (WordPiece pieces alike)
      if (!rng.chance(o_.text_mask_prob)) continue;
      s.mlm[k] = s.text[k];
      const double u = rng.uniform();
      if (u < 0.8) s.text[k] = lexicon_.mask();
      else if (u < 0.9) s.text[k] = lexicon_.random_token(rng);
    }
    for (std::size_t o = 0; o < sc.objects.size(); ++o)
      if (rng.chance(o_.region_mask_prob)) s.masked_regions.push_back(static_cast<int>(o));
    return s;
  }

  BatchBuilder::Sample vqa_sample(bool val, std::int64_t i) const {
    const Asked& a = questions(val)[static_cast<std::size_t>(i)];
    BatchBuilder::Sample s{{}, {}, &scenes(val)[a.scene], {}, answer_index(a.question.answer), static_cast<int>(a.question.type)};
    for (const auto& w : a.question.words)
      for (const auto id : lexicon_.ids(w)) s.text.push_back(id);
    s.text.push_back(lexicon_.mask());  // the answer is read here
    return s;
  }

  const std::vector<std::int64_t>& identity(std::int64_t n) const {
    if (static_cast<std::int64_t>(identity_.size()) != n) {
      identity_.resize(static_cast<std::size_t>(n));
      std::iota(identity_.begin(), identity_.end(), 0);
    }
    return identity_;
  }
  // Fisher-Yates from (seed, epoch); the last epoch's order is kept.
  const std::vector<std::int64_t>& permutation(std::int64_t n, std::int64_t epoch) const {
    if (perm_epoch_ != epoch || static_cast<std::int64_t>(perm_.size()) != n) {
      perm_ = identity(n);
      Rng rng(seed(), kShuffle, static_cast<std::uint64_t>(epoch));
      for (std::int64_t k = n - 1; k > 0; --k) std::swap(perm_[static_cast<std::size_t>(k)], perm_[static_cast<std::size_t>(rng.below(static_cast<int>(k + 1)))]);
      perm_epoch_ = epoch;
    }
    return perm_;
  }

  DataOptions o_;
  SceneGenerator generator_;
  Lexicon lexicon_;
  BatchBuilder builder_;
  std::vector<std::string> answers_ = answer_words();
  std::vector<Scene> train_, val_;
  std::vector<Asked> train_questions_, val_questions_;
  mutable std::vector<std::int64_t> identity_, perm_;
  mutable std::int64_t perm_epoch_ = -1;
};

}  // namespace vlbert
