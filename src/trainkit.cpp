// trainkit's compiled mode (docs/design/compiled-mode.md): the one unit that holds the
// definitions every -inl.hpp file carries. The CMake target trainkit::compiled builds it and
// defines TRAINKIT_COMPILED_LIB for its users, whose files then see declarations alone.
#ifndef TRAINKIT_COMPILED_LIB
#define TRAINKIT_COMPILED_LIB
#endif
#include <trainkit/accumulation-inl.hpp>
#include <trainkit/any_trainer-inl.hpp>
#include <trainkit/clip-inl.hpp>
#include <trainkit/detail/checkpoint_io-inl.hpp>
#include <trainkit/detail/flat_layout-inl.hpp>
#include <trainkit/detail/master_weights-inl.hpp>
#include <trainkit/detail/partition-inl.hpp>
#include <trainkit/detail/rng_state-inl.hpp>
#include <trainkit/master_storage-inl.hpp>
#include <trainkit/memory-inl.hpp>
#include <trainkit/optim-inl.hpp>
#include <trainkit/options-inl.hpp>
#include <trainkit/precision-inl.hpp>
#include <trainkit/replicas-inl.hpp>
#include <trainkit/schedule-inl.hpp>
#include <trainkit/step_report-inl.hpp>
#include <trainkit/storage-inl.hpp>
#include <trainkit/trainer-inl.hpp>
#include <trainkit/trainer_key-inl.hpp>
