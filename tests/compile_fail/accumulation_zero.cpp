// expect: N must be >= 1 micro-batches per optimizer step, or tk::Dynamic
#include <trainkit/trainkit.hpp>
int main() { return sizeof(trainkit::AccumulationPolicy<0>); }
