#pragma once
/// The command line of an example driver (docs/guide/configs.md): --cfg FILE, --set K=V, --model-dir DIR,
/// --resume, as overrides of a Config.
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

inline CommandLine CommandLine::parse(int argc, const char* const* argv) {
  CommandLine c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const std::string& flag) -> std::string {
      if (a.size() > flag.size() && a.compare(0, flag.size() + 1, flag + "=") == 0) return a.substr(flag.size() + 1);
      if (i + 1 >= argc) throw ConfigError("", flag + ": expected a value after it");
      return argv[++i];
    };
    auto is = [&](const std::string& flag) { return a == flag || a.rfind(flag + "=", 0) == 0; };
    if (is("--cfg")) c.cfg = value("--cfg");
    else if (is("--set")) c.sets.push_back(value("--set"));
    else if (is("--model-dir")) c.model_dir = value("--model-dir");
    else if (a == "--resume") c.resume = true;
    else c.rest.push_back(a);
  }
  return c;
}

inline std::vector<std::string> CommandLine::overrides() const {
  std::vector<std::string> o = sets;
  if (!model_dir.empty()) o.push_back("OUTPUT_PATH=" + detail::dump_text(nlohmann::json(model_dir)));
  if (resume) o.push_back("TRAIN.RESUME=true");
  return o;
}

}  // namespace trainkit
