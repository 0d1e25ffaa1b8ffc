#pragma once
/// Umbrella header: the core of trainkit (policies, trainer, optimizers, schedules, JSON
/// configurations, the registry of compiled trainers: make_trainer needs trainkit::registry
/// at link time) and the fit loop with its checkpoints, metrics and logs (the log writers need nothing beyond the standard library).
/// Optional parts (YAML configs, distributed training) have their own headers and are not
/// pulled in here; the log writers (log/tensorboard.hpp ...) are usable on their own.
#include <trainkit/version.hpp>
#include <trainkit/step/tags.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/step/precision.hpp>
#include <trainkit/step/accumulation.hpp>
#include <trainkit/step/clip.hpp>
#include <trainkit/step/optim.hpp>
#include <trainkit/step/schedule.hpp>
#include <trainkit/trainer/any_trainer.hpp>
#include <trainkit/storage/storage.hpp>
#include <trainkit/storage/master_storage.hpp>
#include <trainkit/trainer/trainer.hpp>
#include <trainkit/trainer/trainer_key.hpp>
#include <trainkit/config/config.hpp>
#include <trainkit/fit/fit_options.hpp>
#include <trainkit/run/plan.hpp>
#include <trainkit/run/registry.hpp>
#include <trainkit/run/dispatch.hpp>
#include <trainkit/fit/metrics.hpp>
#include <trainkit/fit/checkpoint.hpp>
#include <trainkit/fit/fit.hpp>
#include <trainkit/fit/callbacks.hpp>
#include <trainkit/fit/loss_loggers.hpp>
#include <trainkit/trainer/recompute.hpp>
#include <trainkit/trainer/unit.hpp>
#include <trainkit/fit/memory.hpp>
#include <trainkit/io/weights.hpp>
