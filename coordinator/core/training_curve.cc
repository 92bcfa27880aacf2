#include "coordinator/core/training_curve.h"

#include <algorithm>

namespace lockstep::coordinator {

void TrainingCurve::Add(const v1::TrainingPoint& point) {
  while (!points_.empty() && points_.back().step() >= point.step()) points_.pop_back();
  if (!points_.empty() && point.step() - points_.back().step() < spacing_) return;
  points_.push_back(point);
  if (points_.size() <= kMaxPoints) return;
  // Full: keep every other point (the first stays), and from now on keep new points about as
  // far apart as the kept ones are, so that the whole curve stays evenly spaced.
  size_t kept = 0;
  for (size_t i = 0; i < points_.size(); i += 2) points_[kept++] = points_[i];
  points_.resize(kept);
  const int64_t span = points_.back().step() - points_.front().step();
  spacing_ = std::max<int64_t>(spacing_ * 2, span / static_cast<int64_t>(points_.size() - 1));
}

}  // namespace lockstep::coordinator
