#pragma once
/// The definitions of trainkit/command_line.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/command_line.hpp>

namespace trainkit {

TRAINKIT_INLINE CommandLine CommandLine::parse(int argc, const char* const* argv) {
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

TRAINKIT_INLINE std::vector<std::string> CommandLine::overrides() const {
  std::vector<std::string> o = sets;
  if (!model_dir.empty()) o.push_back("OUTPUT_PATH=" + detail::dump_text(nlohmann::json(model_dir)));
  if (resume) o.push_back("TRAIN.RESUME=true");
  return o;
}

}  // namespace trainkit
