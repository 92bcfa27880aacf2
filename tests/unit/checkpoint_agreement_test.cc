// Which checkpoint a program job's new generation restores (worker/program/checkpoint_agreement.h):
// the newest step every member can obtain, from its own memory, else a copy of its own saves
// a peer keeps, else (a spare) a departed worker's copy, each taken once, else the disk, else
// (a member with nothing of its own) a replica's own save.
#include "worker/program/checkpoint_agreement.h"

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

v1::CheckpointHoldings Member(
    const std::string& worker, std::initializer_list<int64_t> own,
    std::initializer_list<std::pair<std::string, std::vector<int64_t>>> copies = {},
    const std::string& address = "") {
  v1::CheckpointHoldings h;
  h.set_worker(worker);
  for (int64_t s : own) h.add_own_steps(s);
  h.set_peer_address(address.empty() ? worker + ":1" : address);
  for (const auto& [source, steps] : copies) {
    v1::ReplicaHolding* r = h.add_replicas();
    r->set_source_worker(source);
    for (int64_t s : steps) r->add_steps(s);
  }
  return h;
}

TEST(ChooseCheckpointTest, NobodyHoldsAnything) {
  const v1::CheckpointChoice c = ChooseCheckpoint({Member("w0", {}), Member("w1", {})});
  EXPECT_FALSE(c.found());
  EXPECT_TRUE(c.fetches().empty());
}

TEST(ChooseCheckpointTest, TheNewestStepEveryMemberHoldsFromItsOwnMemory) {
  const v1::CheckpointChoice c =
      ChooseCheckpoint({Member("w0", {6, 5}), Member("w1", {5, 4}), Member("w2", {5, 6})});
  ASSERT_TRUE(c.found());
  EXPECT_EQ(c.step(), 5);
  EXPECT_TRUE(c.fetches().empty());
  EXPECT_EQ(c.restored_from(), "memory");
  EXPECT_EQ(c.detail(), "");
}

TEST(ChooseCheckpointTest, AWorkerThatLostItsMemoryFetchesTheCopyOfItsOwnSaves) {
  // w1 restarted: its memory is empty; w0 keeps copies of w1's steps 6 and 5.
  const v1::CheckpointChoice c =
      ChooseCheckpoint({Member("w0", {6, 5}, {{"w1", {6, 5}}}), Member("w1", {})});
  ASSERT_TRUE(c.found());
  EXPECT_EQ(c.step(), 6);
  ASSERT_EQ(c.fetches_size(), 1);
  EXPECT_EQ(c.fetches(0).rank(), 1);
  EXPECT_EQ(c.fetches(0).holder_worker(), "w0");
  EXPECT_EQ(c.fetches(0).holder_address(), "w0:1");
  EXPECT_EQ(c.fetches(0).source_worker(), "w1");
  EXPECT_EQ(c.restored_from(), "memory and peers' copies");
  EXPECT_TRUE(absl::StrContains(c.detail(), "w1 from w0")) << c.detail();
}

TEST(ChooseCheckpointTest, AnOlderStepWhenTheCopyLagsBehind) {
  // The copy of w1's step 6 had not arrived when w1 died: step 5 is what all can have.
  const v1::CheckpointChoice c =
      ChooseCheckpoint({Member("w0", {6, 5}, {{"w1", {5}}}), Member("w1", {})});
  ASSERT_TRUE(c.found());
  EXPECT_EQ(c.step(), 5);
}

TEST(ChooseCheckpointTest, ASpareTakesADepartedWorkersCopyOnlyOnce) {
  // w1 and w2 are gone; w0 kept w1's copies, w3 kept w2's. Two spares, s1 and s2.
  const std::vector<v1::CheckpointHoldings> members = {
      Member("w0", {8}, {{"w1", {8}}}), Member("w3", {8}, {{"w2", {8}}}), Member("s1", {}),
      Member("s2", {})};
  const v1::CheckpointChoice c = ChooseCheckpoint(members);
  ASSERT_TRUE(c.found());
  EXPECT_EQ(c.step(), 8);
  ASSERT_EQ(c.fetches_size(), 2);
  EXPECT_NE(c.fetches(0).source_worker(), c.fetches(1).source_worker());
  EXPECT_FALSE(c.fetches(0).holders_own());
  EXPECT_FALSE(c.fetches(1).holders_own());
  // A third spare has no departed worker's copy left: it takes a replica's own save.
  std::vector<v1::CheckpointHoldings> more = members;
  more.push_back(Member("s3", {}));
  const v1::CheckpointChoice third = ChooseCheckpoint(more);
  ASSERT_TRUE(third.found());
  EXPECT_EQ(third.step(), 8);
  ASSERT_EQ(third.fetches_size(), 3);
  EXPECT_EQ(third.fetches(2).rank(), 4);
  EXPECT_TRUE(third.fetches(2).holders_own());
  EXPECT_EQ(third.fetches(2).holder_worker(), "w0");
}

