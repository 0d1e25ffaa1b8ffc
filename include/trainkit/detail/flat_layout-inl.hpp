#pragma once
/// The definitions of trainkit/detail/flat_layout.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/detail/flat_layout.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE std::int64_t FlatLayout::add(std::int64_t n) {
  const std::int64_t offset = (padded_ + align_ - 1) / align_ * align_;
  if (!runs_.empty() && runs_.back().offset + runs_.back().n == offset)
    runs_.back().n += n;  // no gap: one run
  else
    runs_.push_back({offset, n});
  padded_ = offset + n;
  packed_ += n;
  return offset;
}

TRAINKIT_INLINE FlatLayout FlatLayout::slice(std::int64_t begin, std::int64_t end) const {
  FlatLayout out(align_);
  for (const auto& r : runs_) {
    const auto b = std::max(r.offset, begin), e = std::min(r.offset + r.n, end);
    if (b >= e) continue;
    out.runs_.push_back({b - begin, e - b});
    out.packed_ += e - b;
  }
  out.padded_ = end - begin;
  return out;
}

TRAINKIT_INLINE torch::Tensor FlatLayout::pack(const torch::Tensor& flat) const {
  check(flat, padded_, "pack");
  if (runs_.size() == 1 && runs_[0].offset == 0) return flat.narrow(0, 0, runs_[0].n);
  std::vector<torch::Tensor> parts;
  parts.reserve(runs_.size());
  for (const auto& r : runs_) parts.push_back(flat.narrow(0, r.offset, r.n));
  return parts.empty() ? flat.narrow(0, 0, 0) : torch::cat(parts);
}

TRAINKIT_INLINE void FlatLayout::unpack_into(const torch::Tensor& packed, const torch::Tensor& flat,
                                             const std::string& what) const {
  if (packed.dim() != 1 || packed.numel() != packed_)
    throw std::runtime_error(what + " has shape " + shape_string(packed.sizes()) + ", this run needs [" +
                             std::to_string(packed_) + "]");
  check(flat, padded_, "unpack_into");
  torch::NoGradGuard no_grad;
  std::int64_t at = 0;
  for (const auto& r : runs_) {
    flat.narrow(0, r.offset, r.n).copy_(packed.narrow(0, at, r.n));
    at += r.n;
  }
}

TRAINKIT_INLINE void FlatLayout::write(torch::serialize::OutputArchive& archive, const std::string& key,
                                       const torch::Tensor& flat) const {
  write_tensor(archive, key, pack(flat));
}

TRAINKIT_INLINE void FlatLayout::read_into(torch::serialize::InputArchive& archive, const std::string& key,
                                           const torch::Tensor& flat) const {
  unpack_into(read_tensor(archive, key), flat, "checkpoint record '" + key + "'");
}

TRAINKIT_INLINE void FlatLayout::zero_gaps(const torch::Tensor& flat) const {
  torch::NoGradGuard no_grad;
  std::int64_t end = 0;
  for (const auto& r : runs_) {
    if (r.offset > end) flat.narrow(0, end, r.offset - end).zero_();
    end = r.offset + r.n;
  }
  if (flat.numel() > end) flat.narrow(0, end, flat.numel() - end).zero_();
}

TRAINKIT_INLINE void FlatLayout::check(const torch::Tensor& flat, std::int64_t at_least, const char* who) {
  TORCH_CHECK(flat.dim() == 1 && flat.numel() >= at_least, "FlatLayout::", who, ": the storage has shape ",
              flat.sizes(), ", the layout needs ", at_least, " elements");
}

}  // namespace trainkit::detail
