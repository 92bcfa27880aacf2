// Bucket plans: closed at ready points once at least the minimum is gathered.
#include "worker/step/bucket_plan.h"

#include <algorithm>

namespace lockstep::worker {

BucketPlan::BucketPlan(const std::vector<size_t>& ready_points, size_t min_values, size_t tail) {
  const size_t end = ready_points.empty() ? 0 : ready_points.back();
  size_t start = 0;
  for (size_t i = 0; i + 1 < ready_points.size(); ++i) {
    if (ready_points[i] - start >= min_values) {
      buckets_.push_back({start, ready_points[i] - start});
      start = ready_points[i];
    }
  }
  buckets_.push_back({start, end - start + tail});
}

size_t BucketPlan::largest() const {
  size_t largest = 0;
  for (const Bucket& b : buckets_) largest = std::max(largest, b.count);
  return largest;
}

void BucketPlan::Cursor::Ready(size_t end) {
  const std::vector<Bucket>& b = plan_.buckets();
  while (next_ + 1 < b.size() && b[next_].offset + b[next_].count <= end) send_(b[next_++]);
}

void BucketPlan::Cursor::Finish() {
  const std::vector<Bucket>& b = plan_.buckets();
  while (next_ < b.size()) send_(b[next_++]);
}

}  // namespace lockstep::worker
