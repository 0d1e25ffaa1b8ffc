#pragma once
/// The definitions of trainkit/archive/zip_check.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/archive/zip_check.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE void Crc32::update(const unsigned char* data, std::size_t n) {
  const auto& t = tables();
  std::uint32_t c = ~crc_;
  while (n >= 8) {
    const std::uint32_t lo = c ^ (std::uint32_t(data[0]) | std::uint32_t(data[1]) << 8 |
                                  std::uint32_t(data[2]) << 16 | std::uint32_t(data[3]) << 24);
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
        t[3][data[4]] ^ t[2][data[5]] ^ t[1][data[6]] ^ t[0][data[7]];
    data += 8;
    n -= 8;
  }
  while (n-- > 0) c = t[0][(c ^ *data++) & 0xff] ^ (c >> 8);
  crc_ = ~c;
}

TRAINKIT_INLINE const Crc32::Tables& Crc32::tables() {
  static const Tables t = [] {
    Tables t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (int k = 1; k < 8; ++k) t[k][i] = t[0][t[k - 1][i] & 0xff] ^ (t[k - 1][i] >> 8);
    return t;
  }();
  return t;
}

TRAINKIT_INLINE ZipFile::~ZipFile() {
  if (fd_ >= 0) ::close(fd_);
}

TRAINKIT_INLINE std::string ZipFile::check() {
  if (fd_ < 0) return std::string("cannot open it: ") + std::strerror(errno);
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return std::string("cannot stat it: ") + std::strerror(errno);
  size_ = static_cast<std::uint64_t>(st.st_size);
  if (size_ < 22) return "truncated (" + std::to_string(size_) + " bytes, no zip directory)";
  // The end-of-central-directory record: in the last 22 + 65535 bytes (its comment).
  const std::uint64_t tail_size = std::min<std::uint64_t>(size_, 22 + 65535);
  std::vector<unsigned char> tail(tail_size);
  if (!read_at(size_ - tail_size, tail.data(), tail_size)) return "cannot read it";
  std::int64_t eocd = -1;
  for (std::int64_t i = static_cast<std::int64_t>(tail_size) - 22; i >= 0; --i)
    if (u32(&tail[i]) == 0x06054b50) {
      eocd = i;
      break;
    }
  if (eocd < 0) return "truncated or not an archive (no end-of-directory record)";
  std::uint64_t entries = u16(&tail[eocd + 10]);
  std::uint64_t dir_size = u32(&tail[eocd + 12]);
  std::uint64_t dir_offset = u32(&tail[eocd + 16]);
  if (entries == 0xffff || dir_size == 0xffffffffu || dir_offset == 0xffffffffu) {
    // Zip64: the locator sits right before the end record.
    if (eocd < 20 || u32(&tail[eocd - 20]) != 0x07064b50) return "damaged zip64 directory locator";
    const std::uint64_t at = u64(&tail[eocd - 20 + 8]);
    unsigned char z[56];
    if (at + 56 > size_ || !read_at(at, z, 56) || u32(z) != 0x06064b50) return "damaged zip64 directory";
    entries = u64(z + 32);
    dir_size = u64(z + 40);
    dir_offset = u64(z + 48);
  }
  if (dir_offset + dir_size > size_) return "truncated (the directory points past the end of the file)";
  std::vector<unsigned char> dir(dir_size);
  if (!read_at(dir_offset, dir.data(), dir_size)) return "cannot read its directory";
  std::uint64_t p = 0;
  for (std::uint64_t e = 0; e < entries; ++e) {
    if (p + 46 > dir_size || u32(&dir[p]) != 0x02014b50) return "damaged directory entry " + std::to_string(e);
    const unsigned char* h = &dir[p];
    const unsigned method = u16(h + 10);
    const std::uint32_t crc = u32(h + 16);
    std::uint64_t size = u32(h + 20);
    const unsigned name_len = u16(h + 28), extra_len = u16(h + 30), comment_len = u16(h + 32);
    std::uint64_t offset = u32(h + 42);
    if (p + 46 + name_len + extra_len > dir_size) return "damaged directory entry " + std::to_string(e);
    const std::string name(reinterpret_cast<const char*>(h + 46), name_len);
    // Zip64 extra field (id 1): the 64-bit values of the fields that read 0xffffffff, in order.
    const unsigned char* x = h + 46 + name_len;
    for (unsigned q = 0; q + 4 <= extra_len;) {
      const unsigned id = u16(x + q), len = u16(x + q + 2);
      if (id == 1) {
        unsigned r = q + 4;
        if (u32(h + 24) == 0xffffffffu && r + 8 <= q + 4 + len) r += 8;  // uncompressed size
        if (size == 0xffffffffu && r + 8 <= q + 4 + len) size = u64(x + r), r += 8;
        if (offset == 0xffffffffu && r + 8 <= q + 4 + len) offset = u64(x + r);
      }
      q += 4 + len;
    }
    if (method != 0 && method != 8) return "record '" + name + "' uses an unknown compression method";
    unsigned char local[30];
    if (offset + 30 > size_ || !read_at(offset, local, 30) || u32(local) != 0x04034b50)
      return "record '" + name + "': damaged local header";
    const std::uint64_t data = offset + 30 + u16(local + 26) + u16(local + 28);
    if (data + size > size_) return "truncated (record '" + name + "' runs past the end of the file)";
    // Deflated records (TorchScript code) are checked by inflating them when loading; the
    // tensors are stored, and only a CRC tells whether their bytes are the written ones.
    if (method == 0 && !crc_matches(data, size, crc))
      return "corrupt (record '" + name + "' does not match its CRC-32)";
    p += 46 + name_len + extra_len + comment_len;
  }
  return "";
}

TRAINKIT_INLINE std::uint32_t ZipFile::u32(const unsigned char* p) {
  return std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 | std::uint32_t(p[3]) << 24;
}

TRAINKIT_INLINE bool ZipFile::read_at(std::uint64_t offset, unsigned char* out, std::uint64_t n) const {
  while (n > 0) {
    const ssize_t got = ::pread(fd_, out, n, static_cast<off_t>(offset));
    if (got <= 0) return false;
    out += got;
    offset += static_cast<std::uint64_t>(got);
    n -= static_cast<std::uint64_t>(got);
  }
  return true;
}

TRAINKIT_INLINE bool ZipFile::crc_matches(std::uint64_t offset, std::uint64_t n, std::uint32_t expected) const {
  Crc32 crc;
  std::vector<unsigned char> buf(std::min<std::uint64_t>(n, 1 << 20));
  while (n > 0) {
    const std::uint64_t k = std::min<std::uint64_t>(n, buf.size());
    if (!read_at(offset, buf.data(), k)) return false;
    crc.update(buf.data(), k);
    offset += k;
    n -= k;
  }
  return crc.value() == expected;
}

}  // namespace trainkit::detail
