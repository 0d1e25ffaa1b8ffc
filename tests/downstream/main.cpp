// The program of every downstream project: it uses trainkit the way another project would, through
// <trainkit/trainkit.hpp> and the CMake target alone. Its output is checked by build_and_run.cmake.
#include <trainkit/trainkit.hpp>

#include <torch/torch.h>

#if defined(TRAINKIT_WITH_YAML)
#include <trainkit/config_yaml.hpp>
#endif

#include <iostream>

int main() {
  const auto t = torch::arange(1, 4, torch::kFloat32);  // 1 2 3
  std::cout << "trainkit " << TRAINKIT_VERSION_STRING << ", tensor sum " << t.sum().item<float>();
#if defined(TRAINKIT_WITH_YAML)
  // Calls into libyaml, so that trainkit::yaml's link to it is checked too.
  std::cout << ", yaml " << trainkit::detail::parse_yaml_text("answer: 42", "downstream")["answer"].get<int>();
#endif
  std::cout << "\n";
  return 0;
}
