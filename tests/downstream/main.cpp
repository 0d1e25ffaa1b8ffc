// The program of every downstream project: it uses trainkit the way another project would, through
// <trainkit/trainkit.hpp> and the CMake target alone. Its output is checked by build_and_run.cmake.
// Built header-only (trainkit::trainkit) and, by the find_package project, in the compiled mode
// (trainkit::compiled): one optimizer step runs through the trainer's code in either mode.
#include <trainkit/trainkit.hpp>

#include <torch/torch.h>

#if defined(TRAINKIT_WITH_YAML)
#include <trainkit/config/yaml.hpp>
#endif

#include <iostream>

int main() {
  const auto t = torch::arange(1, 4, torch::kFloat32);  // 1 2 3
  std::cout << "trainkit " << TRAINKIT_VERSION_STRING << ", tensor sum " << t.sum().item<float>();
  torch::nn::Linear model(3, 1);
  trainkit::Trainer<> trainer(model, trainkit::SGD{0.1});
  const auto r = trainer.micro_step([&] { return model(t.reshape({1, 3})).square().sum(); });
  std::cout << ", applied " << r.report.applied();
#if defined(TRAINKIT_WITH_YAML)
  // Calls into libyaml, so that trainkit::yaml's link to it is checked too.
  std::cout << ", yaml " << trainkit::detail::parse_yaml_text("answer: 42", "downstream")["answer"].get<int>();
#endif
#if defined(TRAINKIT_COMPILED_LIB)
  std::cout << ", compiled mode";
#endif
  std::cout << "\n";
  return 0;
}
