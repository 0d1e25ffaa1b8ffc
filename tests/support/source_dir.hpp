#pragma once
// The repository's root, for tests that read its files (cfgs/): ctest passes it in the
// environment (TRAINKIT_SOURCE_DIR, tests/CMakeLists.txt), so that no translation unit depends on
// where the clone is: objects stay shareable between clones (ccache), and every test file can
// join a unity batch.
#include <cstdlib>
#include <filesystem>
#include <stdexcept>

namespace trainkit_testing {

inline std::filesystem::path source_dir() {
  const char* dir = std::getenv("TRAINKIT_SOURCE_DIR");
  if (dir == nullptr || *dir == '\0')
    throw std::runtime_error("TRAINKIT_SOURCE_DIR is not set: run the tests through ctest, or set it to the "
                             "repository's root");
  return dir;
}

}  // namespace trainkit_testing
