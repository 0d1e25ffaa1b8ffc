#pragma once
/// The command line of an example driver (docs/guide/configs.md): --cfg FILE, --set K=V, --model-dir DIR,
/// --resume, as overrides of a Config.
#include <trainkit/detail/inline.hpp>
#include <trainkit/config/error.hpp>
#include <trainkit/config/text.hpp>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace trainkit {

/// The command line of an example driver: --cfg FILE, --set K=V (repeatable), --model-dir DIR,
/// --resume; anything else is kept in `rest` for the program.
struct CommandLine {
  std::string cfg;
  std::vector<std::string> sets;
  std::string model_dir;
  bool resume = false;
  std::vector<std::string> rest;

  static CommandLine parse(int argc, const char* const* argv);
  /// The overrides these flags mean, in order: the --set values, then OUTPUT_PATH=--model-dir
  /// and TRAIN.RESUME=true.
  std::vector<std::string> overrides() const;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/command_line-inl.hpp>
#endif
