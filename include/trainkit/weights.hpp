#pragma once
/// A model's weights from a trainkit checkpoint (Trainer::save), by name: for initialising a
/// model from another run (VL-BERT's NETWORK.PARTIAL_PRETRAIN), where only some weights match.
///
///   const auto report = tk::load_weights(*model, "pretrain/model-0009.ckpt",
///                                        tk::parse_prefix_changes({"vlbert.->"}));
///   report.loaded, report.not_loaded, report.unused    // by name
///
/// Every parameter and buffer of the model whose name (after the renames) and shape match a
/// record of the checkpoint is copied; the others keep their values and are listed.
#include <trainkit/detail/checkpoint_io.hpp>

#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>
#include <torch/types.h>

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
  std::vector<std::string> not_loaded;  ///< the model's weights it has no match for (kept as they were)
  std::vector<std::string> unused;      ///< the file's weights the model has no place for
};

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

/// Copies into `model` the weights of the checkpoint `path` whose renamed name and shape match
/// (see the file comment). Throws when the file cannot be read or holds no model weights.
inline WeightsReport load_weights(torch::nn::Module& model, const std::string& path,
                                  const std::vector<PrefixChange>& prefix_changes = {}) {
  torch::serialize::InputArchive archive;
  detail::read_archive(archive, path);
  std::map<std::string, std::string> records;  // name in the model's terms -> archive key
  for (const auto& key : archive.keys()) {
    for (const std::string prefix : {"model.param.", "model.buffer."}) {
      if (key.rfind(prefix, 0) != 0) continue;
      std::string name = key.substr(prefix.size());
      for (const auto& change : prefix_changes)
        if (name.rfind(change.from, 0) == 0) name = change.to + name.substr(change.from.size());
      records[name] = key;
    }
  }
  if (records.empty()) throw std::runtime_error("checkpoint '" + path + "' holds no model weights");
  WeightsReport r;
  std::set<std::string> used;
  torch::NoGradGuard no_grad;
  auto take = [&](const std::string& name, torch::Tensor target) {
    const auto it = records.find(name);
    torch::Tensor saved;
    if (it == records.end() || !archive.try_read(it->second, saved, true) || saved.sizes() != target.sizes()) {
      std::ostringstream why;
      if (it != records.end() && saved.defined()) why << " (shape " << saved.sizes() << " in the checkpoint)";
      r.not_loaded.push_back(name + why.str());
      return;
    }
    target.copy_(saved);
    used.insert(name);
    r.loaded.push_back(name);
  };
  for (const auto& p : model.named_parameters(true)) take(p.key(), p.value());
  for (const auto& b : model.named_buffers(true)) take(b.key(), b.value());
  for (const auto& [name, key] : records)
    if (!used.count(name)) r.unused.push_back(name);
  return r;
}

}  // namespace trainkit
