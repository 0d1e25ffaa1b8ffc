// libFuzzer target for the configuration loader: any bytes, read as YAML or JSON (first byte),
// optionally with a --set override (the first line after a "\n--set " marker), must either
// load or fail with a trainkit::ConfigError; nothing else may escape, crash or hang.
// Build (clang from Debian):
//   clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude
//       tests/fuzz/fuzz_config.cpp -lyaml -o fuzz_config           (one command line; scripts/fuzz does it all)
//   ./fuzz_config -max_total_time=300 -max_len=4096 tests/fuzz/corpus
#include <trainkit/config/yaml.hpp>
#include <trainkit/run/plan.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

namespace tk = trainkit;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const auto format = (data[0] & 1) ? tk::Config::Format::yaml : tk::Config::Format::json;
  std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  std::vector<std::string> overrides;
  const auto marker = text.find("\n--set ");
  if (marker != std::string::npos) {
    const auto end = text.find('\n', marker + 7);
    overrides.push_back(text.substr(marker + 7, end == std::string::npos ? std::string::npos : end - marker - 7));
    text.erase(marker);
  }
  tk::Config config;
  try {
    config.load_string(text, format, overrides, "fuzz");
  } catch (const tk::ConfigError&) {
    return 0;
  }
  // A configuration that loads must give its derived values without surprises.
  try {
    const tk::RunPlan d = tk::RunPlan::from(config, 1, /*seed=*/1);
    (void)d.trainer.dispatched().name();
    (void)tk::describe(d.schedule);
    auto schedule = d.make_schedule(1 + static_cast<std::int64_t>(data[0] >> 1));
    for (std::int64_t k = 0; k < 64; ++k) (void)schedule->factor(k * 97);
    (void)config.dump();
  } catch (const tk::ConfigError&) {
  }
  return 0;
}
