// vlbert: VL-BERT pre-training and VQA fine-tuning on the embedded synthetic scenes.
//
//   vlbert pretrain --cfg cfgs/vlbert/pretrain/base_1x24G_fp32.yaml [--set K=V]... [--model-dir DIR] [--resume]
//   vlbert vqa      --cfg cfgs/vlbert/vqa/base_1x24G_fp32.yaml --set NETWORK.PARTIAL_PRETRAIN=DIR/vl-bert_base_pretrain-0009.ckpt
//   torchrun --no-python --nproc-per-node N vlbert pretrain --cfg ...   N data-parallel processes
//   vlbert encode --bert DIR SENTENCE...   BERT's token ids and the text stream's hidden states (JSON)
//
// The device comes from GPUS and the launch (tk::Launch, trainkit/run/launch.hpp): the CPU without
// CUDA, else the local rank's GPU; under torchrun every rank trains its shard of each epoch and
// the main rank (0) writes checkpoints, logs and the RESULT line.
//
// The configuration picks the compiled Trainer type (tk::make_trainer, from trainkit::registry);
// the last line on stdout is the run's figures as JSON ("RESULT {...}").
#include "vlbert.hpp"

#if defined(TRAINKIT_WITH_YAML) && TRAINKIT_WITH_YAML
#include <trainkit/config/yaml.hpp>
#endif

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <string>

namespace tk = trainkit;

// " (rank R of W)" under a launcher, so that each rank's error says whose it is.
static std::string rank_of_launch() {
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank == nullptr || world == nullptr || std::string(world) == "1") return "";
  return std::string(" (rank ") + rank + " of " + world + ")";
}