TEST(ChooseCheckpointTest, AMembersCopyIsNotTakenByASpareAndACopyIsNotFetchedFromItself) {
  // w1 is a member and holds its own step 4: its copy at w0 is not a spare's to take; the
  // spare takes w0's own save instead.
  const v1::CheckpointChoice c = ChooseCheckpoint(
      {Member("w0", {4}, {{"w1", {4}}}), Member("w1", {4}), Member("s", {})});
  ASSERT_TRUE(c.found()) << c.ShortDebugString();
  ASSERT_EQ(c.fetches_size(), 1);
  EXPECT_TRUE(c.fetches(0).holders_own());
  EXPECT_EQ(c.fetches(0).source_worker(), "w0");
  // A copy kept by the member itself (a worker that holds copies of its own name) is no source.
  const v1::CheckpointChoice self = ChooseCheckpoint({Member("w0", {3}), Member("w1", {}, {{"w1", {3}}})});
  EXPECT_FALSE(self.found());
}

TEST(ChooseCheckpointTest, RefusedCopiesAreNamedInTheDetail) {
  v1::CheckpointHoldings w0 = Member("w0", {8});
  w0.add_refused("the copy of w1's step 8 does not match its checksum");
  // Without w1's copy the spare takes w0's own save; the refused copy is still named.
  const v1::CheckpointChoice c = ChooseCheckpoint({w0, Member("spare", {})});
  ASSERT_TRUE(c.found());
  EXPECT_TRUE(absl::StrContains(c.detail(), "spare took w0's from w0")) << c.detail();
  // Nobody to take it from: the reason names who lacks what.
  v1::CheckpointHoldings alone = Member("w0", {});
  alone.add_refused("the copy of w1's step 8 does not match its checksum");
  alone.add_disk_steps(8);
  const v1::CheckpointChoice none = ChooseCheckpoint({alone, Member("spare", {})});
  EXPECT_FALSE(none.found());
  EXPECT_TRUE(absl::StrContains(none.detail(), "spare (rank 1) holds no save of step 8"))
      << none.detail();
  EXPECT_TRUE(absl::StrContains(none.detail(), "w0: the copy of w1's step 8 does not match"))
      << none.detail();
  EXPECT_TRUE(absl::StrContains(c.detail(), "w0: the copy of w1's step 8 does not match"))
      << c.detail();
}

TEST(ChooseCheckpointTest, TheDiskServesWhatNeitherMemoryNorACopyHolds) {
  // Both workers restarted: nothing in memory; the disk has steps 5 and 10 (every 5 saves).
  v1::CheckpointHoldings w0 = Member("w0", {}), w1 = Member("w1", {});
  for (auto* h : {&w0, &w1}) {
    h->add_disk_steps(10);
    h->add_disk_steps(5);
  }
  v1::CheckpointChoice c = ChooseCheckpoint({w0, w1});
  ASSERT_TRUE(c.found());
  EXPECT_EQ(c.step(), 10);
  ASSERT_EQ(c.fetches_size(), 2);
  EXPECT_TRUE(c.fetches(0).from_disk());
  EXPECT_EQ(c.restored_from(), "disk");
  // Memory first: w0 holds step 12 and 10 itself; w1 only the disk's 10.
  w0.add_own_steps(12);
  w0.add_own_steps(10);
  c = ChooseCheckpoint({w0, w1});
  ASSERT_TRUE(c.found());
  EXPECT_EQ(c.step(), 10);
  ASSERT_EQ(c.fetches_size(), 1);
  EXPECT_EQ(c.fetches(0).rank(), 1);
  EXPECT_EQ(c.restored_from(), "memory and disk");
  EXPECT_TRUE(absl::StrContains(c.detail(), "w1 from disk")) << c.detail();
  // And a copy before the disk: w0 keeps w1's step 12.
  v1::ReplicaHolding* copy = w0.add_replicas();
  copy->set_source_worker("w1");
  copy->add_steps(12);
  c = ChooseCheckpoint({w0, w1});
  EXPECT_EQ(c.step(), 12);
  EXPECT_FALSE(c.fetches(0).from_disk());
}

