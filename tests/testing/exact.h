// The user's invariant for a disturbed job, as the recovery tests check it: the job ends
// SUCCEEDED with exactly its steps and, on every final member, the parameter checksum of an
// undisturbed run (deterministic mode makes that checksum independent of the world size).
#pragma once

#include <signal.h>

#include <string>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"

namespace lockstep::testing {

// Runs `spec` undisturbed on the cluster's idle workers; returns the parameter checksum ("" and
// a test failure when it did not succeed with exactly its steps).
inline std::string ReferenceChecksum(Cluster& cluster, const v1::JobSpec& spec,
                                     absl::Duration timeout = absl::Seconds(180)) {
  auto job = cluster.Submit(spec);
  EXPECT_TRUE(job.ok()) << job.status();
  if (!job.ok()) return "";
  auto done = cluster.WaitForEnd(job->job_id(), timeout);
  EXPECT_TRUE(done.ok()) << done.status();
  if (!done.ok()) return "";
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << cluster.Logs();
  EXPECT_EQ(done->step(), spec.max_steps());
  return done->members_size() > 0 ? done->members(0).parameter_checksum() : "";
}

// ReferenceChecksum of `spec` on one worker of its own ("ref", started for it and stopped
// after), so that the cluster's other workers stay as they are; "" and a test failure when it
// did not succeed.
inline std::string ReferenceChecksumOnOneWorker(Cluster& cluster, v1::JobSpec spec) {
  absl::Status started = cluster.StartWorker("ref");
  EXPECT_TRUE(started.ok()) << started << cluster.Logs();
  if (!started.ok()) return "";
  spec.set_min_workers(1);
  spec.set_max_workers(1);
  const std::string checksum = ReferenceChecksum(cluster, spec);
  cluster.worker("ref")->Signal(SIGTERM);
  EXPECT_TRUE(cluster.worker("ref")->Wait(absl::Seconds(30)).ok());
  return checksum;
}

// The job succeeded with exactly `steps` steps, every member holding `checksum`.
inline void ExpectExact(Cluster& cluster, const v1::Job& job, int64_t steps,
                        const std::string& checksum) {
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << cluster.Logs();
  EXPECT_EQ(job.step(), steps);
  ASSERT_GE(job.members_size(), 1);
  for (const v1::Member& m : job.members()) {
    EXPECT_EQ(m.step(), steps) << m.worker_name();
    EXPECT_EQ(m.parameter_checksum(), checksum)
        << m.worker_name() << " holds other parameters than an undisturbed run\n"
        << cluster.Logs();
  }
}

}  // namespace lockstep::testing
