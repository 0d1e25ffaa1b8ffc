#pragma once
/// Parameter storage: where a trainer's parameters, gradients, fp32 masters and optimizer
/// state live. The precision policy chooses it (`Precision::storage`, built with
/// `Precision::storage_dtype`): FlatStorage (flat_storage.hpp) for FP32, BF16 and FP16,
/// MasterStorage (master_storage.hpp) for PrecisionPolicy<MasterWeights<T>>. Everything that
/// depends on where a parameter's gradient, master copy and update live is a storage's; the
/// trainer's step calls the same members whatever the storage is. Where the buffers live over
/// the ranks is the storage's sharding mode (mode.hpp), chosen once when the replicas are
/// attached; both storages hold one of the same three (Replicated, ShardedUpdate with
/// ShardedGradients, ShardedUnits), and every call below goes to it.
///
/// Contract — what the trainer calls, and when (every rank makes the same calls in the same order):
///   Storage(model, options, device, dtype)
///                                     at construction: the trainable parameters become views
///                                     into one flat buffer (parameters()), 64-byte aligned and
///                                     grouped by LR multiplier and weight decay (groups());
///                                     their .grad become views of the storage's gradient. The
///                                     mode is Replicated
///   attach(replicas, model) -> bool   Trainer::set_replicas: the mode chosen for the replicas
///                                     (TrainerOptions::sharding, with more than one rank), every
///                                     rank takes rank 0's values, and the buffers are cut for
///                                     the mode (detail::Partition). True when the update is
///                                     sharded: the optimizer's state then covers state_numel()
///                                     local elements
///   backward_begins(done)             before each backward (micro-step phase 3), told what
///                                     backward_done() will be: a reduction may start during it
///   backward_done(done)               after each backward (detail::BackwardDone: whether the
///                                     optimizer phase follows, whether the micro-batch ends,
///                                     the window's weights so far)
///   reduce(replicas, window)          optimizer phase 5: the gradient summed over the ranks;
///                                     returns the factor that makes it the window's mean
///   norm()                            phases 6-7: the global L2 norm of the still-scaled
///                                     gradient (a device scalar, no host sync)
///   update(f)                         phase 9: f(groups, gradient) once per part of the flat
///                                     buffer this rank updates (the whole, a chunk, a slice);
///                                     after it, the model's parameters hold the update on
///                                     every rank
///   zero()                            phase 11 (and a dropped window)
///   check()                           once per window: the model's parameters and their .grad
///                                     are still the storage's views
///   save(archive, module, rule) / load(archive, module, rule)
///                                     the parameters (fp32 masters where they exist) and the
///                                     rule's flat state, one record per parameter name and
///                                     kind; sharded, save() gathers every rank's slices to the
///                                     main rank (a collective: every rank calls it), or inside
///                                     a checkpoint set writes this rank's pieces
///   snapshot(archive, module, rule) / restore(archive, module, rule)
///                                     this rank's own buffers as they are, no collective (the
///                                     rollback of a failed load)
///   save_window / load_window         the open window's gradient, for a checkpoint inside one
///   after_load()                      once every rank has loaded (stage 3: the root unit)
/// and, for ZeRO stage 3's units (the other modes answer with nothing): begin_forward() (the
/// schedule the forward's tk::unit calls use), hold_parameters, evaluate_by_unit,
/// check_loadable.
/// Guarantees: the gaps between parameters and the partition's padding are zeros in every flat
/// buffer (they change no norm and no update); the gradient exists in fp32 (whole, in chunks or
/// as this rank's slices) inside the phase.
#include <trainkit/storage/flat_storage.hpp>
#include <trainkit/storage/master_storage.hpp>
