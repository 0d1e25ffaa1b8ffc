#pragma once
/// Umbrella header: the core of trainkit (policies, trainer, optimizers, schedules, JSON
/// configurations, the registry of compiled trainers: make_trainer needs trainkit::registry
/// at link time) and the fit loop with its checkpoints, metrics and logs (the log writers need nothing beyond the standard library).
/// Optional parts (YAML configs, distributed training) have their own headers and are not
/// pulled in here; the log writers (log/tensorboard.hpp ...) are usable on their own.
#include <trainkit/version.hpp>
#include <trainkit/tags.hpp>
#include <trainkit/options.hpp>
#include <trainkit/precision.hpp>
#include <trainkit/accumulation.hpp>
#include <trainkit/clip.hpp>
#include <trainkit/optim.hpp>
#include <trainkit/schedule.hpp>
#include <trainkit/any_trainer.hpp>
#include <trainkit/storage.hpp>
#include <trainkit/master_storage.hpp>
#include <trainkit/trainer.hpp>
#include <trainkit/trainer_key.hpp>
#include <trainkit/config.hpp>
#include <trainkit/fit_options.hpp>
#include <trainkit/plan.hpp>
#include <trainkit/registry.hpp>
#include <trainkit/dispatch.hpp>
#include <trainkit/metrics.hpp>
#include <trainkit/checkpoint.hpp>
#include <trainkit/fit.hpp>
#include <trainkit/callbacks.hpp>
#include <trainkit/loss_loggers.hpp>
#include <trainkit/recompute.hpp>
#include <trainkit/memory.hpp>
