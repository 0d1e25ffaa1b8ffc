#pragma once
/// Umbrella header: the core of trainkit (policies, trainer, optimizers, schedules, JSON
/// configurations and dispatch to compiled trainers).
/// Optional parts (YAML configs, distributed training, TensorBoard logs) have their own
/// headers and are not pulled in here.
#include <trainkit/version.hpp>
#include <trainkit/options.hpp>
#include <trainkit/precision.hpp>
#include <trainkit/accumulation.hpp>
#include <trainkit/clip.hpp>
#include <trainkit/optim.hpp>
#include <trainkit/schedule.hpp>
#include <trainkit/trainer.hpp>
#include <trainkit/config.hpp>
#include <trainkit/dispatch.hpp>
