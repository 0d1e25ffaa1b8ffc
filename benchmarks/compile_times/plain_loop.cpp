// The guide's your-model program written as a plain LibTorch loop: the same model, data, AdamW,
// 2 micro-batches per step, clipping at norm 1, linear warmup then cosine, validation per epoch,
// a checkpoint per epoch and a resume from the newest (torch::save / torch::load), data parallel
// under torchrun (c10d's ProcessGroupGloo, the gradients all-reduced).
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl(int in, int hidden, int classes)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        drop(register_module("drop", torch::nn::Dropout(0.1))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, classes))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(drop(torch::relu(fc1(x)))); }
  torch::nn::Linear fc1;
  torch::nn::Dropout drop;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Classifier);

struct Data {
  torch::Tensor x, y, val_x, val_y;
  Data() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    const auto centres = torch::randn({4, 8}, gen) * 2;
    auto draw = [&](std::int64_t n, torch::Tensor& xs, torch::Tensor& ys) {
      ys = torch::randint(4, {n}, gen);
      xs = centres.index_select(0, ys) + torch::randn({n, 8}, gen) * 0.7;
    };
    draw(512, x, y);
    draw(256, val_x, val_y);
  }
};

constexpr std::int64_t kBatch = 32, kAccumulate = 2;

double lr_at(std::int64_t step, std::int64_t total) {
  const double base = 3e-3;
  if (step < 4) return base * (0.1 + 0.9 * step / 4.0);
  return base * 0.5 * (1 + std::cos(M_PI * (step - 4) / static_cast<double>(total - 4)));
}

int train(const Data& data, std::int64_t end_epoch) {
  torch::manual_seed(0);
  Classifier model(8, 32, 4);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(1e-4));
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  if (const char* world = std::getenv("WORLD_SIZE")) {
    auto store = c10::make_intrusive<c10d::FileStore>("run/store", std::atoi(world));
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, std::atoi(std::getenv("RANK")), std::atoi(world), options);
  }
  const std::int64_t batches = data.x.size(0) / kBatch, steps_per_epoch = batches / kAccumulate;
  std::int64_t epoch = 0, step = 0;
  std::filesystem::create_directories("run");
  for (std::int64_t e = end_epoch - 1; e >= 0; --e) {
    const std::string path = "run/model-" + std::to_string(e) + ".pt";
    if (!std::filesystem::exists(path)) continue;
    torch::serialize::InputArchive archive;
    archive.load_from(path);
    model->load(archive);
    torch::serialize::InputArchive state;
    archive.read("optimizer", state);
    optimizer.load(state);
    epoch = e + 1, step = epoch * steps_per_epoch;
    break;
  }
  double val_acc = 0;
  for (; epoch < end_epoch; ++epoch) {
    model->train();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + epoch);
    const auto order = torch::randperm(data.x.size(0), gen);
    for (std::int64_t index = 0; index < batches; ++index) {
      const auto rows = order.narrow(0, index * kBatch, kBatch);
      const auto logits = model(data.x.index_select(0, rows));
      (torch::nn::functional::cross_entropy(logits, data.y.index_select(0, rows)) / kAccumulate).backward();
      if ((index + 1) % kAccumulate != 0) continue;
      if (group) {
        for (auto& p : model->parameters()) {
          std::vector<torch::Tensor> grads{p.grad()};
          group->allreduce(grads)->wait();
          p.grad().div_(group->getSize());
        }
      }
      torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
      for (auto& g : optimizer.param_groups())
        static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr_at(step, 6 * steps_per_epoch));
      optimizer.step();
      optimizer.zero_grad();
      ++step;
    }
    {
      torch::NoGradGuard no_grad;
      model->eval();
      val_acc = model(data.val_x).argmax(1).eq(data.val_y).to(torch::kDouble).mean().item<double>();
    }
    torch::serialize::OutputArchive archive, state;
    model->save(archive);
    optimizer.save(state);
    archive.write("optimizer", state);
    archive.save_to("run/model-" + std::to_string(epoch) + ".pt");
    std::printf("epoch %lld: Val-Acc %.3f\n", static_cast<long long>(epoch), val_acc);
  }
  return val_acc > 0.9 ? 0 : 1;
}

int main() {
  const Data data;
  return train(data, 3) | train(data, 6);
}
