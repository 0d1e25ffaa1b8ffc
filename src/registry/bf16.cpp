// The registry's BF16 shard: make_trainer's trainers of this precision (registry.hpp).
#include <trainkit/detail/registry_shard.hpp>

TRAINKIT_REGISTRY_SHARD(BF16)
