// The process-wide real clock.
#include "common/clock.h"

namespace lockstep {

RealClock* RealClock::Get() {
  static RealClock* clock = new RealClock();
  return clock;
}

}  // namespace lockstep
