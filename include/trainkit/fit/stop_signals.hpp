#pragma once
// SIGINT / SIGTERM during fit(): the first sets a flag that the loop polls (it then finishes the
// current window, or with several ranks runs to the next log window, writes a checkpoint and
// returns); a second exits at once. The handler only
// stores a sig_atomic_t, write(2)s a fixed message and, the second time, _exit()s: nothing else
// is async-signal-safe.
#include <trainkit/detail/inline.hpp>
#include <trainkit/archive/checkpoint_io.hpp>
#include <csignal>

#include <signal.h>
#include <unistd.h>

namespace trainkit::detail {

inline volatile std::sig_atomic_t stop_signal_received = 0;

void write_stderr(const char* text, std::size_t size);

void on_stop_signal(int sig);

/// RAII: installs the handler for SIGINT and SIGTERM, restores the previous handlers on exit.
class StopSignals {
 public:
  explicit StopSignals(bool install);
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  /// The signal received (0: none).
  int received() const { return stop_signal_received; }

 private:
  bool installed_;
  struct sigaction previous_int_ {}, previous_term_ {};
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/fit/stop_signals-inl.hpp>
#endif
