#pragma once
/// Umbrella header: the core of trainkit (policies, trainer, optimizers, schedules).
/// Optional parts have their own headers and are not pulled in here.
#include <trainkit/version.hpp>
#include <trainkit/schedule.hpp>
