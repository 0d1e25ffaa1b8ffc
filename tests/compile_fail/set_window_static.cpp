// expect: set_window needs AccumulationPolicy<tk::Dynamic>
#include <trainkit/trainkit.hpp>
int main() {
  trainkit::AccumulationPolicy<4> policy{trainkit::TrainerOptions()};
  policy.set_window(2);
}
