// The coordinator's and the worker's metrics from the events they see: recoveries counted when
// they begin and timed when the new generation's first step completes, stale and restored
// snapshots counting nothing twice, queue waits, state families, and a worker's runs.
#include <memory>

#include "coordinator/service/metrics.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "tests/testing/http.h"
#include "worker/metrics.h"

namespace lockstep {
namespace {

using testing::SampleValue;

std::string Text(prometheus::Registry& registry) {
  return prometheus::TextSerializer().Serialize(registry.Collect());
}

v1::Job Submitted(const std::string& id) {
  v1::Job job;
  job.set_job_id(id);
  job.set_state(v1::JOB_STATE_PENDING);
  job.set_submit_time_unix_ms(1'000'000);
  return job;
}

v1::Recovery* Lost(v1::Job* job, int64_t detect_ms) {
  v1::Recovery* r = job->add_recovery_history();
  r->set_reason("worker w1 lost: no heartbeat");
  r->set_detect_unix_ms(detect_ms);
  job->set_state(v1::JOB_STATE_RECONFIGURING);
  return r;
}

TEST(CoordinatorMetricsTest, RecoveriesAreCountedOnceAndTimedWhenTheyEnd) {
  prometheus::Registry registry;
  coordinator::CoordinatorMetrics metrics(registry, /*since_unix_ms=*/1'000'000);
  v1::Job job = Submitted("job-1-abc");
  metrics.ObserveJob(job);
  EXPECT_EQ(SampleValue(Text(registry), "lockstep_coordinator_queue_wait_seconds_count"), 0.0);

  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_start_time_unix_ms(1'002'500);
  metrics.ObserveJob(job);
  metrics.ObserveJob(job);  // the same snapshot again counts nothing
  std::string text = Text(registry);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_queue_wait_seconds_count"), 1.0);
  EXPECT_DOUBLE_EQ(*SampleValue(text, "lockstep_coordinator_queue_wait_seconds_sum"), 2.5);

  const v1::Job before_loss = job;
  v1::Recovery* r = Lost(&job, 1'010'000);
  metrics.ObserveJob(job);
  text = Text(registry);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recoveries_total", {{"kind", "failure"}}), 1.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recovery_seconds_count"), 0.0);

  r->set_reformed_unix_ms(1'010'020);
  metrics.ObserveJob(job);
  EXPECT_EQ(SampleValue(Text(registry), "lockstep_coordinator_recovery_seconds_count"), 0.0);
  r->set_first_step_unix_ms(1'010'037);
  r->set_steps_redone(0);
  job.set_state(v1::JOB_STATE_RUNNING);
  metrics.ObserveJob(job);
  metrics.ObserveJob(before_loss);  // a stale snapshot saved late changes nothing
  metrics.ObserveJob(job);
  text = Text(registry);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recoveries_total", {{"kind", "failure"}}), 1.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recovery_seconds_count"), 1.0);
  EXPECT_NEAR(*SampleValue(text, "lockstep_coordinator_recovery_seconds_sum"), 0.037, 1e-9);
  EXPECT_NEAR(*SampleValue(text, "lockstep_coordinator_generation_formation_seconds_sum"), 0.020,
              1e-9);

  // A re-formation replaced by another before its first step: both counted, one timed.
  Lost(&job, 1'020'000);
  metrics.ObserveJob(job);
  v1::Recovery* second = Lost(&job, 1'020'500);
  second->set_scale_up(true);
  metrics.ObserveJob(job);
  second->set_reformed_unix_ms(1'020'600);
  second->set_first_step_unix_ms(1'021'000);
  second->set_steps_redone(3);
  job.set_state(v1::JOB_STATE_SUCCEEDED);
  metrics.ObserveJob(job);
  text = Text(registry);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recoveries_total", {{"kind", "failure"}}), 2.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recoveries_total", {{"kind", "scale_up"}}), 1.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recovery_seconds_count"), 2.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_steps_redone_total"), 3.0);
}

TEST(CoordinatorMetricsTest, ARestoredJobCountsOnlyWhatHappensAfterTheRestart) {
  prometheus::Registry registry;
  coordinator::CoordinatorMetrics metrics(registry, /*since_unix_ms=*/1'099'000);
  v1::Job job = Submitted("job-7-abc");
  job.set_start_time_unix_ms(1'001'000);
  v1::Recovery* old = Lost(&job, 1'005'000);  // seen by the previous coordinator
  old->set_first_step_unix_ms(1'005'100);
  v1::Recovery* restart = Lost(&job, 1'100'000);
  restart->set_reason("coordinator restarted");
  metrics.ObserveJob(job);
  std::string text = Text(registry);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recoveries_total", {{"kind", "failure"}}), 0.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recoveries_total", {{"kind", "coordinator"}}),
            1.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_queue_wait_seconds_count"), 0.0);
  restart->set_first_step_unix_ms(1'100'400);
  metrics.ObserveJob(job);
  text = Text(registry);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recovery_seconds_count"), 1.0);
  EXPECT_NEAR(*SampleValue(text, "lockstep_coordinator_recovery_seconds_sum"), 0.4, 1e-9);
}

