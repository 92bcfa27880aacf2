#include "common/auth.h"

#include <sys/random.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace lockstep {
namespace {

constexpr absl::string_view kBearer = "Bearer ";

// Constant-time in the token's length, so a wrong guess does not reveal its prefix.
bool SameToken(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

absl::Status ValidateToken(absl::string_view token, absl::string_view origin) {
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(origin, ": token is empty"));
  for (char c : token) {
    // Metadata values are printable ASCII; a token with anything else could never match.
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat(origin, ": token may contain only printable ASCII without spaces"));
    }
  }
  return absl::OkStatus();
}

absl::string_view Value(const grpc::ServerContextBase& context, const char* key) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(key);
  if (it == metadata.end()) return {};
  return absl::string_view(it->second.data(), it->second.size());
}

}  // namespace

std::string RandomSecret() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string secret;
  for (unsigned char b : bytes) {
    secret += kHex[b >> 4];
    secret += kHex[b & 15];
  }
  return secret;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("token file ", path, ": cannot be read"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(buffer.str()));
  LOCKSTEP_RETURN_IF_ERROR(ValidateToken(token, absl::StrCat("token file ", path)));
  return token;
}

absl::StatusOr<std::string> ResolveToken(const std::string& token_file_flag,
                                         const std::string& env_prefix) {
  if (!token_file_flag.empty()) return ReadTokenFile(token_file_flag);
  const std::string file_env = env_prefix + "_FILE";
  if (const char* file = std::getenv(file_env.c_str()); file != nullptr && *file != '\0') {
    return ReadTokenFile(file);
  }
  if (const char* token = std::getenv(env_prefix.c_str()); token != nullptr && *token != '\0') {
    std::string stripped(absl::StripAsciiWhitespace(token));
    LOCKSTEP_RETURN_IF_ERROR(ValidateToken(stripped, "$" + env_prefix));
    return stripped;
  }
  return std::string();
}

bool TokenChecker::Matches(absl::string_view header) const {
  return enabled() && absl::StartsWith(header, kBearer) &&
         SameToken(header.substr(kBearer.size()), expected_);
}

absl::Status TokenChecker::Check(const grpc::ServerContextBase& context) const {
  return CheckHeader(Value(context, kAuthorizationKey));
}

absl::Status TokenChecker::CheckHeader(absl::string_view header) const {
  if (expected_.empty()) return absl::OkStatus();
  if (header.empty()) {
    return absl::UnauthenticatedError(
        "missing token: this coordinator requires one (--token_file, $LOCKSTEP_TOKEN_FILE or "
        "$LOCKSTEP_TOKEN)");
  }
  if (!absl::StartsWith(header, kBearer) || !SameToken(header.substr(kBearer.size()), expected_)) {
    return absl::UnauthenticatedError("wrong token: it does not match the coordinator's token");
  }
  return absl::OkStatus();
}

std::string ClientName(const grpc::ServerContextBase& context) {
  return std::string(Value(context, kClientKey));
}

std::string SessionKey(const grpc::ServerContextBase& context) {
  return std::string(Value(context, kSessionKeyMetadata));
}

}  // namespace lockstep
