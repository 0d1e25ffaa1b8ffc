// expect: static assertion failed: the message this file does not produce
// Registered with WILL_FAIL: a compile error other than the expected one must not pass.
#include <trainkit/version.hpp>

static_assert(TRAINKIT_VERSION_MAJOR < 0, "a different message");

int main() { return 0; }
