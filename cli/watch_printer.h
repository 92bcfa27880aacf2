// Renders a job's event stream for `lockstepctl watch`: event lines, a throttled or live progress
// line, and the summary when the job ends. Holds no RPC state, so it can be fed events directly.
#pragma once

#include <ostream>
#include <string>

#include "absl/time/time.h"
#include "cli/format.h"
#include "common/clock.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep::cli {

// Table output:
// - STATE and MEMBERSHIP events print one timestamped line each (FormatEventLine).
// - PROGRESS events, when `live`, rewrite one line in place ("\r", the line, clear to end of
//   line); other lines are printed above it and it is redrawn below them. When not `live`, a
//   progress line is printed at most once per `clock` second; the newest one held back is
//   printed before the next event line and at the end, so the last progress is always shown.
// JSON output: every event is printed as one JSON document on one line, nothing is throttled.
// Not thread-safe; one printer per watch.
class WatchPrinter {
 public:
  WatchPrinter(OutputFormat format, bool live, Clock* clock, absl::TimeZone tz, std::ostream& out);

  void OnEvent(const v1::JobEvent& event);

  // Ends an open live line (or prints held-back progress), so that text written elsewhere (a
  // retry note or an error on stderr) starts on a line of its own and after the last progress.
  // A live progress line is redrawn by the next PROGRESS event.
  void BreakLine();

  // Flushes held-back progress and ends the live line; then, for table output, prints the final
  // summary of `job` (FormatFinalSummary).
  void Finish(const v1::Job& job);

 private:
  void PrintProgress(const std::string& line);
  void FlushHeldProgress();

  const OutputFormat format_;
  const bool live_;
  Clock* const clock_;
  const absl::TimeZone tz_;
  std::ostream& out_;

  std::string last_progress_;    // newest progress line seen, printed or not
  bool progress_held_ = false;   // not live: last_progress_ has not been printed yet
  bool live_line_open_ = false;  // live: the cursor sits at the end of the progress line
  absl::Time last_progress_print_ = absl::InfinitePast();
};

}  // namespace lockstep::cli
