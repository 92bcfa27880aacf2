#include "coordinator/service/client_gate.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/coordinators.h"
#include "common/grpc_status.h"
#include "glog/logging.h"

namespace lockstep::coordinator {
namespace {

// "ipv4:172.18.0.4:51234" -> "172.18.0.4"; "ipv6:[::1]:5000" -> "[::1]". Ports change with
// every connection, so a retrying client would otherwise fill the table.
std::string PeerHost(const std::string& peer) {
  std::string host = peer;
  for (const char* scheme : {"ipv4:", "ipv6:", "unix:"}) {
    if (absl::StartsWith(host, scheme)) host = host.substr(std::string(scheme).size());
  }
  if (size_t colon = host.rfind(':');
      colon != std::string::npos && host.find(':') == colon) {  // host:port, not bare IPv6
    host = host.substr(0, colon);
  } else if (!host.empty() && host.front() == '[') {
    host = host.substr(0, host.find(']') + 1);
  }
  return host;
}

}  // namespace

absl::Status ClientGate::Check(absl::string_view authorization, Role role) const {
  if (!worker_checker_.enabled()) return checker_.CheckHeader(authorization);
  const TokenChecker& mine = role == Role::kWorker ? worker_checker_ : checker_;
  const TokenChecker& theirs = role == Role::kWorker ? checker_ : worker_checker_;
  if (mine.Matches(authorization)) return absl::OkStatus();
  if (theirs.Matches(authorization)) {
    return absl::PermissionDeniedError(
        role == Role::kWorker
            ? "this is an operator's token: it cannot join as a worker or use the store (workers "
              "have a token of their own)"
            : "this is a worker's token: workers cannot submit, cancel or read jobs (operators "
              "have a token of their own)");
  }
  return mine.CheckHeader(authorization);
}

grpc::Status ClientGate::Admit(grpc::ServerContextBase& context, Role role) {
  if (term_ > 0) context.AddInitialMetadata(kTermMetadataKey, absl::StrCat(term_));
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kAuthorizationKey);
  const absl::string_view authorization =
      it == metadata.end() ? absl::string_view()
                           : absl::string_view(it->second.data(), it->second.size());
  absl::Status status = Check(authorization, role);
  if (status.ok()) return grpc::Status::OK;
  return ToGrpcStatus(Reject(std::move(status), PeerHost(context.peer()), ClientName(context)));
}

absl::Status ClientGate::AdmitHttp(const std::string& peer_host, const std::string& client,
                                   absl::string_view authorization) {
  absl::Status status = Check(authorization, Role::kOperator);
  if (status.ok()) return status;
  return Reject(std::move(status), peer_host, client);
}

absl::Status ClientGate::Reject(absl::Status status, const std::string& peer,
                                const std::string& client) {
  const int64_t now_ms = absl::ToUnixMillis(clock_->Now());
  int64_t count = 0;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = rejected_.try_emplace({peer, client});
    v1::RejectedClient& entry = it->second;
    if (inserted) {
      entry.set_peer(peer);
      entry.set_client(client);
      entry.set_first_unix_ms(now_ms);
    }
    entry.set_reason(std::string(status.message()));
    entry.set_count(entry.count() + 1);
    ++rejected_calls_;
    entry.set_last_unix_ms(now_ms);
    count = entry.count();
    // Evict an entry of this address when it has too many, else of everyone when the table is
    // full (never the entry just rejected): the least often rejected, the oldest of those. A
    // client that keeps retrying with a wrong token is what an operator looks for; a flood of
    // made-up client names, each rejected once, then only pushes out its own entries.
    size_t of_peer = 0;
    for (const auto& [key, e] : rejected_) of_peer += key.first == peer;
    const bool peer_only = of_peer > kMaxRememberedPerAddress;
    if (peer_only || rejected_.size() > kMaxRemembered) {
      auto victim = rejected_.end();
      for (auto e = rejected_.begin(); e != rejected_.end(); ++e) {
        if (e == it || (peer_only && e->first.first != peer)) continue;
        if (victim == rejected_.end() || e->second.count() < victim->second.count() ||
            (e->second.count() == victim->second.count() &&
             e->second.last_unix_ms() < victim->second.last_unix_ms())) {
          victim = e;
        }
      }
      if (victim != rejected_.end()) rejected_.erase(victim);
    }
  }
  // The first rejection and then every 100th: a retrying client must not flood the log.
  if (count == 1 || count % 100 == 0) {
    LOG(WARNING) << "rejected " << (client.empty() ? "a client" : client) << " at " << peer << " ("
                 << count << (count == 1 ? " call" : " calls") << "): " << status.message();
  }
  return status;
}

std::pair<int64_t, int64_t> ClientGate::RejectedCounts() const {
  absl::MutexLock lock(&mu_);
  return {rejected_calls_, static_cast<int64_t>(rejected_.size())};
}

std::vector<v1::RejectedClient> ClientGate::Rejected() const {
  std::vector<v1::RejectedClient> result;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, entry] : rejected_) result.push_back(entry);
  }
  std::sort(result.begin(), result.end(),
            [](const auto& a, const auto& b) { return a.last_unix_ms() > b.last_unix_ms(); });
  return result;
}

}  // namespace lockstep::coordinator
