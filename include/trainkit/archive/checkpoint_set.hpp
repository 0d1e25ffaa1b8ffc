#pragma once
/// A checkpoint as a set of files that no rank gathers (docs/design/checkpoints.md, "Sharded
/// sets"). Named after its index `<name>` (what a single-file checkpoint is named):
///   <name>.<rank:05d>-of-<world:05d>.safetensors   each rank's pieces of the tensor records
///                                                  (ShardedWrites), safetensors with the
///                                                  pieces' places in its __metadata__
///   <name>.records                                 the main rank's other records (a torch
///                                                  archive: the loop's state, values, callbacks)
///   <name>                                         the index (JSON): every tensor record's
///                                                  dtype, shape and chunks, each with its file,
///                                                  safetensors key, first element, byte range
///                                                  and CRC-32
/// The index is written last, once every rank's file is in place (the main rank reads their
/// headers): a set exists only once its index does. Every file is written atomically (as a
/// single checkpoint is), so a crash at any instant leaves the previous sets whole.
#include <trainkit/detail/inline.hpp>
#include <trainkit/archive/checkpoint_io.hpp>
#include <trainkit/archive/record_shards.hpp>

#include <torch/serialize/archive.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace trainkit::detail {

/// A save's token as the files carry it (16 hexadecimal digits).
std::string token_text(std::uint64_t token);

/// Rank `rank`'s file of the set `name`.
std::string shard_path(const std::string& name, std::int64_t rank, std::int64_t world);
/// The main rank's records file of the set `name`.
std::string records_path(const std::string& name);

/// Writes `chunks` as rank `rank`'s file of the set `name` (atomically); `token` marks the save
/// (a file of an earlier attempt at the same name has another). Returns the file's size.
std::size_t write_shard(const std::string& name, std::int64_t rank, std::int64_t world, std::uint64_t token,
                        const std::vector<RecordChunk>& chunks);

/// The main rank, after its own files: waits until every rank's file of the set `name` with
/// `token` is in place (polling the directory: ranks share it), then writes the index from
/// their headers. Stops with an error when `cancel` becomes true or after `timeout_s` seconds
/// without every file. Returns the set's size in bytes.
std::size_t write_index(const std::string& name, std::int64_t world, std::uint64_t token,
                        const std::atomic<bool>& cancel, double timeout_s);
/// (After a second stop signal, write_index waits this long for the other ranks' files.)
inline constexpr double kSetGraceAfterSignal = 10;

/// Opens the checkpoint `path` for reading into `archive`: a single archive (read_archive), or a
/// set's index, whose records file goes into `archive` and whose tensor records the returned
/// source holds (read them inside a ShardReads scope). Throws DamagedArchive for damage.
std::shared_ptr<ShardSource> open_checkpoint_file(torch::serialize::InputArchive& archive, const std::string& path);

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/archive/checkpoint_set-inl.hpp>
#endif
