// The registry's FP16Dynamic shard: make_trainer's trainers of this precision (registry.hpp).
#include <trainkit/detail/registry_shard.hpp>

TRAINKIT_REGISTRY_SHARD(FP16Dynamic)
