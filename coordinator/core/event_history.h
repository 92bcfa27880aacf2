// A job's event history: each event gets the next sequence number (0, 1, ...), and the oldest
// go once more than a bound are kept. Pure; the core keeps one per job (jobs.cc), WatchJob
// and the dashboard read it from a sequence number on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "lockstep/v1/job.pb.h"

namespace lockstep::coordinator {

class EventHistory {
 public:
  // Stamps `event` with the next sequence number and keeps it; then drops the oldest while
  // more than `max_events` are kept.
  void Add(v1::JobEvent event, size_t max_events);
  // The kept events whose sequence is `from` or later, in order (found by binary search: the
  // cost is the events returned, not the events kept).
  std::vector<v1::JobEvent> Since(int64_t from) const;
  size_t size() const { return events_.size(); }
  // The number the next event gets.
  int64_t next_sequence() const { return next_; }

 private:
  std::deque<v1::JobEvent> events_;  // ascending, consecutive sequence numbers
  int64_t next_ = 0;
};

}  // namespace lockstep::coordinator
