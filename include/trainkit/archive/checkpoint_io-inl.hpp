#pragma once
/// The definitions of trainkit/archive/checkpoint_io.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/archive/checkpoint_io.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

TRAINKIT_INLINE void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open '" + path + "' to flush it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw std::runtime_error("cannot flush '" + path + "' to disk: " + std::strerror(err));
}

TRAINKIT_INLINE TemporaryFile::~TemporaryFile() {
  if (!released_) ::unlink(path_.c_str());
}

TRAINKIT_INLINE std::size_t write_archive_atomically(torch::serialize::OutputArchive& archive, const std::string& path) {
  return write_atomically(path, [&](const std::function<size_t(const void*, size_t)>& sink) { archive.save_to(sink); });
}

TRAINKIT_INLINE std::size_t write_bytes_atomically(const std::string& bytes, const std::string& path) {
  return write_atomically(path,
                          [&](const std::function<size_t(const void*, size_t)>& sink) { sink(bytes.data(), bytes.size()); });
}

TRAINKIT_INLINE std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  std::string bytes;
  archive.save_to([&](const void* data, size_t n) -> size_t {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  return bytes;
}

TRAINKIT_INLINE std::size_t write_atomically(
    const std::string& path, const std::function<void(const std::function<size_t(const void*, size_t)>&)>& produce,
    const std::string& what) {
  const auto dir = directory_of(path);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw std::runtime_error("cannot write " + what + " '" + path + "': directory '" + dir +
                             "' does not exist");
  if (::access(dir.c_str(), W_OK) != 0)
    throw std::runtime_error("cannot write " + what + " '" + path + "': directory '" + dir +
                             "' is not writable (" + std::strerror(errno) + ")");
  TemporaryFile tmp(path + ".tmp." + std::to_string(::getpid()));
  const int fd = ::open(tmp.path().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw std::runtime_error("cannot write " + what + " '" + path + "': cannot create '" + tmp.path() +
                             "': " + std::strerror(errno));
  // The archive goes through a writer function, not save_to(path): LibTorch's file writer
  // throws from its destructor on a failed write (a full disk), which terminates the process.
  // This writer never reports a failure to LibTorch; it keeps the first error for below.
  int error = 0;
  std::size_t written = 0;
  produce([&](const void* data, size_t n) -> size_t {
    written += n;
    const char* p = static_cast<const char*>(data);
    for (size_t left = n; left > 0 && error == 0;) {
      const ssize_t k = ::write(fd, p, left);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) {
        error = k < 0 ? errno : EIO;
        break;
      }
      p += k;
      left -= static_cast<size_t>(k);
    }
    return n;
  });
  if (error == 0 && ::fsync(fd) != 0) error = errno;
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error != 0)
    throw std::runtime_error("cannot write " + what + " '" + path + "': " + std::strerror(error) +
                             " while writing '" + tmp.path() + "'" +
                             (error == ENOSPC || error == EDQUOT || error == EFBIG ? " (disk full?)" : "") +
                             "; the file under that name, if any, is unchanged");
  if (::rename(tmp.path().c_str(), path.c_str()) != 0)
    throw std::runtime_error("cannot rename '" + tmp.path() + "' to '" + path +
                             "': " + std::strerror(errno));
  tmp.release();
  fsync_path(dir, true);
  return written;
}

TRAINKIT_INLINE std::string shape_string(c10::IntArrayRef sizes) {
  std::ostringstream s;
  s << sizes;
  return s.str();
}

TRAINKIT_INLINE std::runtime_error missing_record(const std::string& key) {
  return std::runtime_error("checkpoint has no record '" + key + "'");
}

namespace staging {
TRAINKIT_INLINE StagingState& state() {
  thread_local StagingState s;
  return s;
}
}  // namespace staging

TRAINKIT_INLINE void StagingRegion::begin() {
  used_ = needed_ = wanted_ = outside_ = 0;
  wanted_pinned_ = false;
  // (a tensor cut from the region in an earlier save, still alive, holds its storage)
  usable_ = region_.defined() && region_.storage().use_count() == 1;
}

