#include "worker/metrics.h"

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "common/process_memory.h"

namespace lockstep::worker {
namespace {

prometheus::Counter& Counter(prometheus::Registry& registry, const std::string& name,
                             const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({});
}

prometheus::Gauge& Gauge(prometheus::Registry& registry, const std::string& name,
                         const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({});
}

}  // namespace

WorkerMetrics::WorkerMetrics(prometheus::Registry& registry, const std::string& name,
                             const std::string& device)
    : step_seconds_(SecondsHistogram(registry, "lockstep_worker_step_seconds",
                                     "Time of one training step (forward, backward, the sum "
                                     "and the update)")),
      exposed_comm_seconds_(SecondsHistogram(
          registry, "lockstep_worker_collective_wait_seconds",
          "Per step, time spent waiting for the group's sum after backward (the part of "
          "communication that backward did not hide)")),
      phase_seconds_(prometheus::BuildCounter()
                         .Name("lockstep_worker_step_phase_seconds_total")
                         .Help("Step time by phase: compute (forward and backward, which the "
                               "sum overlaps), exposed_communication, update")
                         .Register(registry)),
      compute_total_(phase_seconds_.Add({{"phase", "compute"}})),
      exposed_comm_total_(phase_seconds_.Add({{"phase", "exposed_communication"}})),
      update_total_(phase_seconds_.Add({{"phase", "update"}})),
      steps_(Counter(registry, "lockstep_worker_steps_total", "Training steps taken")),
      reduced_bytes_total_(Counter(registry, "lockstep_worker_reduced_bytes_total",
                                   "Bytes handed to the group's gradient sum")),
      reduced_bytes_per_step_(Gauge(registry, "lockstep_worker_reduced_bytes_per_step",
                                    "Bytes each step hands to the group's sum in the current "
                                    "run (0 when training alone)")),
      loss_(Gauge(registry, "lockstep_worker_training_loss",
                  "Mean training loss of the group's last step")),
      samples_per_second_(Gauge(registry, "lockstep_worker_samples_per_second",
                                "The group's training throughput over the last report window")),
      tokens_per_second_(Gauge(registry, "lockstep_worker_tokens_per_second",
                               "Language models: tokens per second over the last report window")),
      runs_(Counter(registry, "lockstep_worker_runs_total",
                    "Generations this worker started training in")),
      aborts_(Counter(registry, "lockstep_worker_aborts_total",
                      "Runs stopped by an abort (a peer lost, the job re-formed or cancelled)")),
      serving_(prometheus::BuildGauge()
                   .Name("lockstep_worker_serving")
                   .Help("The job this worker trains (label job) and its rank (the value); "
                         "absent when idle")
                   .Register(registry)) {
  prometheus::BuildGauge()
      .Name("lockstep_worker_info")
      .Help("This worker's name and device (always 1)")
      .Register(registry)
      .Add({{"name", name}, {"device", device}})
      .Set(1);
}

void WorkerMetrics::BeginRun(const std::string& job_id, int rank, int world,
                             int64_t reduced_bytes) {
  absl::MutexLock lock(&mu_);
  if (serving_gauge_ != nullptr) serving_.Remove(serving_gauge_);
  serving_gauge_ = &serving_.Add({{"job", job_id}, {"world_size", absl::StrCat(world)}});
  serving_gauge_->Set(rank);
  reduced_bytes_ = reduced_bytes;
  reduced_bytes_per_step_.Set(static_cast<double>(reduced_bytes));
  runs_.Increment();
}

void WorkerMetrics::ObserveStep(const StepResult& step) {
  const double compute = absl::ToDoubleSeconds(step.compute);
  const double comm = absl::ToDoubleSeconds(step.exposed_comm);
  const double update = absl::ToDoubleSeconds(step.update);
  step_seconds_.Observe(compute + comm + update);
  exposed_comm_seconds_.Observe(comm);
  compute_total_.Increment(compute);
  exposed_comm_total_.Increment(comm);
  update_total_.Increment(update);
  steps_.Increment();
  reduced_bytes_total_.Increment(static_cast<double>(reduced_bytes_));
  loss_.Set(step.loss);
}

void WorkerMetrics::ObserveProgress(const v1::ProgressReport& progress) {
  if (progress.samples_per_second() > 0) samples_per_second_.Set(progress.samples_per_second());
  if (progress.tokens_per_second() > 0) tokens_per_second_.Set(progress.tokens_per_second());
}

void WorkerMetrics::ObserveProgramReport(const v1::ProgressReport& progress, int64_t new_steps,
                                         bool has_loss) {
  if (new_steps > 0) steps_.Increment(static_cast<double>(new_steps));
  if (has_loss) loss_.Set(progress.loss());
  ObserveProgress(progress);
}

void WorkerMetrics::EndRun(bool aborted) {
  absl::MutexLock lock(&mu_);
  if (serving_gauge_ != nullptr) serving_.Remove(serving_gauge_);
  serving_gauge_ = nullptr;
  reduced_bytes_per_step_.Set(0);
  samples_per_second_.Set(0);
  tokens_per_second_.Set(0);
  if (aborted) aborts_.Increment();
}

std::vector<prometheus::MetricFamily> WorkerMetrics::MemoryFamilies() {
  const ProcessMemory memory = ReadProcessMemory();
  return {GaugeFamily("lockstep_worker_memory_bytes",
                      "Resident memory of the worker process (kind: current or peak)",
                      {{{{"kind", "current"}}, static_cast<double>(memory.current_bytes)},
                       {{{"kind", "peak"}}, static_cast<double>(memory.peak_bytes)}})};
}

}  // namespace lockstep::worker