TEST(ChooseCheckpointTest, AHolderWithoutAnAddressCannotServe) {
  v1::CheckpointHoldings w0 = Member("w0", {6}, {{"w1", {6}}});
  w0.clear_peer_address();
  EXPECT_FALSE(ChooseCheckpoint({w0, Member("w1", {})}).found());
}

TEST(ChooseCheckpointTest, AWorkerThatJoinedTakesAReplicasOwnSave) {
  // w2 joined a running job (a scale-up, or the job growing back after a preemption): nothing
  // of its own anywhere. The others hold 7 and 8 in memory; it takes rank 0's save of 8.
  const v1::CheckpointChoice c = ChooseCheckpoint(
      {Member("w0", {8, 7}, {{"w1", {7}}}), Member("w1", {8, 7}, {{"w0", {8}}}), Member("w2", {})});
  ASSERT_TRUE(c.found());
  EXPECT_EQ(c.step(), 8);
  ASSERT_EQ(c.fetches_size(), 1);
  EXPECT_EQ(c.fetches(0).rank(), 2);
  EXPECT_TRUE(c.fetches(0).holders_own());
  EXPECT_EQ(c.fetches(0).holder_worker(), "w0");
  EXPECT_EQ(c.fetches(0).source_worker(), "w0");
  EXPECT_EQ(c.restored_from(), "memory and peers' copies");
  EXPECT_TRUE(absl::StrContains(c.detail(), "w2 took w0's from w0")) << c.detail();
}

TEST(ChooseCheckpointTest, AWorkerThatJoinedBackTakesAReplicasSaveOverItsOldOnes) {
  // w1 was taken by a preemption at step 8 and comes back while w0 is at 30: its own saves
  // (7, 8) are of the time before it left. As a member that joined it takes w0's 30.
  v1::CheckpointHoldings back = Member("w1", {8, 7});
  back.set_joined(true);
  const v1::CheckpointChoice c = ChooseCheckpoint({Member("w0", {30, 29}), back});
  ASSERT_TRUE(c.found());
  EXPECT_EQ(c.step(), 30);
  ASSERT_EQ(c.fetches_size(), 1);
  EXPECT_TRUE(c.fetches(0).holders_own());
  EXPECT_EQ(c.fetches(0).rank(), 1);
  // Not joined (it stayed, and its newer saves were lost): no step the two hold in common
  // but their own history's; here none, and nothing is taken from w0.
  const v1::CheckpointChoice stayed = ChooseCheckpoint({Member("w0", {30, 29}), Member("w1", {8, 7})});
  EXPECT_FALSE(stayed.found());
}

TEST(ChooseCheckpointTest, OnlyAMemberWithNothingOfItsOwnTakesAReplicasSave) {
  // w1 holds its own older saves (and its disk has none of 9): it is not a newcomer, so the
  // group restores 8, which both hold, rather than give w1 w0's state of 9.
  const v1::CheckpointChoice c =
      ChooseCheckpoint({Member("w0", {9, 8}), Member("w1", {8, 7})});
  ASSERT_TRUE(c.found());
  EXPECT_EQ(c.step(), 8);
  EXPECT_TRUE(c.fetches().empty());
  // A restarted worker whose saves a peer keeps takes its own copy, not a replica's save.
  const v1::CheckpointChoice again =
      ChooseCheckpoint({Member("w0", {9, 8}, {{"w1", {8}}}), Member("w1", {})});
  ASSERT_TRUE(again.found());
  EXPECT_EQ(again.step(), 8);
  ASSERT_EQ(again.fetches_size(), 1);
  EXPECT_FALSE(again.fetches(0).holders_own());
  EXPECT_EQ(again.fetches(0).source_worker(), "w1");
}

}  // namespace
}  // namespace lockstep::worker
