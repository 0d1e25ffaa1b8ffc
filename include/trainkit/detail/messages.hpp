#pragma once
/// Pieces of the fit loop's messages, written the same way everywhere.
#include <trainkit/detail/inline.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

namespace trainkit::detail {

/// "epoch 3, micro-batch 7 of 40".
std::string position_text(std::int64_t epoch, std::int64_t index, std::int64_t batches);

/// A value as %.6g ("nan", not "-nan").
std::string short_number(double v);

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/detail/messages-inl.hpp>
#endif
