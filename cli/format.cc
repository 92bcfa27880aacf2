// Text rendering for lockstepctl. Views never read the clock: `now` comes from the caller, so the
// same job always renders the same way in a test.
#include "cli/format.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/clock.h"
#include "common/model_family.h"
#include "common/utf8.h"

namespace lockstep::cli {
namespace {

constexpr char kNone[] = "-";

// "0.5123", or "-" before the first step has reported a loss.
std::string LossOrNone(const v1::Job& job) {
  return job.step() > 0 ? absl::StrFormat("%.4f", job.loss()) : kNone;
}

std::string StepOfTotal(const v1::Job& job) {
  if (job.total_steps() <= 0) return absl::StrCat(job.step());
  return absl::StrCat(job.step(), "/", job.total_steps());
}

std::string OrNone(const std::string& s) { return s.empty() ? kNone : s; }

// "2024-05-01 12:00:00 (3m12s ago)" in `tz`, or "-" for an unset timestamp.
std::string FormatTimestamp(int64_t unix_ms, absl::Time now, absl::TimeZone tz) {
  if (unix_ms <= 0) return kNone;
  const absl::Time t = absl::FromUnixMillis(unix_ms);
  return absl::StrCat(absl::FormatTime("%Y-%m-%d %H:%M:%S", t, tz), " (", ShortDuration(now - t),
                      " ago)");
}

// One "Label:  value" line of the status block, labels padded to one column.
void AddField(std::string& out, absl::string_view label, absl::string_view value) {
  absl::StrAppendFormat(&out, "%-20s%s\n", absl::StrCat(label, ":"),
                        EscapeForTerminal(std::string_view(value.data(), value.size())));
}

}  // namespace

std::string ShortDuration(absl::Duration d) {
  if (d < absl::ZeroDuration()) d = absl::ZeroDuration();
  const int64_t ms = absl::ToInt64Milliseconds(d);
  if (ms < 1000) return absl::StrCat(ms, "ms");
  if (ms < 10'000) return absl::StrFormat("%d.%ds", ms / 1000, (ms % 1000) / 100);
  const int64_t s = ms / 1000;
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  if (s < 86400) return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
  return absl::StrFormat("%dd%02dh", s / 86400, (s % 86400) / 3600);
}

std::string ShortMillis(int64_t ms) { return ShortDuration(absl::Milliseconds(ms)); }

std::string FormatThousands(int64_t n) {
  // Work on the magnitude as unsigned so INT64_MIN does not overflow.
  const bool negative = n < 0;
  uint64_t magnitude = negative ? 0 - static_cast<uint64_t>(n) : static_cast<uint64_t>(n);
  std::string digits = absl::StrCat(magnitude);
  std::string out;
  const size_t first_group = digits.size() % 3 == 0 ? 3 : digits.size() % 3;
  out.append(digits, 0, first_group);
  for (size_t i = first_group; i < digits.size(); i += 3) {
    out.push_back(',');
    out.append(digits, i, 3);
  }
  return negative ? absl::StrCat("-", out) : out;
}

std::string JobStateName(v1::JobState state) {
  if (!v1::JobState_IsValid(state)) return absl::StrCat("STATE_", static_cast<int>(state));
  absl::string_view name = v1::JobState_Name(state);
  absl::ConsumePrefix(&name, "JOB_STATE_");
  return std::string(name);
}

Table::Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }

void Table::AddRow(std::vector<std::string> row) {
  row.resize(rows_.front().size());
  for (std::string& cell : row) cell = EscapeForTerminal(cell);
  rows_.push_back(std::move(row));
}

std::string Table::Render(const std::string& indent) const {
  const size_t columns = rows_.front().size();
  std::vector<size_t> widths(columns, 0);
  for (const auto& row : rows_) {
    for (size_t c = 0; c < columns; ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows_) {
    std::string line = indent;
    for (size_t c = 0; c < columns; ++c) {
      line += row[c];
      if (c + 1 < columns) line.append(widths[c] - row[c].size() + 2, ' ');
    }
    // An empty last cell would otherwise leave the padding of the one before it.
    absl::StripTrailingAsciiWhitespace(&line);
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

absl::Duration JobDuration(const v1::Job& job, absl::Time now) {
  const absl::Time submit = FromUnixMillisOrInfinitePast(job.submit_time_unix_ms());
  const absl::Time start = FromUnixMillisOrInfinitePast(job.start_time_unix_ms());
  const absl::Time end =
      job.end_time_unix_ms() > 0 ? absl::FromUnixMillis(job.end_time_unix_ms()) : now;
  const absl::Time from = start != absl::InfinitePast() ? start : submit;
  if (from == absl::InfinitePast()) return absl::ZeroDuration();
  return std::max(end - from, absl::ZeroDuration());
}

std::string FormatProgress(const v1::Job& job) {
  std::string out = absl::StrCat("step ", StepOfTotal(job));
  if (job.total_steps() > 0) {
    const double percent =
        100.0 * static_cast<double>(job.step()) / static_cast<double>(job.total_steps());
    absl::StrAppendFormat(&out, " (%.1f%%)", percent);
  }
  if (job.step() > 0) {
    absl::StrAppendFormat(&out, "  loss %.4f", job.loss());
    if (job.tokens_per_second() > 0) {
      absl::StrAppend(&out, "  ", FormatThousands(std::llround(job.tokens_per_second())),
                      " tokens/s");
    } else if (job.samples_per_second() > 0) {
      absl::StrAppend(&out, "  ", FormatThousands(std::llround(job.samples_per_second())),
                      " samples/s");
    }
    if (job.validation_history_size() > 0) {
      const v1::EvalResult& e = job.validation_history().rbegin()->eval();
      absl::StrAppendFormat(&out, "  val %.4f", e.test_loss());
      if (e.bits_per_byte() > 0) absl::StrAppendFormat(&out, " (%.3f bpb)", e.bits_per_byte());
    }
  }
  if (job.eta_ms() > 0) absl::StrAppend(&out, "  ETA ", ShortMillis(job.eta_ms()));
  return out;
}

namespace {

std::string FormatValidation(const v1::EvalResult& e) {
  std::string out = absl::StrFormat("%.4f", e.test_loss());
  if (e.bits_per_byte() > 0) absl::StrAppendFormat(&out, " (%.3f bits per byte)", e.bits_per_byte());
  return out;
}

}  // namespace

std::string FormatEval(const v1::Job& job) {
  if (!job.has_eval() || job.eval().test_samples() <= 0) return "";
  if (IsLanguageModel(job.spec().model())) {
    return absl::StrFormat("validation loss %s over %d windows, next-token accuracy %.4f",
                           FormatValidation(job.eval()), job.eval().test_samples(),
                           job.eval().test_accuracy());
  }
  return absl::StrFormat("test accuracy %.4f (%d samples), test loss %.4f",
                         job.eval().test_accuracy(), job.eval().test_samples(),
                         job.eval().test_loss());
}

std::string FormatJobList(const v1::ListJobsResponse& response, absl::Time now) {
  if (response.jobs().empty()) return "No jobs.\n";
  Table table({"JOB", "NAME", "STATE", "PRIORITY", "STEP", "LOSS", "WORKERS", "AGE/DURATION"});
  for (const v1::Job& job : response.jobs()) {
    const absl::Time submit = FromUnixMillisOrInfinitePast(job.submit_time_unix_ms());
    std::string age;
    if (IsTerminal(job.state())) {
      age = ShortDuration(JobDuration(job, now));
    } else {
      age = submit == absl::InfinitePast() ? kNone : ShortDuration(now - submit);
    }
    table.AddRow({job.job_id(), OrNone(job.spec().name()), JobStateName(job.state()),
                  absl::StrCat(job.spec().priority()), StepOfTotal(job), LossOrNone(job),
                  absl::StrCat(job.members_size()), age});
  }
  return table.Render();
}

std::string FormatQueue(const v1::ListJobsResponse& queue, absl::Time now) {
  if (queue.jobs().empty()) return "No queued jobs.\n";
  Table table({"#", "JOB", "NAME", "STATE", "PRIORITY", "WORKERS", "WAITING", "WOULD PREEMPT",
               "WHY"});
  int position = 0;
  for (const v1::Job& job : queue.jobs()) {
    const absl::Time submit = FromUnixMillisOrInfinitePast(job.submit_time_unix_ms());
    table.AddRow({absl::StrCat(++position), job.job_id(), OrNone(job.spec().name()),
                  JobStateName(job.state()), absl::StrCat(job.spec().priority()),
                  absl::StrCat(job.spec().min_workers(), "-", job.spec().max_workers()),
                  submit == absl::InfinitePast() ? kNone : ShortDuration(now - submit),
                  OrNone(job.would_preempt()), job.reason()});
  }
  return table.Render();
}

namespace {

// The detail's member table.
void AppendMembers(const v1::Job& job, std::string& out) {
  if (job.members_size() > 0) {
    out += "Members:\n";
    Table members({"RANK", "WORKER", "NAME", "HOST", "STEP", "CHECKSUM", "PEAK MEMORY"});
    for (const v1::Member& m : job.members()) {
      members.AddRow({absl::StrCat(m.rank()), m.worker_id(), OrNone(m.worker_name()),
                      OrNone(m.host()), absl::StrCat(m.step()), OrNone(m.parameter_checksum()),
                      m.peak_memory_bytes() > 0 ? HumanBytes(m.peak_memory_bytes()) : kNone});
    }
    out += members.Render("  ");
  }
}

// The evaluation, its history, the export and the sample.
void AppendResults(const v1::Job& job, std::string& out) {
  const std::string eval = FormatEval(job);
  if (!eval.empty() && IsLanguageModel(job.spec().model())) {
    AddField(out, "Validation loss",
             absl::StrFormat("%s over %d windows", FormatValidation(job.eval()),
                             job.eval().test_samples()));
    AddField(out, "Next-token accuracy", absl::StrFormat("%.4f", job.eval().test_accuracy()));
  } else if (!eval.empty()) {
    AddField(out, "Test accuracy",
             absl::StrFormat("%.4f (%d samples)", job.eval().test_accuracy(),
                             job.eval().test_samples()));
    AddField(out, "Test loss", absl::StrFormat("%.4f", job.eval().test_loss()));
  }
  if (job.validation_history_size() > 0) {
    std::string history;
    for (const v1::ValidationPoint& p : job.validation_history()) {
      absl::StrAppend(&history, history.empty() ? "" : ", ", "step ", p.step(), " ",
                      absl::StrFormat("%.4f", p.eval().test_loss()));
    }
    AddField(out, "Validation history", history);
  }
  if (job.train_tokens_per_second() > 0) {
    AddField(out, "Training tokens/s", FormatThousands(std::llround(job.train_tokens_per_second())));
  }
  if (!job.export_path().empty()) AddField(out, "Exported", job.export_path());
  if (!job.export_error().empty()) {
    AddField(out, "Export failed", EscapeForTerminal(job.export_error()));
  }
  if (!job.sample_error().empty()) AddField(out, "No sample", EscapeForTerminal(job.sample_error()));
  if (job.has_sample()) {
    if (!job.sample().text().empty()) {
      // The model's text (or whatever rank 0 sent): its lines, with control bytes escaped.
      out += "Sample:\n";
      for (absl::string_view line : absl::StrSplit(job.sample().text(), '\n')) {
        absl::StrAppend(&out, "  | ", EscapeForTerminal(std::string_view(line.data(), line.size())), "\n");
      }
    } else {
      AddField(out, "Sample tokens", absl::StrJoin(job.sample().tokens(), " "));
    }
  }
}

// The recoveries, and each membership change with its timings.
void AppendRecoveries(const v1::Job& job, std::string& out) {
  AddField(out, "Recoveries",
           job.spec().has_max_restarts() ? absl::StrFormat("%d (max_restarts %d)", job.recoveries(),
                                                           job.spec().max_restarts())
                                         : absl::StrCat(job.recoveries()));
  if (job.recovery_history_size() > 0) {
    // Each re-formation with its timings: detect -> re-formed -> first step, and the heal.
    out += "Membership changes:\n";
    Table changes(
        {"GEN", "KIND", "RE-FORM", "HEAL", "FIRST STEP", "RESUMED AFTER", "REDONE", "REASON"});
    for (const v1::Recovery& r : job.recovery_history()) {
      const bool reformed = r.reformed_unix_ms() > 0;
      const bool trained = r.first_step_unix_ms() > 0;
      changes.AddRow({absl::StrCat(r.from_generation(), "->",
                                   r.to_generation() > 0 ? absl::StrCat(r.to_generation()) : "?"),
                      r.scale_up()             ? "scale-up"
                      : r.coordinator_caused() ? "coordinator"
                                               : "recovery",
                      reformed ? ShortMillis(r.reformed_unix_ms() - r.detect_unix_ms()) : kNone,
                      !trained                   ? kNone
                      : r.restored_from().empty() ? ShortMillis(r.heal_ms())
                                                  : absl::StrCat(ShortMillis(r.heal_ms()), " (",
                                                                 r.restored_from(), ")"),
                      trained ? ShortMillis(r.first_step_unix_ms() - r.detect_unix_ms()) : kNone,
                      trained ? absl::StrCat("step ", r.resumed_from_step()) : kNone,
                      trained ? absl::StrCat(r.steps_redone_lower_bound() ? ">=" : "",
                                             r.steps_redone())
                              : kNone,
                      r.reason()});
    }
    out += changes.Render("  ");
    // How the state came back, in words (program jobs: peers' copies, or why none).
    for (const v1::Recovery& r : job.recovery_history()) {
      if (r.restore_detail().empty()) continue;
      absl::StrAppend(&out, "  ", r.from_generation(), "->", r.to_generation(),
                      " restore: ", r.restore_detail(), "\n");
    }
  }
}

// A program job's command and the processes that failed: rank, worker, exit code or signal,
// what stderr said, and the latest failure's last stderr lines.
void AppendProgram(const v1::Job& job, std::string& out) {
  if (!job.spec().has_program()) return;
  const v1::ProgramSpec& program = job.spec().program();
  AddField(out, "Program",
           EscapeForTerminal(absl::StrCat(absl::StrJoin(program.argv(), " "), " (in ",
                                          program.workdir(), ")")));
  if (job.program_exits_size() == 0) return;
  out += "Program failures:\n";
  Table failures({"GEN", "RANK", "WORKER", "EXIT", "SUMMARY"});
  for (const v1::ProgramExit& e : job.program_exits()) {
    failures.AddRow({absl::StrCat(e.generation()), absl::StrCat(e.rank()),
                     EscapeForTerminal(e.worker()),
                     e.signal().empty() ? absl::StrCat("code ", e.exit_code()) : e.signal(),
                     EscapeForTerminal(e.summary().empty() ? std::string(kNone) : e.summary())});
  }
  out += failures.Render("  ");
  const v1::ProgramExit& last = *job.program_exits().rbegin();
  if (!last.stderr_tail().empty()) {
    absl::StrAppend(&out, "Last failure's stderr (rank ", last.rank(), ", generation ",
                    last.generation(), "):\n");
    for (absl::string_view line : absl::StrSplit(last.stderr_tail(), '\n')) {
      absl::StrAppend(&out, "  | ", EscapeForTerminal(std::string_view(line.data(), line.size())),
                      "\n");
    }
  }
}

void AppendCheckpoints(const v1::Job& job, absl::Time now, absl::TimeZone tz, std::string& out) {
  if (job.spec().checkpoint_every_steps() > 0 || job.has_checkpoints()) {
    const v1::CheckpointStatus& c = job.checkpoints();
    std::string text =
        c.last_good_step() > 0
            ? absl::StrCat("last good at step ", c.last_good_step(), " (", c.last_good_path(),
                           ", ", FormatTimestamp(c.last_good_unix_ms(), now, tz), ")")
            : std::string("none written yet");
    if (c.failed_writes() > 0) {
      absl::StrAppend(&text, "; ", c.failed_writes(), " write", c.failed_writes() == 1 ? "" : "s",
                      " failed, the last at step ", c.last_failed_step(), ": ", c.last_error());
    }
    AddField(out, "Checkpoints", text);
  }
}

}  // namespace

std::string FormatJobDetail(const v1::Job& job, absl::Time now, absl::TimeZone tz) {
  std::string out;
  AddField(out, "Job", job.job_id());
  AddField(out, "Name", OrNone(job.spec().name()));
  AddField(out, "State", JobStateName(job.state()));
  AddField(out, "Priority", absl::StrCat(job.spec().priority()));
  if (!job.reason().empty()) AddField(out, "Reason", job.reason());
  if (job.has_suspension()) {
    const v1::Suspension& s = job.suspension();
    const absl::Time since = FromUnixMillisOrInfinitePast(s.since_unix_ms());
    AddField(out, "Suspended",
             absl::StrCat(s.by_user() ? "by a user" : absl::StrCat("for ", s.by_job()),
                          since == absl::InfinitePast()
                              ? ""
                              : absl::StrCat(", ", ShortDuration(now - since), " ago"),
                          ", at step ", s.step(), "; state kept by ",
                          s.holders().empty() ? std::string("nobody")
                                              : absl::StrJoin(s.holders(), ", ")));
  }
  if (job.suspended_ms() > 0) {
    AddField(out, "Time suspended", ShortDuration(absl::Milliseconds(job.suspended_ms())));
  }
  AddField(out, "Generation", absl::StrCat(job.generation()));
  AddField(out, "Workers",
           absl::StrFormat("%d (min %d, max %d)", job.members_size(), job.spec().min_workers(),
                           job.spec().max_workers()));
  AppendMembers(job, out);
  std::string step = StepOfTotal(job);
  if (job.total_steps() > 0) {
    absl::StrAppendFormat(
        &step, " (%.1f%%)",
        100.0 * static_cast<double>(job.step()) / static_cast<double>(job.total_steps()));
  }
  AddField(out, "Step", step);
  AddField(out, "Loss", LossOrNone(job));
  AddField(out, "Samples/s",
           job.samples_per_second() > 0 ? FormatThousands(std::llround(job.samples_per_second()))
                                        : kNone);
  if (IsLanguageModel(job.spec().model())) {
    AddField(out, "Tokens/s",
             job.tokens_per_second() > 0 ? FormatThousands(std::llround(job.tokens_per_second()))
                                         : kNone);
  }
  if (!IsTerminal(job.state())) {
    AddField(out, "ETA", job.eta_ms() > 0 ? ShortMillis(job.eta_ms()) : kNone);
  }
  AddField(out, "First-step latency",
           job.first_step_latency_ms() > 0 ? ShortMillis(job.first_step_latency_ms()) : kNone);
  AppendResults(job, out);
  AppendProgram(job, out);
  AppendRecoveries(job, out);
  AppendCheckpoints(job, now, tz, out);
  AddField(out, "Submitted", FormatTimestamp(job.submit_time_unix_ms(), now, tz));
  if (job.start_time_unix_ms() > 0) {
    AddField(out, "Started", FormatTimestamp(job.start_time_unix_ms(), now, tz));
  }
  if (job.end_time_unix_ms() > 0) {
    AddField(out, "Ended", FormatTimestamp(job.end_time_unix_ms(), now, tz));
  }
  if (job.start_time_unix_ms() > 0) {
    AddField(out, "Duration", ShortDuration(JobDuration(job, now)));
  }
  return out;
}

std::string FormatWorkerList(const v1::ListWorkersResponse& response, absl::Time now) {
  std::string out = response.workers().empty() ? "No workers.\n" : "";
  if (!response.workers().empty()) {
    Table table({"WORKER", "NAME", "HOST", "DEVICE", "MEMORY FREE", "STATE", "JOB",
                 "LAST HEARTBEAT"});
    for (const v1::WorkerInfo& w : response.workers()) {
      const std::string heartbeat =
          w.last_heartbeat_unix_ms() > 0
              ? absl::StrCat(ShortDuration(now - absl::FromUnixMillis(w.last_heartbeat_unix_ms())),
                             " ago")
              : kNone;
      // "cuda:0 NVIDIA H200 GPU-8a5d3e1f" (the UUID's first group tells workers that share a
      // GPU apart); memory "139.5 GiB / 140.0 GiB" (free at registration / total).
      std::string device = OrNone(w.device());
      if (!w.device_name().empty() && w.device_name() != w.device()) {
        absl::StrAppend(&device, " ", w.device_name());
      }
      if (!w.device_uuid().empty()) {
        absl::StrAppend(&device, " ", w.device_uuid().substr(0, w.device_uuid().find('-', 4)));
      }
      std::string memory = w.free_memory_bytes() > 0 ? HumanBytes(w.free_memory_bytes()) : kNone;
      if (w.total_memory_bytes() > 0) {
        absl::StrAppend(&memory, " / ", HumanBytes(w.total_memory_bytes()));
      }
      table.AddRow({w.worker_id(), OrNone(w.name()), OrNone(w.host()), device, memory,
                    OrNone(w.state()), OrNone(w.job_id()), heartbeat});
    }
    out += table.Render();
  }
  if (!response.rejected_clients().empty()) {
    out += "\nRejected clients:\n";
    Table rejected({"ADDRESS", "CLIENT", "CALLS", "LAST", "REASON"});
    for (const v1::RejectedClient& r : response.rejected_clients()) {
      rejected.AddRow(
          {r.peer(), OrNone(r.client()), absl::StrCat(r.count()),
           absl::StrCat(ShortDuration(now - absl::FromUnixMillis(r.last_unix_ms())), " ago"),
           r.reason()});
    }
    out += rejected.Render();
  }
  return out;
}

std::string FormatEventLine(const v1::JobEvent& event, absl::TimeZone tz) {
  std::string out;
  if (event.time_unix_ms() > 0) {
    absl::StrAppend(&out, "[",
                    absl::FormatTime("%H:%M:%S", absl::FromUnixMillis(event.time_unix_ms()), tz),
                    "] ");
  }
  absl::StrAppend(&out, event.job().job_id(), " ", JobStateName(event.job().state()));
  // The message is one line by contract; a stray newline would break the live progress line.
  std::string message(absl::StripAsciiWhitespace(event.message()));
  std::replace(message.begin(), message.end(), '\n', ' ');
  message = EscapeForTerminal(message);
  if (!message.empty()) absl::StrAppend(&out, ": ", message);
  return out;
}

std::string FormatFinalSummary(const v1::Job& job, absl::Time now) {
  const std::string duration = ShortDuration(JobDuration(job, now));
  std::string out;
  if (job.state() == v1::JOB_STATE_SUCCEEDED) {
    absl::StrAppend(&out, job.job_id(), " SUCCEEDED in ", duration);
    if (job.step() > 0) absl::StrAppend(&out, " (", job.step(), " steps)");
    out += "\n";
    const std::string eval = FormatEval(job);
    if (!eval.empty()) absl::StrAppend(&out, eval, "\n");
    if (job.train_tokens_per_second() > 0) {
      absl::StrAppend(&out, "training ", FormatThousands(std::llround(job.train_tokens_per_second())),
                      " tokens/s\n");
    }
    if (job.has_sample() && !job.sample().text().empty()) {
      absl::StrAppend(&out, "sample:\n");
      for (absl::string_view line : absl::StrSplit(job.sample().text(), '\n')) {
        absl::StrAppend(&out, EscapeForTerminal(std::string_view(line.data(), line.size())), "\n");
      }
    } else if (job.has_sample()) {
      absl::StrAppend(&out, "sample tokens: ", absl::StrJoin(job.sample().tokens(), " "), "\n");
    }
    if (!job.export_path().empty()) absl::StrAppend(&out, "exported ", job.export_path(), "\n");
    if (!job.export_error().empty()) {
      absl::StrAppend(&out, "export failed: ", EscapeForTerminal(job.export_error()), "\n");
    }
    if (!job.sample_error().empty()) {
      absl::StrAppend(&out, "no sample: ", EscapeForTerminal(job.sample_error()), "\n");
    }
    return out;
  }
  absl::StrAppend(&out, job.job_id(), " ", JobStateName(job.state()), " after ", duration);
  if (!job.reason().empty()) absl::StrAppend(&out, ": ", EscapeForTerminal(job.reason()));
  out += "\n";
  return out;
}

}  // namespace lockstep::cli
