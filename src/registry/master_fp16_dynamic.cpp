// The registry's MasterWeights<FP16Dynamic> shard: make_trainer's trainers of this precision (registry.hpp).
#include <trainkit/detail/registry_shard.hpp>

TRAINKIT_REGISTRY_SHARD(MasterWeights<FP16Dynamic>)
