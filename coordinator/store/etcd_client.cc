// The etcd v3 client: one gRPC channel per endpoint, calls that move on to the next endpoint
// when theirs is unreachable.
#include "coordinator/store/etcd_client.h"

#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/grpc_status.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace lockstep::coordinator {
namespace {

bool Unreachable(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

}  // namespace

std::string EtcdClient::PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    unsigned char last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

void EtcdClient::AddAbsent(etcdserverpb::TxnRequest* txn, const std::string& key,
                           const std::string& range_end) {
  etcdserverpb::Compare* absent = txn->add_compare();
  absent->set_key(key);
  if (!range_end.empty()) absent->set_range_end(range_end);
  absent->set_target(etcdserverpb::Compare::CREATE);
  absent->set_result(etcdserverpb::Compare::EQUAL);
  absent->set_create_revision(0);
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Connect(const std::string& endpoints,
                                                                const std::string& probe_key,
                                                                absl::Duration timeout,
                                                                const TlsFiles& tls) {
  std::unique_ptr<EtcdClient> client(new EtcdClient(endpoints));
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(tls);
  if (!credentials.ok()) return credentials.status();
  for (absl::string_view part : absl::StrSplit(endpoints, ',', absl::SkipWhitespace())) {
    std::string address(absl::StripAsciiWhitespace(part));
    const bool https = absl::StartsWith(address, "https://");
    if (https && tls.ca.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd endpoint ", address, ": https:// needs ", tls.flags,
                       "_ca (the CA that signed etcd's certificates), and ", tls.flags,
                       "_cert and ", tls.flags, "_key where etcd asks for a client certificate"));
    }
    if (!https && tls.any()) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd endpoint ", address, ": ", tls.flags,
                       "_* are given, so every endpoint must be "
                       "https://HOST:PORT (TLS); this one would be plaintext"));
    }
    address = std::string(absl::StripPrefix(address, https ? "https://" : "http://"));
    address = std::string(absl::StripSuffix(address, "/"));
    if (address.empty() || address.find(':') == std::string::npos ||
        address.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "etcd endpoint '", part, "' is not http://HOST:PORT, https://HOST:PORT or HOST:PORT"));
    }
    grpc::ChannelArguments args;
    // A member that comes back is tried again within a second, not after gRPC's default
    // backoff of up to two minutes.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    // A page of jobs may exceed gRPC's default 4 MiB.
    args.SetMaxReceiveMessageSize(-1);
    std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(address, *credentials, args);
    client->endpoints_.push_back(Endpoint{address, etcdserverpb::KV::NewStub(channel),
                                          etcdserverpb::Lease::NewStub(channel)});
  }
  if (client->endpoints_.empty()) {
    return absl::InvalidArgumentError("no etcd endpoints (--etcd_endpoints=http://HOST:PORT,...)");
  }
  etcdserverpb::RangeRequest probe;
  probe.set_key(probe_key);
  probe.set_count_only(true);
  // Asked again until `timeout`: members that are starting refuse connections for a while.
  const absl::Time deadline = absl::Now() + timeout;
  absl::StatusOr<etcdserverpb::RangeResponse> answered = client->Range(probe);
  while (!answered.ok() && absl::IsUnavailable(answered.status()) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
    answered = client->Range(probe);
  }
  if (!answered.ok()) {
    return absl::UnavailableError(
        absl::StrCat("no etcd endpoint answers (", endpoints, "): ", answered.status().message()));
  }
  return client;
}

template <typename Call>
absl::Status EtcdClient::OnSomeEndpoint(const char* what, Call call) {
  const size_t n = endpoints_.size();
  const size_t first = current_.load();
  std::vector<std::string> failures;
  for (size_t i = 0; i < n; ++i) {
    const size_t index = (first + i) % n;
    Endpoint& endpoint = endpoints_[index];
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(call_timeout_ms_.load()));
    grpc::Status status = call(endpoint, &context);
    if (status.ok() || !Unreachable(status)) {
      current_.store(index);
      if (status.ok()) return absl::OkStatus();
      return absl::Status(
          ToAbslStatus(status).code(),
          absl::StrCat("etcd ", endpoint.address, ": ", what, ": ", status.error_message()));
    }
    failures.push_back(absl::StrCat(endpoint.address, ": ", status.error_message()));
  }
  return absl::UnavailableError(
      absl::StrCat("etcd ", what, ": no endpoint answered (", absl::StrJoin(failures, "; "), ")"));
}

absl::StatusOr<etcdserverpb::RangeResponse> EtcdClient::Range(
    const etcdserverpb::RangeRequest& request) {
  etcdserverpb::RangeResponse response;
  absl::Status s = OnSomeEndpoint("range", [&](Endpoint& e, grpc::ClientContext* context) {
    return e.kv->Range(context, request, &response);
  });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<etcdserverpb::TxnResponse> EtcdClient::Txn(const etcdserverpb::TxnRequest& request) {
  etcdserverpb::TxnResponse response;
  absl::Status s = OnSomeEndpoint("txn", [&](Endpoint& e, grpc::ClientContext* context) {
    return e.kv->Txn(context, request, &response);
  });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<etcdserverpb::LeaseGrantResponse> EtcdClient::LeaseGrant(int64_t ttl_seconds) {
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(ttl_seconds);
  etcdserverpb::LeaseGrantResponse response;
  absl::Status s = OnSomeEndpoint("lease grant", [&](Endpoint& e, grpc::ClientContext* context) {
    return e.lease->LeaseGrant(context, request, &response);
  });
  if (!s.ok()) return s;
  if (!response.error().empty()) {
    return absl::UnavailableError(absl::StrCat("etcd lease grant: ", response.error()));
  }
  return response;
}

absl::Status EtcdClient::LeaseRevoke(int64_t lease) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(lease);
  etcdserverpb::LeaseRevokeResponse response;
  return OnSomeEndpoint("lease revoke", [&](Endpoint& e, grpc::ClientContext* context) {
    return e.lease->LeaseRevoke(context, request, &response);
  });
}

absl::StatusOr<int64_t> EtcdClient::KeepAliveOnce(int64_t lease) {
  etcdserverpb::LeaseKeepAliveResponse response;
  absl::Status s = OnSomeEndpoint("lease keep-alive", [&](Endpoint& e,
                                                          grpc::ClientContext* context) {
    std::unique_ptr<grpc::ClientReaderWriter<etcdserverpb::LeaseKeepAliveRequest,
                                             etcdserverpb::LeaseKeepAliveResponse>>
        stream = e.lease->LeaseKeepAlive(context);
    etcdserverpb::LeaseKeepAliveRequest request;
    request.set_id(lease);
    const bool sent = stream->Write(request) && stream->WritesDone();
    const bool read = sent && stream->Read(&response);
    grpc::Status status = stream->Finish();
    if (status.ok() && !read) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the keep-alive stream ended unanswered");
    }
    return status;
  });
  if (!s.ok()) return s;
  return response.ttl();
}

}  // namespace lockstep::coordinator
