// The coordinator's front door: roles of the two tokens, and the table of rejected clients that
// one address cannot flush with invented names.
#include "coordinator/service/client_gate.h"

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "gtest/gtest.h"

namespace lockstep::coordinator {
namespace {

TEST(ClientGateTest, EachRoleHasItsTokenAndTheOtherOneIsNamed) {
  ClientGate gate("operators", RealClock::Get(), "workers");
  EXPECT_TRUE(gate.roles());
  EXPECT_TRUE(gate.AdmitHttp("10.0.0.1", "dashboard", "Bearer operators").ok());
  absl::Status worker = gate.AdmitHttp("10.0.0.1", "dashboard", "Bearer workers");
  EXPECT_EQ(worker.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(worker.message().find("worker's token"), std::string::npos) << worker;
  EXPECT_EQ(gate.AdmitHttp("10.0.0.1", "dashboard", "Bearer neither").code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(gate.AdmitHttp("10.0.0.1", "dashboard", "").code(),
            absl::StatusCode::kUnauthenticated);
  ClientGate one("everyone", RealClock::Get());
  EXPECT_FALSE(one.roles());
  EXPECT_TRUE(one.AdmitHttp("10.0.0.1", "dashboard", "Bearer everyone").ok());
}

TEST(ClientGateTest, DecoyNamesFromOneAddressDoNotEvictTheOthers) {
  ClientGate gate("token", RealClock::Get());
  ASSERT_FALSE(gate.AdmitHttp("10.0.0.5", "lockstep-worker w3", "Bearer old").ok());
  for (int i = 0; i < 200; ++i) {
    ASSERT_FALSE(gate.AdmitHttp("10.0.0.9", absl::StrCat("decoy-", i), "").ok());
  }
  const std::vector<v1::RejectedClient> rejected = gate.Rejected();
  int from_attacker = 0;
  bool real_kept = false;
  for (const v1::RejectedClient& r : rejected) {
    from_attacker += r.peer() == "10.0.0.9";
    real_kept = real_kept || (r.peer() == "10.0.0.5" && r.client() == "lockstep-worker w3");
  }
  EXPECT_TRUE(real_kept);
  EXPECT_EQ(from_attacker, static_cast<int>(ClientGate::kMaxRememberedPerAddress));
  EXPECT_EQ(gate.RejectedCounts().first, 201) << "every refused call is counted";
}

// The real client shares the attacker's address (one host, or one NAT): it keeps retrying with
// a wrong token, and 200 decoy names each rejected once do not push it out.
TEST(ClientGateTest, DecoyNamesFromTheSameAddressDoNotEvictAClientThatKeepsFailing) {
  ClientGate gate("token", RealClock::Get());
  for (int i = 0; i < 3; ++i) {
    ASSERT_FALSE(gate.AdmitHttp("10.0.0.9", "dashboard", "Bearer old").ok());
  }
  for (int i = 0; i < 200; ++i) {
    ASSERT_FALSE(gate.AdmitHttp("10.0.0.9", absl::StrCat("decoy-", i), "").ok());
  }
  bool real_kept = false;
  for (const v1::RejectedClient& r : gate.Rejected()) {
    real_kept = real_kept || (r.client() == "dashboard" && r.count() == 3);
  }
  EXPECT_TRUE(real_kept);
}

}  // namespace
}  // namespace lockstep::coordinator
