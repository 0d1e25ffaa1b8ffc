// expect: static assertion failed: version check fails as expected
// Checks the compile-fail mechanism itself: it needs only <trainkit/version.hpp>.
#include <trainkit/version.hpp>

static_assert(TRAINKIT_VERSION_MAJOR < 0, "version check fails as expected");

int main() { return 0; }
