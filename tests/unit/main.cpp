// The doctest runner of trainkit_tests; every other tests/unit/*.cpp is one feature's tests.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
