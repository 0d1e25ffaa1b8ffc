// The version macros of <trainkit/version.hpp> agree with project(trainkit VERSION ...) in
// CMakeLists.txt, which the build passes as TRAINKIT_PROJECT_VERSION_*.
#include <trainkit/version.hpp>

#include <doctest/doctest.h>

#include <string>

namespace test_version {  // this file's names, apart from those of the files it shares a unity batch with

TEST_CASE("version macros match the CMake project version") {
  CHECK(TRAINKIT_VERSION_MAJOR == TRAINKIT_PROJECT_VERSION_MAJOR);
  CHECK(TRAINKIT_VERSION_MINOR == TRAINKIT_PROJECT_VERSION_MINOR);
  CHECK(TRAINKIT_VERSION_PATCH == TRAINKIT_PROJECT_VERSION_PATCH);
  CHECK(std::string(TRAINKIT_VERSION_STRING) == TRAINKIT_PROJECT_VERSION);
}

}  // namespace test_version