TRAINKIT_INLINE torch::Tensor StagingRegion::take(const torch::Tensor& like, bool device) {
  const auto nbytes = static_cast<std::size_t>(like.numel()) * like.element_size();
  const std::size_t at = (used_ + kAlign - 1) / kAlign * kAlign;
  needed_ = (needed_ + kAlign - 1) / kAlign * kAlign + nbytes;
  wanted_ += nbytes;
  wanted_pinned_ = wanted_pinned_ || device;
  if (!usable_ || at + nbytes > bytes() || (device && !pinned_)) {
    outside_ += nbytes;
    return {};
  }
  used_ = at + nbytes;
  // A storage of its own over the region's bytes, not a view of the region's: an archive writes
  // each storage once, in one dtype, so views of one storage in several dtypes would be written
  // wrong. The deleter holds the region's storage (begin() sees it in use while the copy lives).
  c10::Storage region = region_.storage();
  return at::from_blob(static_cast<std::uint8_t*>(region_.data_ptr()) + at, like.sizes(),
                       [region = std::move(region)](void*) {}, at::TensorOptions().dtype(like.scalar_type()));
}

TRAINKIT_INLINE bool StagingRegion::reserve_wanted() {
  if (needed_ <= bytes() && (pinned_ || !wanted_pinned_)) return false;
  if (region_.defined() && region_.storage().use_count() > 1) return false;  // (in use: the next save tries again)
  const auto size = static_cast<std::int64_t>(std::max(needed_, bytes()));
  region_ = at::Tensor();  // (the old region first: never both)
  region_ = at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(wanted_pinned_));
  pinned_ = wanted_pinned_;
  return true;
}

TRAINKIT_INLINE StagedWrites::StagedWrites(StagingRegion* region)
    : outer_(std::exchange(staging::state(), StagingState{true, false, {}, region})) {
  if (region) region->begin();
}

TRAINKIT_INLINE StagedWrites::~StagedWrites() { staging::state() = std::move(outer_); }

TRAINKIT_INLINE void StagedWrites::wait() const {
  auto& copying = staging::state().copying;
  for (const auto& device : copying) {
    const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
    impl->synchronizeStream(impl->getStream(device));
  }
  copying.clear();
}

TRAINKIT_INLINE bool StagedWrites::complete() const { return !staging::state().incomplete; }

TRAINKIT_INLINE bool StagedWrites::active() { return staging::state().active; }

TRAINKIT_INLINE void StagedWrites::cannot_stage() {
  if (staging::state().active) staging::state().incomplete = true;
}

// A host copy of `tensor`: inside a StagedWrites scope a device tensor's is asynchronous, into
// pinned memory (the scope's region, pinned; or _to_copy's, which pins the target of a
// non-blocking copy from CUDA), waited for by StagedWrites::wait, once per device; cut from the
// scope's StagingRegion where it fits.
TRAINKIT_INLINE torch::Tensor host_copy(const torch::Tensor& tensor) {
  torch::NoGradGuard no_grad;
  const bool device = !tensor.is_cpu();
  const bool staged = StagedWrites::active() && device;
  if (staged) {
    auto& copying = staging::state().copying;
    if (std::find(copying.begin(), copying.end(), tensor.device()) == copying.end()) copying.push_back(tensor.device());
  }
  if (auto* region = StagedWrites::active() ? staging::state().region : nullptr)
    if (auto out = region->take(tensor, device); out.defined()) {
      out.copy_(tensor.detach(), /*non_blocking=*/staged);  // (pinned: asynchronous from a device)
      return out;
    }
  return tensor.detach().to(torch::kCPU, /*non_blocking=*/staged, /*copy=*/true);
}

TRAINKIT_INLINE void write_chunk(const std::string& record, c10::IntArrayRef shape, std::int64_t offset,
                                 const torch::Tensor& chunk) {
  auto* scope = ShardedWrites::active();
  TORCH_CHECK(scope != nullptr, "write_chunk outside a ShardedWrites scope");
  // Staged (a background write), a copy; blocking, a CPU chunk as it is (written before the state
  // changes), a device chunk copied to the host.
  const auto flat = chunk.detach().reshape({-1});
  scope->add({record, shape.vec(), offset, StagedWrites::active() || !flat.is_cpu() ? host_copy(flat) : flat.contiguous()});
}

