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
#include <trainkit/detail/inline.hpp>
#include <trainkit/archive/checkpoint_io.hpp>

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
  std::int64_t add(std::int64_t n);
  /// The next parameter placed at a multiple of `multiple` elements (a multiple of the
  /// alignment): where a unit of ZeRO stage 3 starts.
  void pad_to(std::int64_t multiple) { padded_ = (padded_ + multiple - 1) / multiple * multiple; }
  /// Elements of the storage, gaps included (the last parameter's end, rounded up so that
  /// storage taken after this one stays aligned).
  std::int64_t padded() const { return (padded_ + align_ - 1) / align_ * align_; }
  /// Elements of the parameters alone.
  std::int64_t packed() const { return packed_; }

  /// The part [begin, end) of this layout, offsets relative to `begin` (a parameter group).
  FlatLayout slice(std::int64_t begin, std::int64_t end) const;

  /// The parameters of `flat` (this layout's storage) back to back: a checkpoint's record.
  torch::Tensor pack(const torch::Tensor& flat) const;
  /// The inverse of pack(): `packed` (a checkpoint's record, any device and dtype) into the
  /// storage `flat`; the gaps are left as they are (zeros).
  void unpack_into(const torch::Tensor& packed, const torch::Tensor& flat, const std::string& what) const;
  /// A checkpoint record of `flat`, packed.
  void write(torch::serialize::OutputArchive& archive, const std::string& key, const torch::Tensor& flat) const;
  /// The record `key` (written by write()) into `flat`; throws when it is missing or its size
  /// differs.
  void read_into(torch::serialize::InputArchive& archive, const std::string& key, const torch::Tensor& flat) const;

  /// Sets the gaps of `flat` to zero (once, after allocating it uninitialised).
  void zero_gaps(const torch::Tensor& flat) const;

 private:
  static void check(const torch::Tensor& flat, std::int64_t at_least, const char* who);
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

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/detail/flat_layout-inl.hpp>
#endif
