#pragma once
/// A model's weights by name, in and out of trainkit: for initialising a model from another run
/// (VL-BERT's NETWORK.PARTIAL_PRETRAIN), where only some weights match, and for moving weights
/// to and from PyTorch.
///
///   const auto report = tk::load_weights(*model, "pretrain/model-0009.ckpt",
///                                        tk::parse_prefix_changes({"vlbert.->"}));
///   report.loaded, report.not_loaded, report.unused    // by name
///   tk::write_weights("model.safetensors", tk::read_weights("run/model-0009.ckpt"));
///   tk::write_weights("model.pt", tk::model_weights(*model));   // torch.load(weights_only=True)
///
/// Files (WeightsFormat, told apart by their bytes, never by their names):
///   checkpoint    a trainkit checkpoint (Trainer::save): its model's parameters and buffers
///                 (fp32 masters where the run kept master weights); CRC-checked first
///   safetensors   huggingface's format: safetensors.torch.load_file / save_file
///   state_dict    torch.save(model.state_dict(), path) (zip format, PyTorch >= 1.6); written
///                 as a dict that torch.load(path, weights_only=True) opens and
///                 model.load_state_dict(strict=True) takes
/// Names are the model's state_dict names (named_parameters / named_buffers): a C++ module that
/// registers its submodules under PyTorch's names reads and writes PyTorch's files as they are.
/// load_weights copies every weight whose name (after the renames) and shape match, converting
/// the dtype where it differs (said in the report); the others keep their values and are listed.
#include <trainkit/archive/checkpoint_io.hpp>
#include <trainkit/archive/checkpoint_set.hpp>
#include <trainkit/detail/released_storage.hpp>
#include <trainkit/io/weight_files.hpp>

#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>
#include <torch/types.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

/// What load_weights() did, by name (the model's names).
struct WeightsReport {
  std::vector<std::string> loaded;      ///< the model's weights taken from the file
  std::vector<std::string> not_loaded;  ///< the model's weights it has no match for (kept as they were);
                                        ///< a shape mismatch says the file's shape
  std::vector<std::string> unused;      ///< the file's weights the model has no place for
  std::vector<std::string> converted;   ///< loaded with a dtype conversion ("name (bf16 -> float)")

  /// Throws std::runtime_error naming every weight that was not loaded and every one the file
  /// had no place for (a strict load, as PyTorch's load_state_dict(strict=True)).
  void require_complete(const std::string& path) const {
    if (not_loaded.empty() && unused.empty()) return;
    std::ostringstream msg;
    msg << "weights '" << path << "' do not match the model:";
    if (!not_loaded.empty()) msg << " " << not_loaded.size() << " of the model's weights not loaded (" << join(not_loaded) << ")";
    if (!not_loaded.empty() && !unused.empty()) msg << ";";
    if (!unused.empty()) msg << " " << unused.size() << " of the file's weights unused (" << join(unused) << ")";
    throw std::runtime_error(msg.str());
  }

 private:
  static std::string join(const std::vector<std::string>& names) {
    std::string out;
    for (std::size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", " : "") + names[i];
    if (names.size() > 8) out += ", ... " + std::to_string(names.size() - 8) + " more";
    return out;
  }
};

/// The weight files trainkit reads and writes (see the file comment).
enum class WeightsFormat { checkpoint, safetensors, state_dict };

inline const char* to_string(WeightsFormat f) {
  switch (f) {
    case WeightsFormat::checkpoint: return "trainkit checkpoint";
    case WeightsFormat::safetensors: return "safetensors";
    case WeightsFormat::state_dict: return "PyTorch state_dict";
  }
  return "?";
}

