#pragma once
/// The definitions of trainkit/accumulation.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/accumulation.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE void save_window_state(torch::serialize::OutputArchive& archive, const WindowState& state) {
  write_value(archive, "window.position", state.position);
  write_value(archive, "window.items", state.items);
  write_value(archive, "window.reference", state.reference);
  write_value(archive, "window.counted", state.counted);
  write_value(archive, "window.seen_items", state.seen_items);
  write_value(archive, "window.seen_batches", state.seen_batches);
}

TRAINKIT_INLINE WindowState load_window_state(torch::serialize::InputArchive& archive) {
  WindowState s{};
  s.position = read_value(archive, "window.position").toInt();
  s.items = read_value(archive, "window.items").toInt();
  s.reference = read_value(archive, "window.reference").toDouble();
  s.counted = read_value(archive, "window.counted").toBool();
  c10::IValue seen;  // (absent from older checkpoints: the running mean starts again)
  if (archive.try_read("window.seen_items", seen)) s.seen_items = seen.toInt();
  if (archive.try_read("window.seen_batches", seen)) s.seen_batches = seen.toInt();
  return s;
}

}  // namespace trainkit::detail
