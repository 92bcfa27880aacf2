// The worker's store client over a real gRPC server whose store refuses: each refusal reaches
// the generation with a code that ends the generation, not the job (worker/generation.h).
#include "worker/comm/store_client.h"

#include <memory>
#include <string>

#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "lockstep/v1/store.grpc.pb.h"
#include "worker/generation.h"

namespace lockstep::worker {
namespace {

// Answers every call with `code`.
class RefusingStore final : public v1::StoreService::Service {
 public:
  grpc::StatusCode code = grpc::StatusCode::OK;
  grpc::Status Set(grpc::ServerContext*, const v1::StoreSetRequest*,
                   v1::StoreSetResponse*) override {
    return {code, "refused by the test"};
  }
  grpc::Status Get(grpc::ServerContext*, const v1::StoreGetRequest*,
                   v1::StoreGetResponse*) override {
    return {code, "refused by the test"};
  }
  grpc::Status Wait(grpc::ServerContext*, const v1::StoreWaitRequest*,
                    v1::StoreWaitResponse*) override {
    return {code, "refused by the test"};
  }
};

TEST(StoreClientTest, TheStoresRefusalsEndTheGenerationNotTheJob) {
  RefusingStore service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  CoordinatorStoreClient client(v1::StoreService::NewStub(channel), "session", "job-1", 3,
                                std::make_shared<AbortSignal>());
  struct Case {
    grpc::StatusCode refusal;
    absl::StatusCode want;
  };
  const Case cases[] = {
      // A session or membership no longer live: an abort is on its way.
      {grpc::StatusCode::PERMISSION_DENIED, absl::StatusCode::kAborted},
      {grpc::StatusCode::NOT_FOUND, absl::StatusCode::kAborted},
      // The generation's scope is full (a member flooded it): the next gets a fresh one.
      {grpc::StatusCode::RESOURCE_EXHAUSTED, absl::StatusCode::kUnavailable},
      // As they are.
      {grpc::StatusCode::ABORTED, absl::StatusCode::kAborted},
      {grpc::StatusCode::UNAVAILABLE, absl::StatusCode::kUnavailable},
  };
  for (const Case& c : cases) {
    service.code = c.refusal;
    const absl::Status set = client.Set("key", "value");
    EXPECT_EQ(set.code(), c.want) << set;
    EXPECT_FALSE(IsFatal(set)) << set;
    EXPECT_NE(set.message().find("job-1 generation 3"), std::string::npos) << set;
    EXPECT_NE(set.message().find("refused by the test"), std::string::npos) << set;
    EXPECT_EQ(client.Get("key", absl::Seconds(1)).status().code(), c.want);
    EXPECT_EQ(client.Wait({"key"}, absl::Seconds(1)).code(), c.want);
  }
  server->Shutdown();
}

}  // namespace
}  // namespace lockstep::worker
