// Shared-token authentication for every Lockstep RPC (docs/architecture.md). Clients send
// "authorization: Bearer <token>" on every call; the coordinator compares it in constant time and
// answers UNAUTHENTICATED when it is missing or wrong. Clients also name themselves
// ("x-lockstep-client") so that the coordinator can show who was turned away.
//
// Where a daemon or lockstepctl finds its token, first match wins:
//   --token_file=PATH, $LOCKSTEP_TOKEN_FILE (a path, e.g. a Docker or systemd secret),
//   $LOCKSTEP_TOKEN (the token itself, e.g. from an env file). None: no token.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/server_context.h"

namespace lockstep {

inline constexpr char kAuthorizationKey[] = "authorization";
inline constexpr char kClientKey[] = "x-lockstep-client";
// A worker's session secret on its store calls (WorkerService's Registered.session_key).
inline constexpr char kSessionKeyMetadata[] = "x-lockstep-session";

// 128 random bits from the kernel (getrandom), as 32 hex digits: session keys, the secrets of
// programs' endpoints, names of checkpoint slots.
std::string RandomSecret();

// Reads a token file; surrounding whitespace (a trailing newline) is dropped. Errors name the
// path: unreadable, empty, or with characters that cannot go into metadata.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// The token from --token_file or the environment, as described above; "" when none is set.
// `env_prefix` names the variables: "LOCKSTEP_TOKEN" reads $LOCKSTEP_TOKEN_FILE and
// $LOCKSTEP_TOKEN; "LOCKSTEP_WORKER_TOKEN" the coordinator's worker token.
absl::StatusOr<std::string> ResolveToken(const std::string& token_file_flag,
                                         const std::string& env_prefix = "LOCKSTEP_TOKEN");

// What a client attaches to each call.
struct ClientAuth {
  std::string token;   // empty: send no authorization header
  std::string client;  // e.g. "lockstep-worker w-3"; shown by the coordinator on rejection
  // TLS (common/tls.h, MakeChannelCredentials); null: plaintext. `server_name` overrides the
  // name the server's certificate is checked against.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string server_name;
};

// Server side. An empty expected token accepts everything.
class TokenChecker {
 public:
  explicit TokenChecker(std::string expected) : expected_(std::move(expected)) {}
  bool enabled() const { return !expected_.empty(); }
  // Whether `header` ("Bearer <token>") carries exactly this token (false when disabled).
  bool Matches(absl::string_view header) const;
  // UNAUTHENTICATED with "missing token" or "wrong token" and what to do about it.
  absl::Status Check(const grpc::ServerContextBase& context) const;
  // The same for the value of an "authorization" header ("Bearer <token>"; HTTP requests).
  absl::Status CheckHeader(absl::string_view header) const;

 private:
  std::string expected_;
};

// The client's self-description from its metadata ("" when it sent none).
std::string ClientName(const grpc::ServerContextBase& context);
// The session key a worker's store call carries ("" when none).
std::string SessionKey(const grpc::ServerContextBase& context);

}  // namespace lockstep