/// The format of the file `path`, by its bytes; throws naming the file when it is none of them.
inline WeightsFormat weights_format(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read weights file '" + path + "': " + std::strerror(errno));
  if (detail::ShardSource::is_index(path)) return WeightsFormat::checkpoint;  // a checkpoint set's index
  std::string head(16, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<std::size_t>(in.gcount()));
  in.clear();
  in.seekg(0, std::ios::end);
  const auto size = static_cast<std::uint64_t>(in.tellg());
  if (head.rfind("PK\x03\x04", 0) == 0) {
    // Both are zips: a trainkit checkpoint is a TorchScript archive (constants.pkl, model.* in
    // data.pkl), torch.save's is not.
    try {
      caffe2::serialize::PyTorchStreamReader reader(path);
      return reader.hasRecord("constants.pkl") ? WeightsFormat::checkpoint : WeightsFormat::state_dict;
    } catch (const std::exception& e) {
      const std::string damage = detail::check_archive_file(path);
      throw std::runtime_error("weights file '" + path + "' is damaged: " +
                               (damage.empty() ? "not a readable zip archive (" + detail::first_line_of(e) + ")" : damage) +
                               "; nothing was loaded from it");
    }
  }
  if (detail::looks_like_safetensors(head, size)) return WeightsFormat::safetensors;
  throw std::runtime_error("'" + path + "' is not a weights file trainkit reads: not a trainkit checkpoint, a safetensors "
                           "file or a torch.save state_dict (zip) file");
}

/// The format an output file's name asks for: .safetensors; .pt, .pth or .bin (a state_dict);
/// throws naming the path otherwise (a checkpoint is written by Trainer::save, not here).
inline WeightsFormat weights_format_of_name(const std::string& path) {
  const auto dot = path.find_last_of('.');
  const std::string ext = dot == std::string::npos ? "" : path.substr(dot);
  if (ext == ".safetensors") return WeightsFormat::safetensors;
  if (ext == ".pt" || ext == ".pth" || ext == ".bin") return WeightsFormat::state_dict;
  throw std::invalid_argument("'" + path + "': name a weights file .safetensors, or .pt/.pth/.bin for a PyTorch "
                              "state_dict");
}

/// Every weight the file `path` holds (any WeightsFormat), on the CPU, in file order; a
/// checkpoint's are its model's, without the "model.param." / "model.buffer." record prefixes.
inline NamedTensors read_weights(const std::string& path) {
  switch (weights_format(path)) {
    case WeightsFormat::safetensors: return detail::read_safetensors(path);
    case WeightsFormat::state_dict: return detail::read_state_dict(path);
    case WeightsFormat::checkpoint: break;
  }
  torch::serialize::InputArchive archive;
  const auto set = detail::open_checkpoint_file(archive, path);
  NamedTensors out;
  if (set)
    for (const auto& key : set->records())
      for (const std::string prefix : {"model.param.", "model.buffer."})
        if (key.rfind(prefix, 0) == 0) out.push_back({key.substr(prefix.size()), set->read(key)});
  for (const auto& key : archive.keys())
    for (const std::string prefix : {"model.param.", "model.buffer."})
      if (key.rfind(prefix, 0) == 0) {
        torch::Tensor t;
        archive.read(key, t, /*is_buffer=*/true);
        out.push_back({key.substr(prefix.size()), t});
      }
  if (out.empty()) throw std::runtime_error("checkpoint '" + path + "' holds no model weights");
  return out;
}

/// The parameters and then the buffers of `model` by their state_dict names, detached (the
/// model's own storage: write them out, do not change them).
inline NamedTensors model_weights(const torch::nn::Module& model) {
  NamedTensors out;
  for (const auto& p : model.named_parameters(true)) {
    detail::check_not_released(p.key(), p.value(), "writing the model's weights");
    out.push_back({p.key(), p.value().detach()});
  }
  for (const auto& b : model.named_buffers(true))
    if (b.value().defined()) out.push_back({b.key(), b.value().detach()});
  return out;
}

