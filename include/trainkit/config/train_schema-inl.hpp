#pragma once
/// The definitions of trainkit/config/train_schema.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/config/train_schema.hpp>

namespace trainkit {
namespace detail {

TRAINKIT_INLINE nlohmann::json parse_epoch_list(const nlohmann::json& v) {
  const std::string s = v.get<std::string>();
  nlohmann::json out = nlohmann::json::array();
  if (s.find_first_not_of(" \t") == std::string::npos) return out;
  std::size_t from = 0;
  while (true) {
    const std::size_t comma = s.find(',', from);
    std::string item = s.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    const nlohmann::json x = resolve_plain_scalar(item);
    if (!x.is_number() || !std::isfinite(x.get<double>()) || x.get<double>() < 0)
      throw std::invalid_argument("expected epochs as numbers >= 0 separated by commas (\"14,18\") or a list "
                                  "([14, 18]), got the string " + dump_text(v));
    out.push_back(x.get<double>());
    if (comma == std::string::npos) break;
    from = comma + 1;
  }
  return out;
}

TRAINKIT_INLINE nlohmann::json parse_memory_budget(const nlohmann::json& v) {
  std::string s = v.get<std::string>();
  s.erase(0, s.find_first_not_of(" \t"));
  s.erase(s.find_last_not_of(" \t") + 1);
  const auto fail = [&] {
    return std::invalid_argument("expected a fraction of the device's memory (0.8, \"80%\"), bytes, or a size "
                                 "such as \"12GiB\", \"800MiB\", \"16GB\", got the string " + dump_text(v));
  };
  std::size_t end = 0;
  double x = 0;
  try {
    x = std::stod(s, &end);
  } catch (const std::exception&) {
    throw fail();
  }
  std::string unit = s.substr(end);
  unit.erase(0, unit.find_first_not_of(" \t"));
  static const std::pair<const char*, double> units[] = {
      {"", 1.0}, {"B", 1.0}, {"%", 0.01}, {"KiB", 1024.0}, {"MiB", 1024.0 * 1024}, {"GiB", 1024.0 * 1024 * 1024},
      {"TiB", 1024.0 * 1024 * 1024 * 1024}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}};
  for (const auto& [name, factor] : units)
    if (unit == name) {
      if (!std::isfinite(x) || x < 0 || (unit == "%" && x > 100)) throw fail();
      if (factor > 1 && x * factor <= 1) throw fail();  // bytes must not read as a fraction
      return x * factor;
    }
  throw fail();
}

TRAINKIT_INLINE std::string check_increasing(const nlohmann::json& epochs) {
  for (std::size_t i = 1; i < epochs.size(); ++i)
    if (epochs[i].get<double>() < epochs[i - 1].get<double>()) {
      std::vector<double> given = epochs.get<std::vector<double>>(), sorted = given;
      std::sort(sorted.begin(), sorted.end());
      return "epochs must be in increasing order, got " + format_numbers(given) + "; write " + format_numbers(sorted);
    }
  return {};
}

TRAINKIT_INLINE Schema train_schema() {
  Schema s;
  // --- VL-BERT's keys -------------------------------------------------------------------
  s.list("LR_MULT", Field::any().check([](const nlohmann::json& p) -> std::string {
     if (p.is_array() && p.size() == 2 && p[0].is_string() && p[1].is_number() &&
         std::isfinite(p[1].get<double>()) && p[1].get<double>() >= 0)
       return {};
     return "expected a pair [name-substring, multiplier >= 0] such as [\"vlbert\", 0.1], got " + describe_value(p);
   })).doc("parameter groups: [name-substring, LR multiplier] pairs; the first match wins");
  s.number("VISUAL_SCALE_TEXT_LR_MULT", 1.0).doc("accepted for compatibility with VL-BERT; unused");
  s.number("VISUAL_SCALE_OBJECT_LR_MULT", 1.0).doc("accepted for compatibility with VL-BERT; unused");
  s.number("VISUAL_SCALE_CLIP_GRAD_NORM", -1.0).doc("accepted for compatibility with VL-BERT; unused");
  s.boolean("SHUFFLE", true).doc("shuffle the training data");
  s.number("FLIP_PROB", 0.5).min(0).max(1).doc("application-defined augmentation probability");
  s.add("BATCH_IMAGES", Field::either({Field::integer(1).min(1).max(kMaxBatchImages),
                                       Field::list(Field::integer(1).min(1).max(kMaxBatchImages)).non_empty()}, 1))
      .doc("per-device micro-batch; a list (one per data set) is summed");
  s.boolean("ASPECT_GROUPING", true).doc("application-defined batching");
  s.boolean("RESUME", false).doc("resume from the checkpoint of BEGIN_EPOCH - 1");
  s.boolean("AUTO_RESUME", true).doc("resume from the newest complete checkpoint, if any");
  s.integer("BEGIN_EPOCH", 0).min(0).doc("first epoch");
  s.integer("END_EPOCH", 0).min(0).doc("end epoch (exclusive); must be > BEGIN_EPOCH to train");
  s.string("OPTIMIZER", "SGD").one_of({"SGD", "Adam", "AdamW"})
      .doc("SGD (MOMENTUM, WD as L2), Adam (WD as L2) or AdamW (decoupled WD; betas 0.9, 0.999, eps 1e-6 as VL-BERT)");
  s.number("CLIP_GRAD_NORM", -1.0).doc("> 0: clip the global gradient norm to this (ClipNorm)");
  s.integer("GRAD_ACCUMULATE_STEPS", 1).min(1).max(kMaxAccumulateSteps).doc("micro-batches per optimizer step");
  s.number("LR", 0.1).min_exclusive(0).doc("per-sample learning rate (LR_SCALING per_sample)");
  s.string("LR_SCHEDULE", "step").one_of({"step", "triangle", "plateau", "cosine", "constant"})
      .doc("the LR's factor over optimizer steps (schedule.hpp): step (x LR_FACTOR at LR_STEP epochs), triangle "
           "(linear to 0 at the last optimizer step), plateau (x LR_FACTOR when the validation metric stalls), cosine, constant");
  s.number("LR_FACTOR", 0.1).min_exclusive(0).doc("decay factor of step and plateau");
  s.add("LR_STEP", Field::either({Field::list(Field::number(0).min(0)),
                                  Field::string("").transform(parse_epoch_list),
                                  Field::number(0).min(0).transform([](const nlohmann::json& x) {
                                    return nlohmann::json::array({x});
                                  })},
                                 nlohmann::json::array())
                       .check(check_increasing))
      .doc("decay epochs of step: \"14,18\" or [14, 18]");
  s.boolean("WARMUP", false).doc("warm the LR up over WARMUP_STEPS optimizer steps first");
  s.string("WARMUP_METHOD", "linear").one_of({"linear", "constant"})
      .doc("linear: from WARMUP_FACTOR to 1; constant: WARMUP_FACTOR throughout the warmup");
  s.number("WARMUP_FACTOR", 1.0 / 3).min(0).doc("starting LR factor of warmup");
  s.integer("WARMUP_STEPS", 1000).min(0).doc("warmup length in optimizer steps");
  s.number("WD", 1e-4).min(0).doc("weight decay");
  s.number("MOMENTUM", 0.9).min(0).max_exclusive(1).doc("SGD momentum");
  s.boolean("FP16", false).doc("FP16 mixed precision");
  s.add("FP16_LOSS_SCALE", Field::either({Field::string("dynamic").one_of({"dynamic"}),
                                          Field::number(detail::loss_scale_defaults::static_scale).min_exclusive(0)}, detail::loss_scale_defaults::static_scale))
      .doc("'dynamic' (FP16Dynamic) or a fixed scale > 0 (FP16Static)");
  s.list("LOSS_LOGGERS", Field::string("").check([](const nlohmann::json& v) -> std::string {
     const std::string t = v.get<std::string>();
     const auto comma = t.find(',');
     if (comma != std::string::npos && comma > 0 && comma + 1 < t.size() && t.find(',', comma + 1) == std::string::npos)
       return {};
     return "expected \"output_key,DisplayName\" (one comma), got " + dump_text(v);
   })).doc("the task's named losses to log, as \"output_key,DisplayName\" (Train-DisplayName; tk::LossLoggers)");
  // --- trainkit's additions ---------------------------------------------------------------
  s.boolean("BF16", false).doc("BF16 mixed precision (exclusive with FP16)");
  s.number("FP16_INIT_SCALE", detail::loss_scale_defaults::init_scale).min_exclusive(0).doc("initial dynamic loss scale");
  s.number("FP16_GROWTH_FACTOR", detail::loss_scale_defaults::growth_factor).min_exclusive(1).doc("the dynamic scale's growth after FP16_GROWTH_INTERVAL clean steps");
  s.number("FP16_BACKOFF_FACTOR", detail::loss_scale_defaults::backoff_factor).min_exclusive(0).max_exclusive(1).doc("the dynamic scale's cut on an overflow");
  s.integer("FP16_GROWTH_INTERVAL", detail::loss_scale_defaults::growth_interval).min(1).doc("clean optimizer steps in a row before the dynamic scale grows");
  s.integer("FP16_HYSTERESIS", detail::loss_scale_defaults::hysteresis).min(1).doc("overflows in a row before the scale is cut");
  s.number("FP16_MIN_LOSS_SCALE", detail::loss_scale_defaults::min_scale).min(0).doc("the dynamic scale's floor (0: none)");
  s.number("FP16_MAX_LOSS_SCALE", detail::loss_scale_defaults::max_scale).min_exclusive(0).allow_infinity().doc("the dynamic scale's ceiling (infinite: none)");
  s.list("NO_DECAY", Field::string("").check([](const nlohmann::json& v) -> std::string {
     return v.get<std::string>().empty() ? "expected a part of a parameter's name, got an empty string" : "";
   })).doc("parameters without weight decay: those whose name contains one of these (BERT: [bias, LayerNorm.weight])");
  s.number("CLIP_GRAD_VALUE", -1.0).doc("> 0: clamp every gradient to [-v, v] (ClipValue)");
  s.string("LR_SCALING", "per_sample").one_of({"per_sample", "none"})
      .doc("per_sample: base LR = LR x total batch (VL-BERT); none: LR is the base LR");
  s.string("PARTIAL_WINDOW", "flush").one_of({"flush", "span", "drop"})
      .doc("an epoch's last window with fewer than GRAD_ACCUMULATE_STEPS micro-batches: flush (step on what it has, "
           "weighted right), span (carry it into the next epoch), drop (discard it)");
  s.string("NONFINITE", "skip").one_of({"skip", "abort"})
      .doc("a non-finite gradient: skip the step (GradScaler's rule) or abort with the epoch, micro-batch and step");
  s.string("RESUME_CHANGES", "refuse").one_of({"refuse", "allow"}).doc(
      "a resume whose configuration changes the training trajectory (LR, optimizer, batch, data...): refuse (with the "
      "differences) or allow (said once)");
  s.integer("NONFINITE_PATIENCE", 20).min(1).doc(
      "FP32/BF16 with NONFINITE skip, FP16 with a static FP16_LOSS_SCALE, and a dynamic one at its floor "
      "(FP16_MIN_LOSS_SCALE): skipped steps with no clean log interval between them that stop the run (the first "
      "warns; checked at log windows and epoch ends; the stop names the modules whose gradients were not finite)");
  s.boolean("FORWARD_PEAKS", false).doc(
      "record the largest |output| of each module in the forward of every LOG_FREQUENT-th window, to see which layer "
      "approaches its precision's range (fp16: 65504): logged as forward-peak/<module> and in the text log, a "
      "non-finite output named where it begins; costs nothing when false");
  s.boolean("MASTER_WEIGHTS", false)
      .doc("with FP16 or BF16: the model stored in half precision, fp32 master weights in the trainer (Apex O2)");
  s.integer("ZERO_STAGE", 0).min(0).max(3).doc(
      "data parallel: what each rank keeps of the update (ZeRO's stages): 0 everything (replicated); 1 the optimizer's "
      "state and fp32 master weights of its slices of the parameters only; 2 also the gradient: none between optimizer "
      "steps, and inside a window of several micro-batches only its slices of their sum; 3 also the parameters of the "
      "model's UNITS, each gathered for its forward and its backward only. No effect with one process");
  s.list("UNITS", Field::string("").check([](const nlohmann::json& v) -> std::string {
     return v.get<std::string>().empty() ? "expected a module path (encoder.layer.3, or encoder.layer.* for each child)"
                                         : "";
   })).doc("ZERO_STAGE 3: the model's units by module path (vlbert.encoder.3), or a path ending in .* for each child of "
           "that module (vlbert.encoder.*); the model calls each through tk::unit. Empty: the application's choice "
           "(VL-BERT: vlbert.encoder.*)");
  s.integer("UNIT_PREFETCH", 1).min(0).max(64).doc(
      "ZERO_STAGE 3: units whose all-gather is launched ahead while the units before them compute (in the forward "
      "the next in the forward's order, in the backward the next in the backward's); each holds one more unit "
      "gathered; 0: each unit gathered when it is called");
  s.boolean("RESHARD_AFTER_FORWARD", true).doc(
      "ZERO_STAGE 3: release each unit's parameters after its forward and gather them again for its backward; false "
      "keeps them from the forward to the backward (one all-gather per unit and micro-batch fewer, every unit whole "
      "at the forward's end)");
  s.boolean("OVERLAP_REDUCTION", true).doc(
      "data parallel: reduce the gradient bucket by bucket during the backward that closes a window (with ZERO_STAGE 2 "
      "during every backward), as the gradients become ready; false: after the backward");
  s.integer("CHECKPOINT_KEEP", 3).min(1).doc("complete checkpoints kept (plus the best)");
  s.boolean("CHECKPOINT_BACKGROUND", true)
      .doc("write checkpoint files on a thread while training goes on (the loop pauses only to copy the state to host "
           "memory; a failed write stops the run at the next micro-batch, naming the file; the last checkpoint is "
           "complete before the run ends); false: the loop waits for each file");
  s.string("CHECKPOINT_FORMAT", "auto").one_of({"auto", "single", "sharded"})
      .doc("how checkpoints are written: single, one file (a sharded update is gathered to the main rank); sharded, a "
           "set: each rank writes its own slices to a safetensors file, and the main rank an index (JSON) once every "
           "file is in place, which any world size and stage loads, each rank reading only what it needs; auto: "
           "sharded when ZERO_STAGE shards the update over several ranks, else single");
  s.add("MEMORY_BUDGET", Field::either({Field::number(0).min(0), Field::string("").transform(parse_memory_budget)}, 0.0))
      .doc("memory for training (0: no plan): a fraction of the device's memory (0.8, \"80%\"), or bytes (\"12GiB\"); "
           "the largest piece of each micro-batch that fits is measured and planned, the optimizer step unchanged "
           "(needs a task that can split its batches)");
  s.integer("PIECE_ITEMS", 0).min(0).max(kMaxBatchImages)
      .doc("> 0: every micro-batch with more items runs as pieces of at most this many, each with its own forward and "
           "backward, the optimizer step the whole micro-batch's (MEMORY_BUDGET plans it instead; needs a task that "
           "can split its batches; ZERO_STAGE 3: every rank runs as many pieces as the rank that needs most)");
  s.integer("TARGET_BATCH", 0).min(0).max(kMaxBatchImages)
      .doc("> 0: the effective batch per optimizer step; sets the per-device batch to TARGET_BATCH / (world size x "
           "GRAD_ACCUMULATE_STEPS) in place of BATCH_IMAGES (with MEMORY_BUDGET: the plan splits it to fit)");

  s.rule([](const nlohmann::json& t, const std::string& path) {
    if (t["FP16"].get<bool>() && t["BF16"].get<bool>())
      throw ConfigError(join_path(path, "BF16"),
                        "FP16 and BF16 are both true; set one of them to false (FP16: float16 with loss "
                        "scaling; BF16: bfloat16, no scaling)");
    if (t["MASTER_WEIGHTS"].get<bool>() && !t["FP16"].get<bool>() && !t["BF16"].get<bool>())
      throw ConfigError(join_path(path, "MASTER_WEIGHTS"),
                        "needs FP16 or BF16 (master weights are the fp32 copies of a half-precision model); "
                        "set FP16: true or BF16: true, or MASTER_WEIGHTS: false");
    const double norm = t["CLIP_GRAD_NORM"].get<double>(), value = t["CLIP_GRAD_VALUE"].get<double>();
    if (norm > 0 && value > 0)
      throw ConfigError(join_path(path, "CLIP_GRAD_VALUE"),
                        "CLIP_GRAD_NORM (" + format_number(norm) + ") and CLIP_GRAD_VALUE (" + format_number(value) +
                            ") are both > 0; clip by norm or by value, and set the other to -1");
    const double lo = t["FP16_MIN_LOSS_SCALE"].get<double>(), hi = t["FP16_MAX_LOSS_SCALE"].get<double>();
    if (!(hi > lo))
      throw ConfigError(join_path(path, "FP16_MAX_LOSS_SCALE"),
                        "must be > FP16_MIN_LOSS_SCALE (" + format_number(lo) + "), got " + format_number(hi));
    if (t["LR_SCHEDULE"].get<std::string>() == "plateau" && !(t["LR_FACTOR"].get<double>() < 1))
      throw ConfigError(join_path(path, "LR_FACTOR"), "plateau cuts the LR by LR_FACTOR, so it must be < 1, got " +
                                                          format_number(t["LR_FACTOR"].get<double>()));
    const double init = t["FP16_INIT_SCALE"].get<double>();
    if (t["FP16"].get<bool>() && t["FP16_LOSS_SCALE"].is_string() && !(init >= lo && init <= hi))
      throw ConfigError(join_path(path, "FP16_INIT_SCALE"),
                        "must lie within [FP16_MIN_LOSS_SCALE, FP16_MAX_LOSS_SCALE] = [" + format_number(lo) + ", " +
                            format_number(hi) + "], got " + format_number(init));
  });
  return s;
}

TRAINKIT_INLINE std::optional<std::vector<int>> device_list(const std::string& gpus) {
  std::vector<int> ids;
  std::string digits;  // of the number being read (spaces inside it are skipped)
  for (char c : gpus) {
    if (c >= '0' && c <= '9') {
      digits += c;
    } else if (c == ',') {
      if (digits.empty()) return std::nullopt;  // ",1", "1,,2"
      ids.push_back(digits.size() > 9 ? -1 : std::stoi(digits));
      digits.clear();
    } else if (c != ' ') {
      return std::nullopt;
    }
  }
  if (digits.empty() && !gpus.empty()) return std::nullopt;  // "1,", " "
  if (!digits.empty()) ids.push_back(digits.size() > 9 ? -1 : std::stoi(digits));
  for (int id : ids)
    if (id < 0) return std::nullopt;  // (more digits than a device number has)
  return ids;
}

TRAINKIT_INLINE Schema root_schema() {
  Schema s;
  s.integer("RNG_SEED", -1).min(-1).doc("seed of every RNG the toolkit touches; -1: random (printed)");
  s.string("OUTPUT_PATH", "./output").doc("root of checkpoints and logs (--model-dir overrides)");
  s.string("MODEL_PREFIX", "model").doc("checkpoint file prefix");
  s.add("GPUS", Field::either({Field::string(""), Field::integer(0).min(0).transform([](const nlohmann::json& v) {
                                 return nlohmann::json(std::to_string(v.get<std::int64_t>()));
                               })},
                              "")
                    .check([](const nlohmann::json& v) -> std::string {
                      if (device_list(v.get<std::string>())) return {};
                      return "expected device numbers separated by commas such as '0,1,2,3' (empty: CPU, or the "
                             "local rank's GPU), got " + dump_text(v);
                    }))
      .doc("device list such as '0,1,2,3'; empty: CPU, or the local rank's GPU when distributed");
  s.number("DIST_TIMEOUT", 1800).min_exclusive(0).doc(
      "seconds a data-parallel rank waits for the others (rendezvous, each collective) before it fails naming the silent ranks");
  s.number("DIST_HEARTBEAT", 15).min(0).doc(
      "seconds without a heartbeat after which a data-parallel rank is named on stderr as dead or hung (with NCCL the "
      "others then stop); 0: off; used only when below DIST_TIMEOUT");
  s.integer("LOG_FREQUENT", 50).min(1).doc("log every N optimizer steps");
  s.integer("VAL_FREQUENT", 1).min(1).doc("validate every N epochs");
  s.integer("CHECKPOINT_FREQUENT", 1).min(1).doc("checkpoint every N epochs");
  s.integer("NUM_WORKERS_PER_GPU", 4).min(0).max(64).doc("threads that make micro-batches ahead of the step (tk::FitOptions::workers); 0: none");
  s.string("MODULE", "").doc("the application's model name");
  s.list("SCALES", Field::any()).doc("application-defined (image scales in VL-BERT)");
  s.section("TRAIN", train_schema());
  return s;
}

TRAINKIT_INLINE const std::vector<std::string>& well_known_sections() {
  static const std::vector<std::string> names = {"TRAIN", "NETWORK", "DATASET", "VAL", "TEST"};
  return names;
}

}  // namespace detail
}  // namespace trainkit
