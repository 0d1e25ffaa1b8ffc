#pragma once
/// The definitions of trainkit/fit/stop_signals.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/fit/stop_signals.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE void write_stderr(const char* text, std::size_t size) {
  // Nothing can be done about a failed write in a signal handler.
  [[maybe_unused]] const auto n = ::write(2, text, size);
}

TRAINKIT_INLINE void on_stop_signal(int sig) {
  if (stop_signal_received != 0) {
    auto& writes = exit_after_writes();
    writes.exit_signal.store(sig);
    if (writes.writing.load() > 0) {  // (the writer exits once its file is complete)
      static const char msg[] =
          "\ntrainkit: second signal: exiting now, without a checkpoint (once the one being written is complete)\n";
      write_stderr(msg, sizeof msg - 1);
      return;
    }
    static const char msg[] = "\ntrainkit: second signal: exiting now, without a checkpoint\n";
    write_stderr(msg, sizeof msg - 1);
    ::_exit(128 + sig);
  }
  stop_signal_received = sig;
  static const char msg[] =
      "\ntrainkit: stop requested: finishing the current window (data parallel: up to the next "
      "log window, where the ranks agree), then writing a checkpoint (send the signal again to "
      "exit at once)\n";
  write_stderr(msg, sizeof msg - 1);
}

TRAINKIT_INLINE StopSignals::StopSignals(bool install)
    : installed_(install) {
  stop_signal_received = 0;
  exit_after_writes().exit_signal.store(0);
  if (!installed_) return;
  struct sigaction action {};
  action.sa_handler = &on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // the loop's system calls (file writes) carry on
  ::sigaction(SIGINT, &action, &previous_int_);
  ::sigaction(SIGTERM, &action, &previous_term_);
}

TRAINKIT_INLINE StopSignals::~StopSignals() {
  if (!installed_) return;
  ::sigaction(SIGINT, &previous_int_, nullptr);
  ::sigaction(SIGTERM, &previous_term_, nullptr);
}

}  // namespace trainkit::detail
