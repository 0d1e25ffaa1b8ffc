#pragma once
// Shared by the trainer tests: tiny deterministic models and data, and comparisons.
#include <trainkit/trainkit.hpp>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

namespace tk = trainkit;

namespace testing {

struct TinyMlpImpl : torch::nn::Module {
  TinyMlpImpl(int in = 8, int hidden = 16, int out = 3, double dropout = 0.0)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, out))),
        drop(register_module("drop", torch::nn::Dropout(dropout))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(drop(torch::tanh(fc1(x)))); }
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(TinyMlp);

/// A model with the same initial weights for every call with the same seed.
inline TinyMlp make_mlp(std::uint64_t seed = 0, int in = 8, int hidden = 16, int out = 3,
                        double dropout = 0.0) {
  torch::manual_seed(seed);
  return TinyMlp(in, hidden, out, dropout);
}

/// Copies every parameter of `from` into `to` (same architecture).
inline void copy_weights(torch::nn::Module& to, torch::nn::Module& from) {
  torch::NoGradGuard no_grad;
  auto src = from.parameters();
  auto dst = to.parameters();
  REQUIRE(src.size() == dst.size());
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

/// A regression data set: x [n, in], y [n, out] from a fixed random teacher.
struct Regression {
  torch::Tensor x, y;
};
inline Regression regression(int n, int in = 8, int out = 3, std::uint64_t seed = 42) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto x = torch::randn({n, in}, gen);
  auto w = torch::randn({in, out}, gen);
  return {x, torch::sin(x.matmul(w))};
}

/// A classification data set: Gaussian clusters in `in` dimensions. The centres are fixed;
/// `seed` draws the samples, so two seeds give a training and a held-out split.
struct Classification {
  torch::Tensor x, y;
};
inline Classification clusters(int n, int in = 8, int classes = 4, std::uint64_t seed = 7) {
  auto centre_gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  auto centers = torch::randn({classes, in}, centre_gen) * 2.0;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto y = torch::randint(classes, {n}, gen);
  auto x = centers.index_select(0, y) + torch::randn({n, in}, gen) * 0.7;
  return {x, y};
}

inline double accuracy(TinyMlp& model, const Classification& data) {
  torch::NoGradGuard no_grad;
  model->eval();
  const auto pred = model(data.x).argmax(1);
  model->train();
  return pred.eq(data.y).to(torch::kDouble).mean().item<double>();
}

/// All parameters concatenated (a copy).
inline torch::Tensor flat(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}).clone());
  return torch::cat(parts);
}

inline double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).norm() / b.norm()).item<double>();
}

/// A fresh directory, removed with everything in it at scope exit. POSIX calls, not
/// std::filesystem: libtorch.so exports its own std::filesystem symbols, and a test binary
/// linked against it can resolve to them (a crash in remove_all was seen here with 2.11).
struct TempDir {
  std::string path;
  TempDir() {
    std::string pattern = "/tmp/trainkit-test-XXXXXX";
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~TempDir() {
    ::nftw(path.c_str(),
           [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
           FTW_DEPTH | FTW_PHYS);
  }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

/// A file's whole text ("" when it cannot be read).
inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// std::cerr into a string for the scope.
struct CaptureStderr {
  std::ostringstream text;
  std::streambuf* old = std::cerr.rdbuf(text.rdbuf());
  ~CaptureStderr() { std::cerr.rdbuf(old); }
};

inline bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}
inline long file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<long>(st.st_size) : -1;
}

/// Every tensor record of a checkpoint (one file, or a set's index), by name.
inline std::map<std::string, torch::Tensor> checkpoint_tensors(const std::string& path) {
  torch::serialize::InputArchive archive;
  const auto set = tk::detail::open_checkpoint_file(archive, path);
  std::map<std::string, torch::Tensor> out;
  if (set)
    for (const auto& key : set->records()) out[key] = set->read(key);
  for (const auto& key : archive.keys()) {
    torch::Tensor t;
    if (archive.try_read(key, t, /*is_buffer=*/true)) out[key] = t;
  }
  return out;
}

/// Whether `a` and `b` hold the same names, shapes, dtypes and bits (the first difference said).
inline bool same_tensors(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  for (const auto& [key, t] : a) {
    const auto it = b.find(key);
    if (it == b.end() || t.scalar_type() != it->second.scalar_type() || !torch::equal(t, it->second)) {
      MESSAGE("record " << key << (it == b.end() ? " is missing" : " differs"));
      return false;
    }
  }
  for (const auto& [key, t] : b)
    if (!a.count(key)) {
      MESSAGE("record " << key << " is only in the second");
      return false;
    }
  return true;
}

}  // namespace testing
