#pragma once
/// The policy tags: plain types naming a mode, used as `PrecisionPolicy<Tag>` and
/// `ClipPolicy<Tag>`, each carrying the constants that say what it means. Needs no LibTorch:
/// the configuration side (TrainerKey, the registry's names) reads the same constants.
///
///   precision tag   name, kind (PrecisionKind), scales_loss, master_weights, autocast (the
///                   forward region's dtype, HalfType)
///   clip tag        name, kind (ClipKind)
#include <type_traits>

namespace trainkit {

/// The precision a configuration asks for: the tag's kind (MasterWeights<T> has T's).
enum class PrecisionKind { FP32, BF16, FP16Static, FP16Dynamic };
/// The clipping a configuration asks for.
enum class ClipKind { NoClip, ClipNorm, ClipValue };
/// The dtype the forward's autocast region casts to (none: no region).
enum class HalfType { none, bfloat16, float16 };

namespace detail {
/// The constants of a precision tag (the tags below derive from it and add their name).
template <PrecisionKind Kind, bool ScalesLoss, HalfType Autocast>
struct PrecisionConstants {
  static constexpr PrecisionKind kind = Kind;
  static constexpr bool scales_loss = ScalesLoss;
  static constexpr bool master_weights = false;
  static constexpr HalfType autocast = Autocast;
};
}  // namespace detail

/// FP32: no autocast, no loss scale.
struct FP32 : detail::PrecisionConstants<PrecisionKind::FP32, false, HalfType::none> {
  static constexpr const char* name = "FP32";
};
/// BF16: autocast to bfloat16; fp32's range, so no loss scale.
struct BF16 : detail::PrecisionConstants<PrecisionKind::BF16, false, HalfType::bfloat16> {
  static constexpr const char* name = "BF16";
};
/// FP16Static: autocast to float16 with a fixed loss scale.
struct FP16Static : detail::PrecisionConstants<PrecisionKind::FP16Static, true, HalfType::float16> {
  static constexpr const char* name = "FP16Static";
};
/// FP16Dynamic: autocast to float16 with torch.amp.GradScaler's dynamic loss scale.
struct FP16Dynamic : detail::PrecisionConstants<PrecisionKind::FP16Dynamic, true, HalfType::float16> {
  static constexpr const char* name = "FP16Dynamic";
};

namespace detail {
template <class Mode>
inline constexpr bool is_half_mode =
    std::is_same_v<Mode, BF16> || std::is_same_v<Mode, FP16Static> || std::is_same_v<Mode, FP16Dynamic>;
template <class Mode>
inline constexpr const char* master_weights_name = "MasterWeights<?>";
template <>
inline constexpr const char* master_weights_name<BF16> = "MasterWeights<BF16>";
template <>
inline constexpr const char* master_weights_name<FP16Static> = "MasterWeights<FP16Static>";
template <>
inline constexpr const char* master_weights_name<FP16Dynamic> = "MasterWeights<FP16Dynamic>";
}  // namespace detail

/// Master-weights modifier of a half-precision tag: `PrecisionPolicy<MasterWeights<BF16>>`,
/// `<MasterWeights<FP16Static>>`, `<MasterWeights<FP16Dynamic>>`. The wrapped tag still says
/// which half type and which loss scaling; the modifier says where the weights live (half in
/// the model, fp32 masters in the trainer). A wrapper rather than three new tags, so that the
/// scaling choice stays one axis and `MasterWeights<FP32>` is a readable compile error
/// (PrecisionPolicy's). The constants are the wrapped tag's, with master_weights true.
template <class Mode>
struct MasterWeights {
  using wrapped = Mode;
  static constexpr const char* name = detail::master_weights_name<Mode>;
  static constexpr PrecisionKind kind = Mode::kind;
  static constexpr bool scales_loss = Mode::scales_loss;
  static constexpr bool master_weights = true;
  static constexpr HalfType autocast = Mode::autocast;
};

struct NoClip {
  static constexpr const char* name = "NoClip";
  static constexpr ClipKind kind = ClipKind::NoClip;
};
struct ClipNorm {
  static constexpr const char* name = "ClipNorm";
  static constexpr ClipKind kind = ClipKind::ClipNorm;
};
struct ClipValue {
  static constexpr const char* name = "ClipValue";
  static constexpr ClipKind kind = ClipKind::ClipValue;
};

namespace detail {
template <class... T>
struct TypeList {};

/// The name of the tag among `Tags` whose kind is `kind` ("?" for none).
template <class Kind, class... Tags>
constexpr const char* name_of_kind(Kind kind, TypeList<Tags...>) {
  const char* name = "?";
  ((Tags::kind == kind ? (name = Tags::name, 0) : 0), ...);
  return name;
}
/// Every precision and clip tag (each kind once).
using PrecisionTags = TypeList<FP32, BF16, FP16Static, FP16Dynamic>;
using ClipTags = TypeList<NoClip, ClipNorm, ClipValue>;
}  // namespace detail

inline const char* to_string(PrecisionKind p) { return detail::name_of_kind(p, detail::PrecisionTags{}); }
inline const char* to_string(ClipKind c) { return detail::name_of_kind(c, detail::ClipTags{}); }

}  // namespace trainkit