int main(int argc, char** argv) {
  const std::string usage =
      "usage: vlbert pretrain|vqa --cfg FILE [--set SECTION.KEY=VALUE]... [--model-dir DIR] [--resume] [--eval WEIGHTS]\n"
      "       vlbert encode --bert DIR SENTENCE...\n";
  if (argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::cout << usage << R"(
VL-BERT pre-training (pretrain) and VQA fine-tuning (vqa) on embedded synthetic scenes.

  --cfg FILE        the configuration (YAML or JSON): cfgs/vlbert/pretrain/*.yaml, cfgs/vlbert/vqa/*.yaml
  --set K=V         override one key (repeatable), e.g. --set TRAIN.END_EPOCH=1 --set TRAIN.FP16=true
  --model-dir DIR   where checkpoints and logs go (OUTPUT_PATH); a run there resumes by itself
  --resume          resume from BEGIN_EPOCH's checkpoint (TRAIN.RESUME)
  --eval WEIGHTS    no training: evaluate WEIGHTS (a checkpoint, .safetensors or PyTorch state_dict
                    holding every weight of the model) on the validation split, as VL-BERT's test.py

vlbert encode --bert DIR SENTENCE...: for each sentence, the token ids of the BERT directory DIR's
tokenizer ([CLS] ... [SEP]) and the text stream's last hidden states with DIR's weights, as one JSON
object on stdout; transformers.BertModel gives the same (tests/bert/check_bert.py checks it).

Several processes: torchrun --no-python --nproc-per-node N vlbert pretrain --cfg ... (GPUS picks the
devices). The checks of a configuration without training: trainkit-config check FILE.
The last line on stdout is the run's figures as JSON ("RESULT {...}"). Exit status: 0 done or
stopped with a checkpoint, 2 a configuration or command-line error, 1 any other error.
)";
    return 0;
  }
  if (argc >= 2 && std::string(argv[1]) == "encode") {
    if (argc < 4 || std::string(argv[2]) != "--bert") {
      std::cerr << "error: encode takes --bert DIR and sentences\n" << usage;
      return 2;
    }
    try {
      std::cout << vlbert::encode_sentences(argv[3], std::vector<std::string>(argv + 4, argv + argc)).dump() << "\n";
      return 0;
    } catch (const std::exception& e) {
      std::cerr << "error: " << e.what() << "\n";
      return 1;
    }
  }
  if (argc < 2 || (std::string(argv[1]) != "pretrain" && std::string(argv[1]) != "vqa")) {
    std::cerr << usage << "(vlbert --help says more)\n";
    return 2;
  }
  const std::string task = argv[1];
  // The model's matrices are small: one thread per process is as fast as two on a quiet
  // machine and far faster on a busy one (idle OpenMP workers spin). OMP_NUM_THREADS overrides.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) torch::set_num_threads(1);
  try {
    auto cl = tk::CommandLine::parse(argc - 1, argv + 1);
    std::string eval;  // --eval WEIGHTS
    for (auto it = cl.rest.begin(); it != cl.rest.end();) {
      if (*it != "--eval") {
        ++it;
        continue;
      }
      if (it + 1 == cl.rest.end() || !eval.empty()) {
        std::cerr << "error: --eval takes one weights file\n" << usage;
        return 2;
      }
      eval = *(it + 1);
      it = cl.rest.erase(it, it + 2);
    }
    if (cl.cfg.empty() || !cl.rest.empty()) {
      std::cerr << (cl.rest.empty() ? "error: --cfg FILE is required\n" : "error: unknown argument " + cl.rest[0] + "\n") << usage;
      return 2;
    }
    if (!eval.empty() && !std::ifstream(eval).good()) {  // before the data and the model are built
      std::cerr << "error: --eval: cannot open '" << eval << "'\n";
      return 2;
    }
    tk::Config config;
    vlbert::register_sections(config);
    config.strict_sections();  // a section this program does not know (TRAINING for TRAIN) is an error
    config.load(cl.cfg, cl.overrides());
    tk::RunPlan::from(config, /*world_size=*/1).require_training();  // END_EPOCH > BEGIN_EPOCH (an empty file has END_EPOCH 0): exit 2, naming it
    const tk::Launch launch = tk::Launch::from_config(config);  // device (GPUS), ranks (torchrun)
    if (launch.is_main()) {
      for (const auto& note : config.notes()) std::cerr << "[vlbert] " << note << "\n";
      for (const auto& note : launch.notes()) std::cerr << "[vlbert] " << note << "\n";
    }
    const auto expected = task == "pretrain" ? "VLBertForPretraining" : "VLBertForVQA";
    const auto module = config.get<std::string>("MODULE");
    if (!module.empty() && module != expected)
      throw tk::ConfigError("MODULE", "is \"" + module + "\", but `vlbert " + task + "` trains " + expected);
    const auto result = task == "pretrain" ? vlbert::pretrain(config, launch, eval) : vlbert::finetune(config, launch, eval);
    if (!launch.is_main()) return 0;  // the main rank reports the run
    if (task == "vqa" && !result.val.empty()) {
      const double acc = result.val.back().at("Acc");
      std::printf("VQA validation accuracy %.4f | chance %.4f (1 of %zu answers) | majority answer %.4f | "
                  "text-only (best answer per question type) %.4f\n",
                  acc, result.chance, static_cast<std::size_t>(1.0 / result.chance + 0.5), result.majority, result.question_prior);
    // Each question type next to the best a model that does not look at the picture can do.
    for (const auto& [type, prior] : result.prior_by_type) {
      const auto it = result.val.back().find("Acc-" + type);
      if (it != result.val.back().end()) std::printf("  %-10s %.4f | text-only %.4f\n", type.c_str(), it->second, prior);
    }
    }
    std::printf("RESULT %s\n", vlbert::result_json(result).c_str());
    return 0;
  } catch (const tk::ConfigError& e) {
    std::cerr << "error" << rank_of_launch() << ": " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "error" << rank_of_launch() << ": " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error" << rank_of_launch() << ": " << e.what() << "\n";
    return 1;
  }
}
