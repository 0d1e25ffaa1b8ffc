#pragma once
// SIGINT / SIGTERM during fit(): the first sets a flag that the loop polls (it then finishes the
// current window, or with several ranks runs to the next log window, writes a checkpoint and
// returns); a second exits at once. The handler only
// stores a sig_atomic_t, write(2)s a fixed message and, the second time, _exit()s: nothing else
// is async-signal-safe.
#include <csignal>

#include <signal.h>
#include <unistd.h>

namespace trainkit::detail {

inline volatile std::sig_atomic_t stop_signal_received = 0;

inline void write_stderr(const char* text, std::size_t size) {
  // Nothing can be done about a failed write in a signal handler.
  [[maybe_unused]] const auto n = ::write(2, text, size);
}

inline void on_stop_signal(int sig) {
  if (stop_signal_received != 0) {
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

/// RAII: installs the handler for SIGINT and SIGTERM, restores the previous handlers on exit.
class StopSignals {
 public:
  explicit StopSignals(bool install) : installed_(install) {
    stop_signal_received = 0;
    if (!installed_) return;
    struct sigaction action {};
    action.sa_handler = &on_stop_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;  // the loop's system calls (file writes) carry on
    ::sigaction(SIGINT, &action, &previous_int_);
    ::sigaction(SIGTERM, &action, &previous_term_);
  }
  ~StopSignals() {
    if (!installed_) return;
    ::sigaction(SIGINT, &previous_int_, nullptr);
    ::sigaction(SIGTERM, &previous_term_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  /// The signal received (0: none).
  int received() const { return stop_signal_received; }

 private:
  bool installed_;
  struct sigaction previous_int_ {}, previous_term_ {};
};

}  // namespace trainkit::detail
