// The registry's FP32 shard: make_trainer's trainers of this precision (registry.hpp).
#include <trainkit/detail/registry_shard.hpp>

TRAINKIT_REGISTRY_SHARD(FP32)
