// trainkit's compiled mode (docs/design/compiled-mode.md): the one unit that holds the
// definitions every -inl.hpp file carries. The CMake target trainkit::compiled builds it and
// defines TRAINKIT_COMPILED_LIB for its users, whose files then see declarations alone.
#ifndef TRAINKIT_COMPILED_LIB
#define TRAINKIT_COMPILED_LIB
#endif
#include <trainkit/archive/checkpoint_io-inl.hpp>
#include <trainkit/archive/checkpoint_set-inl.hpp>
#include <trainkit/archive/record_shards-inl.hpp>
#include <trainkit/archive/zip_check-inl.hpp>
#include <trainkit/config/config-inl.hpp>
#include <trainkit/config/json_reader-inl.hpp>
#include <trainkit/config/resume_changes-inl.hpp>
#include <trainkit/config/schema-inl.hpp>
#include <trainkit/config/text-inl.hpp>
#include <trainkit/config/train_schema-inl.hpp>
#include <trainkit/detail/flat_layout-inl.hpp>
#include <trainkit/detail/rng_state-inl.hpp>
#include <trainkit/fit/callbacks-inl.hpp>
#include <trainkit/fit/checkpoint-inl.hpp>
#include <trainkit/fit/checkpoint_writes-inl.hpp>
#include <trainkit/fit/memory-inl.hpp>
#include <trainkit/fit/metrics-inl.hpp>
#include <trainkit/fit/run_log-inl.hpp>
#include <trainkit/fit/stop_signals-inl.hpp>
#include <trainkit/log/event_encoding-inl.hpp>
#include <trainkit/log/log_file-inl.hpp>
#include <trainkit/log/progress-inl.hpp>
#include <trainkit/log/scalars-inl.hpp>
#include <trainkit/log/tensorboard-inl.hpp>
#include <trainkit/log/text_log-inl.hpp>
#include <trainkit/run/plan-inl.hpp>
#include <trainkit/step/optim-inl.hpp>
#include <trainkit/step/options-inl.hpp>
#include <trainkit/step/precision-inl.hpp>
#include <trainkit/step/replicas-inl.hpp>
#include <trainkit/step/schedule-inl.hpp>
#include <trainkit/storage/flat_storage-inl.hpp>
#include <trainkit/storage/held_bytes-inl.hpp>
#include <trainkit/storage/master_storage-inl.hpp>
#include <trainkit/storage/master_weights-inl.hpp>
#include <trainkit/storage/mode-inl.hpp>
#include <trainkit/storage/placement-inl.hpp>
#include <trainkit/storage/readiness-inl.hpp>
#include <trainkit/storage/replicated-inl.hpp>
#include <trainkit/storage/sharded_slices-inl.hpp>
#include <trainkit/storage/sharded_units-inl.hpp>
#include <trainkit/storage/sharded_update-inl.hpp>
#include <trainkit/storage/storage_base-inl.hpp>
#include <trainkit/storage/storage_core-inl.hpp>
#include <trainkit/trainer/forward_peaks-inl.hpp>
#include <trainkit/trainer/recompute-inl.hpp>
#include <trainkit/trainer/trainer_core-inl.hpp>
// The parallel/ layer, where trainkit::compiled found Gloo's headers (detail/inline.hpp) and this
// LibTorch has Gloo.
#ifdef TRAINKIT_COMPILED_PARALLEL
#include <trainkit/parallel/heartbeat-inl.hpp>
#ifdef USE_C10D_GLOO  // (without it, process_group.hpp refuses to compile in any mode)
#include <trainkit/parallel/data_parallel-inl.hpp>
#include <trainkit/parallel/process_group-inl.hpp>
#endif
#endif
