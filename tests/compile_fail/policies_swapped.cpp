// expect: A \(the second argument\) must be tk::AccumulationPolicy
#include <trainkit/trainkit.hpp>
namespace tk = trainkit;
// The clip policy given where the accumulation policy belongs.
int main() {
  return sizeof(tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::ClipPolicy<tk::ClipNorm>,
                            tk::AccumulationPolicy<4>>);
}
