// expect: MasterWeights<T>: T must be one of tk::BF16, tk::FP16Static or tk::FP16Dynamic
#include <trainkit/trainkit.hpp>
namespace tk = trainkit;
// FP32 has no half weights to keep masters of.
int main() { return sizeof(tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::FP32>>>); }