/// Writes `weights` to `path` as `format` (safetensors or state_dict), atomically: the file
/// under that name is the old one or the whole new one.
inline void write_weights(const std::string& path, const NamedTensors& weights, WeightsFormat format) {
  switch (format) {
    case WeightsFormat::safetensors: return detail::write_safetensors(path, weights);
    case WeightsFormat::state_dict: return detail::write_state_dict(path, weights);
    case WeightsFormat::checkpoint: break;
  }
  throw std::invalid_argument("write_weights('" + path + "'): trainkit checkpoints are written by Trainer::save");
}
/// write_weights in the format the name asks for (weights_format_of_name).
inline void write_weights(const std::string& path, const NamedTensors& weights) {
  write_weights(path, weights, weights_format_of_name(path));
}

/// A rename of the file's names: a name starting with `from` starts with `to` instead.
struct PrefixChange {
  std::string from, to;
};

/// VL-BERT's PARTIAL_PRETRAIN_PREFIX_CHANGES: "old->new" strings; std::invalid_argument names
/// the first one without "->".
inline std::vector<PrefixChange> parse_prefix_changes(const std::vector<std::string>& changes) {
  std::vector<PrefixChange> out;
  for (const auto& change : changes) {
    const auto arrow = change.find("->");
    if (arrow == std::string::npos) throw std::invalid_argument("expected 'old->new', got '" + change + "'");
    out.push_back({change.substr(0, arrow), change.substr(arrow + 2)});
  }
  return out;
}

/// Applies VL-BERT's renames: a name starting with a change's `from` starts with its `to`.
inline std::string renamed(std::string name, const std::vector<PrefixChange>& prefix_changes) {
  for (const auto& change : prefix_changes)
    if (name.rfind(change.from, 0) == 0) name = change.to + name.substr(change.from.size());
  return name;
}

/// Copies into `model` the weights of `weights`, named in the model's terms, whose name and shape
/// match a parameter or buffer of the model (converting the dtype where it differs); the others
/// keep their values, and the report lists all of them by name. What load_weights does once the
/// file is read and renamed, for a program that maps names or shapes its own way.
inline WeightsReport load_named_weights(torch::nn::Module& model, const std::map<std::string, torch::Tensor>& weights) {
  WeightsReport r;
  std::set<std::string> used;
  torch::NoGradGuard no_grad;
  auto take = [&](const std::string& name, torch::Tensor target) {
    const auto it = weights.find(name);
    if (it == weights.end() || it->second.sizes() != target.sizes()) {
      r.not_loaded.push_back(it == weights.end() ? name : name + " (shape " + detail::shape_string(it->second.sizes()) + " in the file)");
      if (it != weights.end()) used.insert(name);  // it had a place: the mismatch says so
      return;
    }
    if (it->second.scalar_type() != target.scalar_type())
      r.converted.push_back(name + " (" + c10::toString(it->second.scalar_type()) + " -> " + c10::toString(target.scalar_type()) + ")");
    target.copy_(it->second);
    used.insert(name);
    r.loaded.push_back(name);
  };
  for (const auto& p : model.named_parameters(true)) {
    detail::check_not_released(p.key(), p.value(), "loading weights into the model");
    take(p.key(), p.value());
  }
  for (const auto& b : model.named_buffers(true))
    if (b.value().defined()) take(b.key(), b.value());
  for (const auto& [name, t] : weights)
    if (!used.count(name)) r.unused.push_back(name);
  return r;
}

/// Copies into `model` the weights of the file `path` (any WeightsFormat) whose renamed name and
/// shape match (see the file comment). Throws when the file cannot be read or holds no weights;
/// report.require_complete(path) makes the load strict.
inline WeightsReport load_weights(torch::nn::Module& model, const std::string& path,
                                  const std::vector<PrefixChange>& prefix_changes = {}) {
  std::map<std::string, torch::Tensor> file;  // by the name in the model's terms
  for (auto& [name, t] : read_weights(path)) file[renamed(name, prefix_changes)] = std::move(t);
  if (file.empty()) throw std::runtime_error("weights file '" + path + "' holds no weights");
  return load_named_weights(model, file);
}

}  // namespace trainkit
