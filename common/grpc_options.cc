// Keepalive: the server must permit frequent pings without data, or it answers "too many
// pings" and drops the call (docs/platform_notes.md). The timeouts are ones a loaded machine
// meets: a peer that answers a ping late is not a dead one (see kClientKeepaliveTimeout).
#include "common/grpc_options.h"

#include <utility>
#include <vector>

#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/client_interceptor.h"
#include "grpcpp/support/server_interceptor.h"

namespace lockstep {
namespace {

// Clients (workers, lockstepctl, dashboards' watchers) ping every second and give up on a
// connection whose ping goes unanswered for 5 s. A frozen or unreachable coordinator is
// noticed within about 6 s; a shorter timeout broke healthy sessions whenever the machine was
// loaded (the coordinator answered a ping late), and every broken session aborts its worker's
// run. A hung worker is the coordinator's to find, by the job's heartbeat_timeout.
constexpr int kClientKeepaliveTimeMs = 1000;
constexpr int kClientKeepaliveTimeoutMs = 5000;
// The server pings only to drop dead connections: rarely, and with a timeout longer than an
// idle client channel's backup poll (5 s in gRPC), which is when such a channel acks a ping.
// (A 1 s timeout dropped idle lockstepctl and Python channels after 2-3 s.)
constexpr int kServerKeepaliveTimeMs = 10000;
constexpr int kServerKeepaliveTimeoutMs = 20000;

// Adds the token and the client's name to the initial metadata of every call.
class AuthInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit AuthInterceptor(const ClientAuth* auth) : auth_(auth) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      auto* metadata = methods->GetSendInitialMetadata();
      if (!auth_->token.empty()) metadata->emplace(kAuthorizationKey, bearer_);
      if (!auth_->client.empty()) metadata->emplace(kClientKey, auth_->client);
    }
    methods->Proceed();
  }

 private:
  const ClientAuth* const auth_;  // owned by the factory, which the channel keeps
  const std::string bearer_ = "Bearer " + auth_->token;
};

class AuthInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit AuthInterceptorFactory(ClientAuth auth) : auth_(std::move(auth)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new AuthInterceptor(&auth_);
  }

 private:
  const ClientAuth auth_;
};

// See MalformedRequestInterceptorFactory.
class MalformedRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit MalformedRequestInterceptor(std::string method) : method_(std::move(method)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (status.error_code() == grpc::StatusCode::INTERNAL && status.error_message().empty()) {
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            "the request to " + method_ +
                " does not parse: a string field holds bytes that are not UTF-8 (send text as "
                "UTF-8), or the message is malformed"));
      }
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
};

class MalformedRequestFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new MalformedRequestInterceptor(info->method() != nullptr ? info->method() : "?");
  }
};

}  // namespace

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, const ClientAuth& auth) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kClientKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kClientKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, kMaxMessageBytes);
  args.SetInt(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, kMaxMessageBytes);
  // Reconnect within a quarter second of a coordinator serving again, however long it was
  // away: a connection attempt to a closed port costs next to nothing, and workers wait for
  // this reconnection rather than adding a backoff of their own.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 250);
  if (!auth.server_name.empty()) args.SetSslTargetNameOverride(auth.server_name);
  const std::shared_ptr<grpc::ChannelCredentials> credentials =
      auth.credentials != nullptr ? auth.credentials : grpc::InsecureChannelCredentials();
  if (auth.token.empty() && auth.client.empty()) {
    return grpc::CreateCustomChannel(target, credentials, args);
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<AuthInterceptorFactory>(auth));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, credentials, args,
                                                                std::move(factories));
}

void ConfigureServer(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kServerKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kServerKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 100);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MalformedRequestInterceptorFactory() {
  return std::make_unique<MalformedRequestFactory>();
}

}  // namespace lockstep
