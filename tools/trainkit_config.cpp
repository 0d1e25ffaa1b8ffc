// trainkit-config: checks a configuration file and prints what it resolves to.
//
//   trainkit-config check FILE [--set K=V ...] [--world-size N] [--batches-per-epoch B]
//       The resolved configuration as JSON on stdout: "config" (every key after defaults and
//       overrides), "derived" (world size, total batch, base LR, the trainer type chosen, the
//       optimizer and schedule), "not_validated" (sections passed through without a schema) and
//       "notes". Exit 0. An invalid file: `error: KEY.PATH: ...` on stderr, exit 2.
//       With --parameters N (and --root, --largest-unit, --frozen), "derived" also holds
//       "memory_per_rank": the bytes each rank holds between optimizer steps, predicted by stage
//       and world size (trainkit/storage/held_bytes.hpp), and this configuration's.
//   trainkit-config schema
//       The toolkit's keys with their types, defaults and meanings, as JSON.
//   trainkit-config reference
//       The same schema as Markdown, one table per section (docs/config-reference.md is this
//       output; ctest docs.config_reference checks that it is current).
//   trainkit-config --help | -h
//       The usage and the options, on stdout; exit 0.
//
// Needs no torch: the trainer type's name comes from the key, as tk::dispatch would choose it.
#include <trainkit/config/config.hpp>
#include <trainkit/run/plan.hpp>
#if defined(TRAINKIT_WITH_YAML)
#include <trainkit/config/yaml.hpp>
#endif

#include <trainkit/storage/held_bytes.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace tk = trainkit;
using nlohmann::json;

namespace {

constexpr int exit_invalid = 2;

const char* usage =
    "usage: trainkit-config check FILE [--set SECTION.KEY=VALUE ...] [--world-size N] [--batches-per-epoch B]\n"
    "                              [--parameters N [--root N] [--largest-unit N] [--frozen N]]\n"
    "       trainkit-config schema | reference\n";

const char* help =
    "\n"
    "Checks a trainkit configuration file (.json, or .yaml/.yml) and prints what it resolves to.\n"
    "\n"
    "commands:\n"
    "  check FILE            the resolved configuration as JSON: every key after defaults and\n"
    "                        overrides, the derived values (world size, total batch, base LR, the\n"
    "                        trainer type, optimizer, schedule) and the sections not validated\n"
    "  schema                the toolkit's keys (types, defaults, meanings) as JSON\n"
    "  reference             the same as Markdown tables (docs/config-reference.md)\n"
    "\n"
    "options of check:\n"
    "  --set SECTION.KEY=VALUE   override a key after the file is read (repeatable, in order)\n"
    "  --world-size N            data-parallel processes (default: WORLD_SIZE, else 1)\n"
    "  --batches-per-epoch B     micro-batches per epoch on one rank: adds the windows per epoch,\n"
    "                            the total optimizer steps and the schedule in steps\n"
    "  --parameters N            the model's trained parameters (110M, 1.3B, or digits): adds the\n"
    "                            bytes per rank between optimizer steps, predicted for ZeRO stages\n"
    "                            0-3 over 1, 2, 4, 8 and N ranks (parameters, gradients, masters,\n"
    "                            optimizer state)\n"
    "  --root N                  with ZeRO stage 3: the parameters in no unit (kept whole; default 0)\n"
    "  --largest-unit N          with ZeRO stage 3: the largest unit's, gathered inside a step\n"
    "  --frozen N                parameters not trained (every rank keeps them whole; default 0)\n"
    "  -h, --help                this text\n"
    "\n"
    "exit status: 0 valid, 2 an invalid file or command line (error: KEY.PATH: ... on stderr),\n"
    "1 anything else.\n";

const char* kind_name(tk::Field::Kind k) {
  switch (k) {
    case tk::Field::Kind::boolean: return "bool";
    case tk::Field::Kind::integer: return "int";
    case tk::Field::Kind::number: return "number";
    case tk::Field::Kind::string: return "string";
    case tk::Field::Kind::list: return "list";
    case tk::Field::Kind::section: return "section";
    case tk::Field::Kind::any: return "any";
    case tk::Field::Kind::either: return "either";
  }
  return "?";
}

json describe_schema(const tk::Schema& schema) {
  json out = json::object();
  for (const auto& key : schema.keys()) {
    const tk::Field& f = *schema.find(key);
    if (f.kind() == tk::Field::Kind::section) {
      out[key] = describe_schema(*f.schema());
      continue;
    }
    json d = {{"type", kind_name(f.kind())}, {"accepts", f.expected()}, {"default", f.default_value()}};
    if (!f.doc().empty()) d["doc"] = f.doc();
    out[key] = d;
  }
  return out;
}

// A table cell: `|` would end the cell, a newline the row.
std::string cell(const std::string& text) {
  std::string out;
  for (char c : text) out += c == '|' ? std::string("\\|") : c == '\n' ? std::string(" ") : std::string(1, c);
  return out;
}

// One Markdown table per section, keys in the schema's order; sections after the keys that
// hold them, each under its own heading.
void reference_tables(const tk::Schema& schema, const std::string& section, std::ostream& out) {
  out << "## " << (section.empty() ? "Top level" : section) << "\n\n"
      << "| key | type | default | meaning |\n|---|---|---|---|\n";
  std::vector<std::string> sections;
  for (const auto& key : schema.keys()) {
    const tk::Field& f = *schema.find(key);
    if (f.kind() == tk::Field::Kind::section) {
      sections.push_back(key);
      continue;
    }
    out << "| " << key << " | " << cell(f.expected()) << " | `" << cell(tk::detail::dump_text(f.default_value()))
        << "` | " << (f.doc().empty() ? "" : cell(f.doc())) << " |\n";
  }
  for (const auto& key : sections) {
    out << "\n";
    reference_tables(*schema.find(key)->schema(), section.empty() ? key : section + "." + key, out);
  }
}

int reference() {
  std::cout << "# Configuration keys\n\n"
               "Generated by `trainkit-config reference` from the schema (include/trainkit/config/train_schema.hpp);\n"
               "do not edit. The keys the toolkit owns: the top level and TRAIN. An application registers\n"
               "its own sections (VL-BERT's NETWORK, DATASET...); `trainkit-config check FILE` lists those it\n"
               "passed through unchecked. How the keys are read: [the configuration guide](guide/configs.md).\n\n";
  reference_tables(tk::Config().schema(), "", std::cout);
  return 0;
}

std::int64_t positive_integer(const std::string& flag, const std::string& text) {
  const json v = tk::detail::resolve_plain_scalar(text);
  if (!v.is_number_integer() || v.get<std::int64_t>() < 1)
    throw tk::ConfigError("", flag + ": expected an integer >= 1, got \"" + text + "\"");
  return v.get<std::int64_t>();
}

// "110M", "1.3B", "340k" or digits: a count of parameters.
std::int64_t parameter_count(const std::string& flag, const std::string& text) {
  std::size_t used = 0;
  double v = -1;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
  }
  const std::string suffix = text.substr(std::min(used, text.size()));
  const double scale = suffix.empty() ? 1 : suffix == "k" || suffix == "K" ? 1e3 : suffix == "M" ? 1e6
                       : suffix == "B" || suffix == "G" ? 1e9 : -1;
  if (used == 0 || scale < 0 || !(v >= 0) || v * scale > 1e15)
    throw tk::ConfigError("", flag + ": expected a count of parameters (digits, or with k, M, B: \"110M\"), got \"" +
                                  text + "\"");
  return static_cast<std::int64_t>(std::llround(v * scale));
}

