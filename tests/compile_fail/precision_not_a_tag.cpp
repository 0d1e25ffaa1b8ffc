// expect: PrecisionPolicy<T>: T must be one of tk::FP32, tk::BF16, tk::FP16Static or tk::FP16Dynamic
#include <trainkit/trainkit.hpp>
int main() { return sizeof(trainkit::PrecisionPolicy<float>); }
