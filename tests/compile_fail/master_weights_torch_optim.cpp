// expect: MasterWeights<T>: a torch::optim::Optimizer would update the model's half parameters
#include <trainkit/trainkit.hpp>
namespace tk = trainkit;
// The unfused path steps the model's own (half) parameters, never the trainer's fp32 masters.
int main() {
  torch::nn::Linear model(4, 2);
  auto sgd = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::FP16Dynamic>>> trainer(model, sgd);
  return 0;
}