// derived.memory_per_rank: this run's bytes per rank by kind, and every stage's at 1, 2, 4, 8
// and the plan's world size (one rank: stage 0's; stage 3 null without the units' sizes).
json memory_per_rank(const tk::RunPlan& d, const tk::ModelSize& model) {
  tk::StorageShape shape;
  shape.master_weights = d.trainer.master_weights;
  shape.autocast_copies = !d.trainer.master_weights && d.trainer.precision != tk::PrecisionKind::FP32;
  shape.optimizer_values = tk::StorageShape::optimizer_values_of(d.optimizer);
  shape.accumulates = d.accumulation_steps != 1;
  shape.unit_prefetch = d.trainer_options.unit_prefetch();
  shape.reshard_after_forward = d.trainer_options.reshard_after_forward();
  auto stage_at = [&](int stage, std::int64_t world) { return world == 1 ? 0 : stage; };
  auto predictable = [&](int stage) { return stage < 3 || tk::predicts_stage3(model, shape); };
  json by_world = json::object();
  for (const std::int64_t w : {std::int64_t{1}, std::int64_t{2}, std::int64_t{4}, std::int64_t{8}, d.world_size}) {
    json stages = json::object();
    for (int s = 0; s <= 3; ++s)
      stages[std::to_string(s)] =
          predictable(stage_at(s, w)) ? json(tk::predict_held(model, shape, stage_at(s, w), w).total()) : json(nullptr);
    by_world[std::to_string(w)] = stages;
  }
  const int stage = stage_at(static_cast<int>(d.trainer_options.sharding()), d.world_size);
  json run = nullptr;
  if (predictable(stage)) {
    const tk::HeldBytes held = tk::predict_held(model, shape, stage, d.world_size);
    run = {{"stage", stage},
           {"world_size", d.world_size},
           {"bytes", held.total()},
           {"text", tk::format_bytes(held.total())},
           {"parameters", held.parameters},
           {"gradients", held.gradients},
           {"masters", held.masters},
           {"optimizer", held.optimizer},
           {"gathered_in_step", held.gathered},
           {"autocast_copies_in_step", held.autocast},
           {"unit_gradients_in_step", held.unit_gradients}};
  }
  json out = {{"parameters", model.trained}, {"this_run", run}, {"by_world_size_and_stage", by_world}};
  if (!tk::predicts_stage3(model, shape))
    out["stage_3"] = "not predicted: give --largest-unit (and --root) to describe the units";
  return out;
}

