// The C++ side of tests/weights/roundtrip.py: a small model with PyTorch's names for its
// weights (Linear, LayerNorm, BatchNorm1d: parameters, float and integer buffers).
//   weights_fixture write DIR        trains it one step, writes DIR/model.ckpt (Trainer::save)
//                                    and DIR/expected.safetensors (the weights it holds)
//   weights_fixture load FILE OUT    a fresh model loads FILE strictly (any format; the report
//                                    on stdout), then writes its weights to OUT
#include <trainkit/trainer/trainer.hpp>
#include <trainkit/io/weights.hpp>

#include <iostream>

namespace tk = trainkit;

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{4, 8}, fc2{8, 3};
  torch::nn::LayerNorm norm{torch::nn::LayerNormOptions({8})};
  torch::nn::BatchNorm1d bn{3};
  NetImpl() {
    register_module("fc1", fc1);
    register_module("norm", norm);
    register_module("fc2", fc2);
    register_module("bn", bn);
  }
  torch::Tensor forward(const torch::Tensor& x) { return bn(fc2(torch::relu(norm(fc1(x))))); }
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 2 && args[0] == "write") {
      torch::manual_seed(1);
      Net net;
      tk::Trainer<> trainer(net, tk::AdamW{1e-2});
      const auto x = torch::randn({16, 4}), y = torch::randn({16, 3});
      trainer.micro_step([&] { return torch::mse_loss(net(x), y); });
      trainer.save(args[1] + "/model.ckpt");
      tk::write_weights(args[1] + "/expected.safetensors", tk::model_weights(*net));
      return 0;
    }
    if (args.size() == 3 && args[0] == "load") {
      torch::manual_seed(2);
      Net net;
      const auto report = tk::load_weights(*net, args[1]);
      report.require_complete(args[1]);
      std::cout << "loaded " << report.loaded.size() << ", converted " << report.converted.size() << "\n";
      for (const auto& c : report.converted) std::cout << "  converted " << c << "\n";
      tk::write_weights(args[2], tk::model_weights(*net));
      return 0;
    }
    std::cerr << "usage: weights_fixture write DIR | load FILE OUT\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << tk::detail::first_line_of(e) << "\n";
    return 1;
  }
}