TRAINKIT_INLINE void write_tensor(torch::serialize::OutputArchive& archive, const std::string& key,
                                  const torch::Tensor& tensor) {
  if (const auto* scope = ShardedWrites::of(archive);
      scope != nullptr && tensor.defined() && safetensors_dtype(tensor.scalar_type()) != nullptr) {
    if (scope->main()) write_chunk(key, tensor.sizes(), 0, tensor);
    return;
  }
  if (StagedWrites::active() && tensor.defined()) {
    archive.write(key, host_copy(tensor), /*is_buffer=*/true);
    return;
  }
  archive.write(key, tensor, /*is_buffer=*/true);
}

TRAINKIT_INLINE bool try_read_tensor(torch::serialize::InputArchive& archive, const std::string& key, torch::Tensor& out) {
  if (const auto* source = ShardReads::of(archive); source != nullptr && source->has(key)) {
    out = source->read(key);
    return true;
  }
  torch::Tensor t;
  if (!archive.try_read(key, t, /*is_buffer=*/true)) return false;
  out = t;
  return true;
}

TRAINKIT_INLINE torch::Tensor read_tensor(torch::serialize::InputArchive& archive, const std::string& key) {
  torch::Tensor t;
  if (!try_read_tensor(archive, key, t)) throw missing_record(key);
  return t;
}

TRAINKIT_INLINE std::optional<std::vector<std::int64_t>> tensor_shape(torch::serialize::InputArchive& archive,
                                                                       const std::string& key) {
  if (const auto* source = ShardReads::of(archive); source != nullptr && source->has(key)) return source->shape(key);
  torch::Tensor t;
  if (!archive.try_read(key, t, /*is_buffer=*/true)) return std::nullopt;
  return t.sizes().vec();
}

TRAINKIT_INLINE bool read_into_if_present(torch::serialize::InputArchive& archive, const std::string& key,
                                          const torch::Tensor& target) {
  const auto shape = tensor_shape(archive, key);
  if (!shape) return false;
  if (c10::IntArrayRef(*shape) != target.sizes())
    throw std::runtime_error("checkpoint record '" + key + "' has shape " + shape_string(*shape) +
                             ", this run needs " + shape_string(target.sizes()));
  target.copy_(read_tensor(archive, key));
  return true;
}

TRAINKIT_INLINE void read_into(torch::serialize::InputArchive& archive, const std::string& key,
                               const torch::Tensor& target) {
  if (!read_into_if_present(archive, key, target)) throw missing_record(key);
}

TRAINKIT_INLINE void write_value(torch::serialize::OutputArchive& archive, const std::string& key,
                                 const c10::IValue& value) {
  archive.write(key, value);
}

TRAINKIT_INLINE c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  if (!archive.try_read(key, value)) throw missing_record(key);
  return value;
}

TRAINKIT_INLINE std::string first_line_of(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string text = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  return text.substr(0, text.find('\n'));
}

TRAINKIT_INLINE void read_archive(torch::serialize::InputArchive& archive, const std::string& path) {
  if (::access(path.c_str(), R_OK) != 0)
    throw std::runtime_error("cannot read checkpoint '" + path + "': " + std::strerror(errno));
  if (const std::string damage = check_archive_file(path); !damage.empty()) throw DamagedArchive(path, damage);
  try {
    // Onto the CPU, whatever device wrote it: a GPU checkpoint opens on a CPU-only machine, and
    // no rank materialises the whole state on the GPU that saved it; readers copy to their
    // targets' devices.
    archive.load_from(path, torch::Device(torch::kCPU));
  } catch (const std::exception& e) {
    throw std::runtime_error("checkpoint '" + path +
                             "' is truncated or corrupt (not a complete archive): " + e.what());
  }
}

}  // namespace trainkit::detail
