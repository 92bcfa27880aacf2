// Test hooks: named points where an integration test holds a daemon inside a failure window
// (a worker between the two halves of a heal broadcast, while a new group connects, before the
// final evaluation; the coordinator before it saves a job's end, ...) and kills or freezes a
// process while it is held. A real SIGKILL then lands inside the window every time, instead of
// by luck in a random soak.
//
// Armed only by the daemons' --test_hooks flag (tests pass it; services never do). Unarmed,
// Reach() costs one relaxed atomic load.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace lockstep::test_hooks {

// `spec`: comma-separated NAME or NAME@N (hold only where the point's value, e.g. the step or
// the generation, is N). Each armed hook holds once. `dir`: where the barrier files go.
// INVALID_ARGUMENT for a malformed spec or an empty dir.
absl::Status Arm(const std::string& spec, const std::string& dir);

// At hook point `name` with `value` (-1: none). When armed and matching: writes DIR/NAME.reached
// (the pid inside), then waits until DIR/NAME.release exists, `abort` (if given) is set, or 120 s
// pass; the hook is then disarmed. Returns whether it held.
bool Reach(const char* name, int64_t value = -1, const std::atomic<bool>* abort = nullptr);

}  // namespace lockstep::test_hooks
