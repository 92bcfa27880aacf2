// A job's event history (coordinator/core/event_history.h), case by case.
#include "coordinator/core/event_history.h"

#include <vector>

#include "gtest/gtest.h"

namespace lockstep::coordinator {
namespace {

std::vector<int64_t> Sequences(const std::vector<v1::JobEvent>& events) {
  std::vector<int64_t> out;
  for (const v1::JobEvent& e : events) out.push_back(e.sequence());
  return out;
}

TEST(EventHistoryTest, EventsAreNumberedInOrderAndTheOldestGoBeyondTheBound) {
  EventHistory history;
  for (int i = 0; i < 7; ++i) {
    v1::JobEvent e;
    e.set_message(std::to_string(i));
    e.set_sequence(100);  // overwritten: the history numbers its events
    history.Add(e, 5);
  }
  EXPECT_EQ(history.size(), 5u);
  EXPECT_EQ(history.next_sequence(), 7);
  struct Case {
    int64_t from;
    std::vector<int64_t> want;
  };
  const Case cases[] = {
      {-1, {2, 3, 4, 5, 6}},  // before anything: what is kept
      {0, {2, 3, 4, 5, 6}},   // dropped ones are gone
      {2, {2, 3, 4, 5, 6}},
      {4, {4, 5, 6}},
      {6, {6}},
      {7, {}},                // the next one: nothing yet
      {1000, {}},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Sequences(history.Since(c.from)), c.want) << "from " << c.from;
  }
  EXPECT_EQ(history.Since(4).front().message(), "4");
}

TEST(EventHistoryTest, AnEmptyHistoryHasNothingToGive) {
  EventHistory history;
  EXPECT_TRUE(history.Since(0).empty());
  EXPECT_EQ(history.next_sequence(), 0);
}

}  // namespace
}  // namespace lockstep::coordinator
