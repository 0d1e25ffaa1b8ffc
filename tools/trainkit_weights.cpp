// trainkit-weights: a model's weights between trainkit checkpoints, safetensors files and
// PyTorch state_dict files (include/trainkit/io/weights.hpp).
//
//   trainkit-weights inspect FILE
//       the format, then one line per tensor: name, dtype, shape; then the totals
//   trainkit-weights convert IN OUT [--dtype float32|float16|bfloat16] [--rename OLD->NEW ...]
//       IN in any format; OUT's name says what to write: .safetensors, or .pt/.pth/.bin (a
//       state_dict that torch.load(OUT, weights_only=True) opens)
// Exit status: 0 done, 1 a file could not be read or written, 2 a wrong command line.
#include <trainkit/io/weights.hpp>

#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace tk = trainkit;

namespace {

constexpr const char* kUsage =
    "usage: trainkit-weights inspect FILE\n"
    "       trainkit-weights convert IN OUT [--dtype float32|float16|bfloat16] [--rename OLD->NEW ...]\n"
    "FILE and IN: a trainkit checkpoint (a file, or a set's index), a .safetensors file or a PyTorch state_dict (torch.save);\n"
    "OUT: .safetensors, or .pt/.pth/.bin for a state_dict that torch.load(weights_only=True) opens.\n";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int inspect(const std::string& path) {
  const auto format = tk::weights_format(path);
  const tk::NamedTensors weights = tk::read_weights(path);
  std::cout << path << ": " << tk::to_string(format);
  if (tk::detail::ShardSource::is_index(path)) {
    const tk::detail::ShardSource set(path);
    std::cout << " set (" << set.files().size() << " files besides the index, written by " << set.world_size()
              << (set.world_size() == 1 ? " rank)" : " ranks)");
  }
  std::cout << ", " << weights.size() << " tensors\n";
  std::int64_t elements = 0, bytes = 0;
  for (const auto& [name, t] : weights) {
    std::cout << "  " << name << "  " << c10::toString(t.scalar_type()) << " " << tk::detail::shape_string(t.sizes()) << "\n";
    elements += t.numel();
    bytes += static_cast<std::int64_t>(t.nbytes());
  }
  std::cout << "total: " << elements << " elements, " << bytes << " bytes\n";
  return 0;
}

int convert(const std::vector<std::string>& args) {
  std::vector<std::string> files, renames;
  std::optional<c10::ScalarType> dtype;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--dtype" || args[i] == "--rename") {
      if (i + 1 == args.size()) throw UsageError(args[i] + " needs a value");
      const std::string value = args[++i];
      if (args[i - 1] == "--rename") {
        renames.push_back(value);
      } else if (value == "float32") {
        dtype = torch::kFloat;
      } else if (value == "float16") {
        dtype = torch::kHalf;
      } else if (value == "bfloat16") {
        dtype = torch::kBFloat16;
      } else {
        throw UsageError("--dtype: expected float32, float16 or bfloat16, got '" + value + "'");
      }
    } else {
      files.push_back(args[i]);
    }
  }
  if (files.size() != 2) throw UsageError("convert: expected IN and OUT");
  std::vector<tk::PrefixChange> changes;
  try {
    changes = tk::parse_prefix_changes(renames);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--rename: ") + e.what());
  }
  tk::WeightsFormat out_format;
  try {
    out_format = tk::weights_format_of_name(files[1]);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  tk::NamedTensors weights = tk::read_weights(files[0]);
  for (auto& [name, t] : weights) {
    name = tk::renamed(name, changes);
    if (dtype && t.is_floating_point()) t = t.to(*dtype);  // integer buffers keep their type
  }
  tk::write_weights(files[1], weights, out_format);
  std::cerr << "wrote " << weights.size() << " tensors to " << files[1] << " (" << tk::to_string(out_format) << ")\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
      std::cout << kUsage;
      return args.empty() ? 2 : 0;
    }
    const std::string command = args[0];
    args.erase(args.begin());
    if (command == "inspect") {
      if (args.size() != 1) throw UsageError("inspect: expected one FILE");
      return inspect(args[0]);
    }
    if (command == "convert") return convert(args);
    throw UsageError("unknown command '" + command + "'");
  } catch (const UsageError& e) {
    std::cerr << "error: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << tk::detail::first_line_of(e) << "\n";
    return 1;
  }
}