int check(const std::vector<std::string>& args) {
  std::string file;
  std::vector<std::string> sets;
  std::optional<std::int64_t> world_size, batches_per_epoch;
  std::optional<tk::ModelSize> model;
  auto model_size = [&]() -> tk::ModelSize& {
    if (!model) model.emplace();
    return *model;
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](const std::string& flag) -> std::string {
      if (a.rfind(flag + "=", 0) == 0) return a.substr(flag.size() + 1);
      if (i + 1 >= args.size()) throw tk::ConfigError("", flag + ": expected a value after it");
      return args[++i];
    };
    auto is = [&](const std::string& flag) { return a == flag || a.rfind(flag + "=", 0) == 0; };
    if (is("--set")) sets.push_back(value("--set"));
    else if (is("--world-size")) world_size = positive_integer("--world-size", value("--world-size"));
    else if (is("--batches-per-epoch"))
      batches_per_epoch = positive_integer("--batches-per-epoch", value("--batches-per-epoch"));
    else if (is("--parameters")) model_size().trained = parameter_count("--parameters", value("--parameters"));
    else if (is("--root")) model_size().root = parameter_count("--root", value("--root"));
    else if (is("--largest-unit")) model_size().largest_unit = parameter_count("--largest-unit", value("--largest-unit"));
    else if (is("--frozen")) model_size().frozen = parameter_count("--frozen", value("--frozen"));
    else if (!a.empty() && a[0] == '-') throw tk::ConfigError("", a + ": unknown option\n" + usage);
    else if (file.empty()) file = a;
    else throw tk::ConfigError("", a + ": one FILE only (the first was " + file + ")");
  }
  if (file.empty()) throw tk::ConfigError("", std::string("check: expected a FILE\n") + usage);
  if (model && model->trained == 0)
    throw tk::ConfigError("", "--root, --largest-unit and --frozen describe a model: give --parameters N too");
  if (model && (model->root > model->trained || model->largest_unit > model->trained))
    throw tk::ConfigError("", "--root and --largest-unit count parts of --parameters: at most " +
                                  std::to_string(model->trained) + " each");

  tk::Config config;
  config.load(file, sets);
  const tk::RunPlan d = tk::RunPlan::from(config, world_size);
  const tk::TrainerKey runs = d.trainer.dispatched();

  json notes = config.notes();
  json optimizer = {{"name", d.optimizer.name}, {"lr", d.optimizer.lr}, {"weight_decay", d.optimizer.weight_decay}};
  if (d.optimizer.name == "SGD") {
    optimizer["momentum"] = d.optimizer.momentum;
  } else {
    optimizer["betas"] = {d.optimizer.beta1, d.optimizer.beta2};
    optimizer["eps"] = d.optimizer.eps;
  }

  json derived = {
      {"world_size", d.world_size},
      {"batch_images", d.batch_images},
      {"accumulation_steps", d.accumulation_steps},
      {"total_batch", d.total_batch},
      {"lr_scaling", d.lr_scaling},
      {"base_lr", d.base_lr},
      {"trainer", runs.name()},
      {"precision", tk::to_string(d.trainer.precision)},
      {"clip", tk::to_string(d.trainer.clip)},
      {"optimizer", optimizer},
      {"schedule", tk::describe(d.schedule)},
      {"trainable", d.fit.end_epoch() > d.fit.begin_epoch()},
  };
  if (batches_per_epoch) {
    const tk::EpochClock clock = d.epoch_clock(*batches_per_epoch);
    derived["windows_per_epoch"] = clock.windows_per_epoch();
    derived["total_steps"] = clock.step_at(static_cast<double>(d.fit.end_epoch()));
    derived["schedule_in_steps"] = d.make_schedule(*batches_per_epoch)->describe();
  }
  if (model) derived["memory_per_rank"] = memory_per_rank(d, *model);
  const json out = {{"config", config.tree()},
                    {"derived", derived},
                    {"not_validated", config.unvalidated_sections()},
                    {"notes", notes}};
  std::cout << tk::detail::dump_text(out, 2) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty()) {
      std::cerr << usage;
      return exit_invalid;
    }
    if (args[0] == "-h" || args[0] == "--help") {
      std::cout << usage << help;
      return 0;
    }
    if (args[0] == "check") {
      for (const auto& a : args)
        if (a == "-h" || a == "--help") {
          std::cout << usage << help;
          return 0;
        }
      return check({args.begin() + 1, args.end()});
    }
    if (args[0] == "reference") return reference();
    if (args[0] == "schema") {
      std::cout << describe_schema(tk::Config().schema()).dump(2) << "\n";
      return 0;
    }
    std::cerr << "error: " << args[0] << ": unknown command\n" << usage;
    return exit_invalid;
  } catch (const tk::ConfigError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return exit_invalid;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
