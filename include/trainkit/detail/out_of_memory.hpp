#pragma once
/// Which errors mean "out of memory": what the step turns into its own error in the optimizer
/// phase (trainer.hpp) and what the fit loop replays (memory.hpp).
#include <c10/util/Exception.h>

#include <exception>
#include <new>
#include <string>

namespace trainkit::detail {

/// Whether `e` says that memory ran out: CUDA's c10::OutOfMemoryError, the CPU allocator's
/// "can't allocate memory", std::bad_alloc.
inline bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) || dynamic_cast<const std::bad_alloc*>(&e)) return true;
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e))
    return c10_error->msg().find("can't allocate memory") != std::string::npos;
  return false;
}

}  // namespace trainkit::detail
