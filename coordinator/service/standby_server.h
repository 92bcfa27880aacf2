// What a standby coordinator (--state_backend=etcd, another coordinator leads) serves on its
// --listen address: every call, of any service, is answered UNAVAILABLE with the leader's
// address in words and in the trailing metadata kLeaderMetadataKey (common/coordinators.h),
// so that lockstepctl, the Python client and workers are told where to go. The port is held from
// the start, so that a standby that wins serves on the same address.
#pragma once

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/coordinators.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"

namespace lockstep::coordinator {

// Thread-safe.
class StandbyServer final : public grpc::CallbackGenericService {
 public:
  // Listens on `listen` (port 0: the OS picks; the port chosen in *port).
  static absl::StatusOr<std::unique_ptr<StandbyServer>> Start(
      const std::string& listen, const std::shared_ptr<grpc::ServerCredentials>& credentials,
      int* port);
  ~StandbyServer() override;

  // The leader seen now (empty when none is known), or why none is known.
  void SetLeader(const std::string& leader, const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops answering and frees the port.
  void Stop();

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override;

 private:
  StandbyServer() = default;
  absl::Mutex mu_;
  std::string leader_ ABSL_GUARDED_BY(mu_);
  std::string why_ ABSL_GUARDED_BY(mu_) = "looking for the leader in etcd";
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace lockstep::coordinator
