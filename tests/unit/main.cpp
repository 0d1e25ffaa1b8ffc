// The doctest runner of trainkit_tests; every other tests/unit/*.cpp is one feature's tests.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdlib>

int main(int argc, char** argv) {
  // The processes the tests start (ranks, drivers, torchrun's workers) inherit a passive OpenMP
  // wait: several of them share this machine's cores, where the idle workers of LibTorch's pool
  // would spin against the other processes (test_sharded_units.cpp: 48 s wall and 71 CPU s with
  // the default, 20 s and 12 CPU s passive, the same results bit for bit). ctest sets it for this
  // process too; the environment overrides.
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/0);
  return doctest::Context(argc, argv).run();
}
