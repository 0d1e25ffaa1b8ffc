#pragma once
// Integrity check of a torch::serialize archive file (a zip; tensors are stored uncompressed):
// the end-of-central-directory record must be there (a truncated file has none), and every
// record's CRC-32 must match the one its writer recorded. LibTorch's reader does not check the
// CRCs (a flipped byte in a tensor loads silently), so the checkpoint manager does, before it
// resumes from a file.
#include <trainkit/detail/inline.hpp>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace trainkit::detail {

/// CRC-32 (zip's: reflected polynomial 0xEDB88320), slicing by 8 bytes.
class Crc32 {
 public:
  void update(const unsigned char* data, std::size_t n);
  std::uint32_t value() const { return crc_; }

 private:
  using Tables = std::array<std::array<std::uint32_t, 256>, 8>;
  static const Tables& tables();
  std::uint32_t crc_ = 0;
};

class ZipFile {
 public:
  explicit ZipFile(const std::string& path) : fd_(::open(path.c_str(), O_RDONLY)) {}
  ~ZipFile();
  ZipFile(const ZipFile&) = delete;
  ZipFile& operator=(const ZipFile&) = delete;

  /// "" when the file is a complete zip whose records match their CRC-32; else what is wrong.
  std::string check();

 private:
  static std::uint32_t u16(const unsigned char* p) { return p[0] | p[1] << 8; }
  static std::uint32_t u32(const unsigned char* p);
  static std::uint64_t u64(const unsigned char* p) { return u32(p) | std::uint64_t(u32(p + 4)) << 32; }

  bool read_at(std::uint64_t offset, unsigned char* out, std::uint64_t n) const;
  bool crc_matches(std::uint64_t offset, std::uint64_t n, std::uint32_t expected) const;

  int fd_;
  std::uint64_t size_ = 0;
};

/// "" when `path` is a complete archive whose records match their CRC-32s; else why not.
inline std::string check_archive_file(const std::string& path) { return ZipFile(path).check(); }

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/archive/zip_check-inl.hpp>
#endif
