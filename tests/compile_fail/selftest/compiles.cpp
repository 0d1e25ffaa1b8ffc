// expect: this file compiles, so its compile-fail test must fail
// Registered with WILL_FAIL: shows that a compile-fail test does not pass when the code compiles.
#include <trainkit/version.hpp>

int main() { return TRAINKIT_VERSION_MAJOR; }
