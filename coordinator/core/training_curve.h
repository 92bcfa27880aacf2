// A job's training curve as the coordinator keeps it for display (v1::TrainingCurve): rank 0's
// reports of loss and throughput, at most kMaxPoints of them, evenly spaced in steps however
// long the job trains.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "lockstep/v1/job.pb.h"

namespace lockstep::coordinator {

class TrainingCurve {
 public:
  static constexpr size_t kMaxPoints = 512;

  // Rank 0's report of point.step(). A step at or before the last point (a group that resumed
  // from an older state trains those steps again) replaces the points from there on. A point
  // closer than spacing() steps to the last one is not kept.
  void Add(const v1::TrainingPoint& point);

  const std::vector<v1::TrainingPoint>& points() const { return points_; }
  // The fewest steps between two kept points: 1 until the curve first fills, then the mean
  // spacing of what was kept each time it thinned.
  int64_t spacing() const { return spacing_; }

 private:
  std::vector<v1::TrainingPoint> points_;
  int64_t spacing_ = 1;
};

}  // namespace lockstep::coordinator
