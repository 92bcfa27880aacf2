#include "coordinator/core/event_history.h"

#include <algorithm>
#include <utility>

namespace lockstep::coordinator {

void EventHistory::Add(v1::JobEvent event, size_t max_events) {
  event.set_sequence(next_++);
  events_.push_back(std::move(event));
  while (events_.size() > max_events) events_.pop_front();
}

std::vector<v1::JobEvent> EventHistory::Since(int64_t from) const {
  auto first = std::lower_bound(
      events_.begin(), events_.end(), from,
      [](const v1::JobEvent& e, int64_t sequence) { return e.sequence() < sequence; });
  return std::vector<v1::JobEvent>(first, events_.end());
}

}  // namespace lockstep::coordinator
