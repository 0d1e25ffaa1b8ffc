#pragma once
/// Where each parameter lives in the trainer's flat storage.
///
/// Every parameter starts at a 64-byte-aligned element offset (as FSDP's flat parameter does):
/// an odd-sized tensor would otherwise misalign every later view, and CUDA's vectorised
/// elementwise kernels and cuBLAS want aligned operands. The gaps are zeros in the parameters,
/// the gradients and the optimizer's state, so they change no norm and no update.
///
/// Checkpoints hold the packed layout (the parameters back to back, no gaps): pack() before
/// writing a flat record, unpack_into() after reading one. A checkpoint therefore does not
/// depend on the alignment, and those written before it existed load unchanged.
#include <trainkit/detail/checkpoint_io.hpp>

#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace trainkit::detail {

class FlatLayout {
 public:
  /// `align`: elements per aligned unit (64 bytes of the narrowest dtype viewing the storage).
  explicit FlatLayout(std::int64_t align = 1) : align_(align) {}

  /// Places the next parameter of `n` elements; returns its offset.
  std::int64_t add(std::int64_t n) {
    const std::int64_t offset = (padded_ + align_ - 1) / align_ * align_;
    if (!runs_.empty() && runs_.back().offset + runs_.back().n == offset)
      runs_.back().n += n;  // no gap: one run
    else
      runs_.push_back({offset, n});
    padded_ = offset + n;
    packed_ += n;
    return offset;
  }
  /// Elements of the storage, gaps included (the last parameter's end, rounded up so that
  /// storage taken after this one stays aligned).
  std::int64_t padded() const { return (padded_ + align_ - 1) / align_ * align_; }
  /// Elements of the parameters alone.
  std::int64_t packed() const { return packed_; }

  /// The part [begin, end) of this layout, offsets relative to `begin` (a parameter group).
  FlatLayout slice(std::int64_t begin, std::int64_t end) const {
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

  /// The parameters of `flat` (this layout's storage) back to back: a checkpoint's record.
  torch::Tensor pack(const torch::Tensor& flat) const {
    check(flat, padded_, "pack");
    if (runs_.size() == 1 && runs_[0].offset == 0) return flat.narrow(0, 0, runs_[0].n);
    std::vector<torch::Tensor> parts;
    parts.reserve(runs_.size());
    for (const auto& r : runs_) parts.push_back(flat.narrow(0, r.offset, r.n));
    return parts.empty() ? flat.narrow(0, 0, 0) : torch::cat(parts);
  }
  /// The inverse of pack(): `packed` (a checkpoint's record, any device and dtype) into the
  /// storage `flat`; the gaps are left as they are (zeros).
  void unpack_into(const torch::Tensor& packed, const torch::Tensor& flat, const std::string& what) const {
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
  /// A checkpoint record of `flat`, packed.
  void write(torch::serialize::OutputArchive& archive, const std::string& key, const torch::Tensor& flat) const {
    write_tensor(archive, key, pack(flat));
  }
  /// The record `key` (written by write()) into `flat`; throws when it is missing or its size
  /// differs.
  void read_into(torch::serialize::InputArchive& archive, const std::string& key, const torch::Tensor& flat) const {
    unpack_into(read_tensor(archive, key), flat, "checkpoint record '" + key + "'");
  }

  /// Sets the gaps of `flat` to zero (once, after allocating it uninitialised).
  void zero_gaps(const torch::Tensor& flat) const {
    torch::NoGradGuard no_grad;
    std::int64_t end = 0;
    for (const auto& r : runs_) {
      if (r.offset > end) flat.narrow(0, end, r.offset - end).zero_();
      end = r.offset + r.n;
    }
    if (flat.numel() > end) flat.narrow(0, end, flat.numel() - end).zero_();
  }

 private:
  static void check(const torch::Tensor& flat, std::int64_t at_least, const char* who) {
    TORCH_CHECK(flat.dim() == 1 && flat.numel() >= at_least, "FlatLayout::", who, ": the storage has shape ",
                flat.sizes(), ", the layout needs ", at_least, " elements");
  }
  struct Run {
    std::int64_t offset, n;
  };
  std::int64_t align_;
  std::vector<Run> runs_;
  std::int64_t padded_ = 0;  // end of the last run
  std::int64_t packed_ = 0;
};

/// Elements per 64 bytes of the narrowest dtype that views the flat storage.
inline std::int64_t aligned_elements(std::int64_t element_size) { return 64 / element_size; }

}  // namespace trainkit::detail
