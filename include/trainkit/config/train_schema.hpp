#pragma once
/// The toolkit's schemas (docs/config-reference.md is generated from them): the TRAIN section with VL-BERT's keys and trainkit's, and
/// the top level that holds it; applications register their own sections beside them.
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/loss_scale_defaults.hpp>
#include <trainkit/config/error.hpp>
#include <trainkit/config/schema.hpp>
#include <trainkit/config/text.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <optional>
#include <stdexcept>
#include <utility>
#include <string>
#include <vector>

namespace trainkit {
namespace detail {

/// "14,18" or "14, 18.5" -> [14.0, 18.5] (VL-BERT's LR_STEP string form).
nlohmann::json parse_epoch_list(const nlohmann::json& v);

/// TRAIN.MEMORY_BUDGET written as a string: "12GiB", "800MiB", "16GB", "80%" (a fraction), or
/// a plain number.
nlohmann::json parse_memory_budget(const nlohmann::json& v);

std::string check_increasing(const nlohmann::json& epochs);

/// Bounds that keep the batch arithmetic (world size x BATCH_IMAGES x GRAD_ACCUMULATE_STEPS) far
/// from overflow; far above any real run.
inline constexpr std::int64_t kMaxBatchImages = std::int64_t{1} << 24;
inline constexpr std::int64_t kMaxAccumulateSteps = std::int64_t{1} << 20;

/// The TRAIN section: VL-BERT's keys, then trainkit's.
Schema train_schema();

/// GPUS as device numbers ("0, 1,2" -> {0, 1, 2}; "" -> {}); std::nullopt when it is not a
/// comma-separated list of numbers. The one reading of GPUS (the schema's check, tk::Launch).
std::optional<std::vector<int>> device_list(const std::string& gpus);

/// The top level (TRAIN included); application sections are added to it.
Schema root_schema();

/// Section names a VL-BERT file uses; a top-level key near one of them (NETWROK) is a typo,
/// not an application section of its own.
const std::vector<std::string>& well_known_sections();

}  // namespace detail
}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/config/train_schema-inl.hpp>
#endif
