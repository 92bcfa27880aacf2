// Which lockstep.torch checkpoint a program job's new generation restores (docs/programs.md).
// Every member states what it holds (its own saves, and the copies it keeps of other workers'
// saves); rank 0 chooses the newest step that every member can obtain, and where each member
// that does not hold it fetches it. Pure: no I/O, tested on its own.
#pragma once

#include <vector>

#include "lockstep/v1/program.pb.h"

namespace lockstep::worker {

// `by_rank[r]` is rank r's holdings. A member obtains step s from its own saves; else from a
// copy of its own worker's saves kept by another member (a worker that restarted and lost its
// memory); else, a member whose worker's saves nobody keeps (a spare), from a copy of a worker
// that is no longer a member (the one it replaces), each such copy taken by one spare; else
// from the job's checkpoint_dir; else, a member that joined this generation (joined) or has
// nothing of its own anywhere, from another member's own save of the step (holders_own:
// replicas of a data-parallel job hold the same state). Copies are fetched only from a member that has a
// peer address.
v1::CheckpointChoice ChooseCheckpoint(const std::vector<v1::CheckpointHoldings>& by_rank);

}  // namespace lockstep::worker
