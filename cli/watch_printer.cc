// Watch output. Replaying a long history delivers thousands of PROGRESS events at once; the
// throttle (or the in-place live line) keeps that to a screenful.
#include "cli/watch_printer.h"

#include "absl/status/statusor.h"
#include "common/proto_json.h"

namespace lockstep::cli {
namespace {

constexpr absl::Duration kProgressInterval = absl::Seconds(1);
constexpr char kClearToEndOfLine[] = "\x1b[K";

}  // namespace

WatchPrinter::WatchPrinter(OutputFormat format, bool live, Clock* clock, absl::TimeZone tz,
                           std::ostream& out)
    : format_(format), live_(live), clock_(clock), tz_(tz), out_(out) {}

void WatchPrinter::OnEvent(const v1::JobEvent& event) {
  if (format_ == OutputFormat::kJson) {
    absl::StatusOr<std::string> json = ToJson(event, /*multiline=*/false);
    // A JobEvent always serializes; should it not, a note beats a silently dropped event.
    out_ << (json.ok() ? *json : "{\"error\":\"event not serializable\"}\n") << std::flush;
    return;
  }
  if (event.kind() == v1::JobEvent::PROGRESS) {
    PrintProgress(FormatProgress(event.job()));
    return;
  }
  const std::string line = FormatEventLine(event, tz_);
  if (live_) {
    if (live_line_open_ && IsTerminal(event.job().state())) {
      // Keep the final progress on screen above the terminal state line.
      out_ << "\n" << line << "\n";
      live_line_open_ = false;
    } else if (live_line_open_) {
      out_ << "\r" << line << kClearToEndOfLine << "\n" << last_progress_ << kClearToEndOfLine;
    } else {
      out_ << line << "\n";
    }
  } else {
    FlushHeldProgress();
    out_ << line << "\n";
  }
  out_ << std::flush;
}

void WatchPrinter::PrintProgress(const std::string& line) {
  last_progress_ = line;
  if (live_) {
    out_ << "\r" << line << kClearToEndOfLine << std::flush;
    live_line_open_ = true;
    return;
  }
  const absl::Time now = clock_->Now();
  if (now - last_progress_print_ >= kProgressInterval) {
    out_ << line << "\n" << std::flush;
    last_progress_print_ = now;
    progress_held_ = false;
  } else {
    progress_held_ = true;
  }
}

void WatchPrinter::FlushHeldProgress() {
  if (!progress_held_) return;
  out_ << last_progress_ << "\n";
  progress_held_ = false;
  last_progress_print_ = clock_->Now();
}

void WatchPrinter::BreakLine() {
  if (live_line_open_) {
    out_ << "\n";
    live_line_open_ = false;
  }
  FlushHeldProgress();
  out_ << std::flush;
}

void WatchPrinter::Finish(const v1::Job& job) {
  if (format_ == OutputFormat::kJson) return;
  BreakLine();
  out_ << FormatFinalSummary(job, clock_->Now()) << std::flush;
}

}  // namespace lockstep::cli