TEST(CoordinatorMetricsTest, AJobThatStartsAtSubmitCountsItsWait) {
  prometheus::Registry registry;
  coordinator::CoordinatorMetrics metrics(registry, /*since_unix_ms=*/900'000);
  v1::Job job = Submitted("job-2-abc");
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_start_time_unix_ms(1'000'004);  // workers were idle: assigned in the same decision
  metrics.ObserveJob(job);
  EXPECT_EQ(SampleValue(Text(registry), "lockstep_coordinator_queue_wait_seconds_count"), 1.0);
}

TEST(CoordinatorMetricsTest, StateFamiliesListEveryJobStateAndWorkerDevice) {
  coordinator::ClusterCounts counts;
  counts.jobs[v1::JOB_STATE_RUNNING] = 2;
  counts.jobs[v1::JOB_STATE_PENDING] = 3;
  counts.workers[{"busy", "cpu"}] = 4;
  counts.workers[{"idle", "cuda:0"}] = 1;
  counts.rejected_calls = 7;
  counts.rejected_clients = 2;
  const std::string text =
      prometheus::TextSerializer().Serialize(coordinator::CoordinatorMetrics::StateFamilies(counts));
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_jobs", {{"state", "running"}}), 2.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_jobs", {{"state", "failed"}}), 0.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_queue_length"), 3.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_workers", {{"state", "busy"}, {"device", "cpu"}}),
            4.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_workers", {{"device", "cuda:0"}}), 1.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_rejected_calls_total"), 7.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_rejected_clients"), 2.0);
}

TEST(CoordinatorMetricsTest, UnknownMethodNamesShareOneLabel) {
  prometheus::Registry registry;
  coordinator::CoordinatorMetrics metrics(registry, 0);
  metrics.ObserveRpc("/lockstep.v1.JobService/GetJob", grpc::NOT_FOUND);
  for (int i = 0; i < 100; ++i) metrics.ObserveRpc("/attacker/" + std::to_string(i), grpc::OK);
  const std::string text = Text(registry);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_rpcs_total",
                        {{"method", "/lockstep.v1.JobService/GetJob"}, {"code", "NOT_FOUND"}}),
            1.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_rpcs_total", {{"method", "other"}}), 100.0);
  EXPECT_EQ(text.find("attacker"), std::string::npos);
}

TEST(WorkerMetricsTest, StepsRunsAndAborts) {
  prometheus::Registry registry;
  worker::WorkerMetrics metrics(registry, "w0", "cpu");
  metrics.BeginRun("job-1-abc", 1, 2, 4000);
  worker::StepResult step;
  step.loss = 0.75;
  step.compute = absl::Milliseconds(30);
  step.exposed_comm = absl::Milliseconds(5);
  step.update = absl::Milliseconds(1);
  metrics.ObserveStep(step);
  metrics.ObserveStep(step);
  std::string text = Text(registry);
  EXPECT_EQ(SampleValue(text, "lockstep_worker_serving", {{"job", "job-1-abc"}, {"world_size", "2"}}),
            1.0);
  EXPECT_EQ(SampleValue(text, "lockstep_worker_steps_total"), 2.0);
  EXPECT_EQ(SampleValue(text, "lockstep_worker_reduced_bytes_total"), 8000.0);
  EXPECT_EQ(SampleValue(text, "lockstep_worker_training_loss"), 0.75);
  EXPECT_EQ(SampleValue(text, "lockstep_worker_step_seconds_count"), 2.0);
  EXPECT_NEAR(*SampleValue(text, "lockstep_worker_step_seconds_sum"), 0.072, 1e-9);
  EXPECT_NEAR(*SampleValue(text, "lockstep_worker_step_phase_seconds_total",
                           {{"phase", "exposed_communication"}}),
              0.010, 1e-9);
  metrics.EndRun(/*aborted=*/true);
  metrics.BeginRun("job-1-abc", 0, 1, 0);
  metrics.EndRun(/*aborted=*/false);
  text = Text(registry);
  EXPECT_FALSE(SampleValue(text, "lockstep_worker_serving").has_value()) << text;
  EXPECT_EQ(SampleValue(text, "lockstep_worker_runs_total"), 2.0);
  EXPECT_EQ(SampleValue(text, "lockstep_worker_aborts_total"), 1.0);
  EXPECT_EQ(SampleValue(text, "lockstep_worker_info", {{"name", "w0"}, {"device", "cpu"}}), 1.0);
  const std::string memory =
      prometheus::TextSerializer().Serialize(worker::WorkerMetrics::MemoryFamilies());
  EXPECT_GT(SampleValue(memory, "lockstep_worker_memory_bytes", {{"kind", "current"}}).value_or(0),
            0);
  EXPECT_GT(SampleValue(memory, "lockstep_worker_memory_bytes", {{"kind", "peak"}}).value_or(0),
            0);
}

}  // namespace
}  // namespace lockstep
