// expect: P \(the first argument\) must be tk::PrecisionPolicy
#include <trainkit/trainkit.hpp>
int main() { return sizeof(trainkit::Trainer<int>); }
