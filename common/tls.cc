#include "common/tls.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace lockstep {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const std::string& flag) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream contents;
  contents << in.rdbuf();
  std::string pem = contents.str();
  if (!absl::StrContains(pem, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is not a PEM file"));
  }
  return pem;
}

absl::Status CheckPair(const TlsFiles& files) {
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(files.flags, "_cert and ", files.flags,
                                                   "_key go together (a certificate and its "
                                                   "private key)"));
  }
  return absl::OkStatus();
}

std::string OrEnv(const std::string& flag, const char* variable) {
  if (!flag.empty()) return flag;
  const char* value = std::getenv(variable);
  return value != nullptr ? value : "";
}

}  // namespace

TlsFiles ServerTlsFiles(const std::string& cert, const std::string& key, const std::string& ca) {
  TlsFiles files;
  files.cert = OrEnv(cert, "LOCKSTEP_TLS_CERT");
  files.key = OrEnv(key, "LOCKSTEP_TLS_KEY");
  files.ca = OrEnv(ca, "LOCKSTEP_TLS_CA");
  return files;
}

TlsFiles ClientTlsFiles(const std::string& cert, const std::string& key, const std::string& ca,
                        const std::string& server_name) {
  TlsFiles files = ServerTlsFiles(cert, key, ca);
  files.server_name = server_name;
  return files;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files) {
  if (!files.any()) return grpc::InsecureServerCredentials();
  LOCKSTEP_RETURN_IF_ERROR(CheckPair(files));
  if (files.cert.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(files.flags, "_ca without ", files.flags,
                                                   "_cert/", files.flags,
                                                   "_key: the server needs its own certificate "
                                                   "for TLS"));
  }
  absl::StatusOr<std::string> cert = ReadPem(files.cert, files.flags + "_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(files.key, files.flags + "_key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({*key, *cert});
  if (!files.ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(files.ca, files.flags + "_ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files) {
  if (!files.any()) return grpc::InsecureChannelCredentials();
  LOCKSTEP_RETURN_IF_ERROR(CheckPair(files));
  if (files.ca.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS needs ", files.flags, "_ca: the CA certificate that signed the ",
                     files.flags == "--tls" ? "coordinator's" : "server's", " certificate"));
  }
  grpc::SslCredentialsOptions options;
  absl::StatusOr<std::string> ca = ReadPem(files.ca, files.flags + "_ca");
  if (!ca.ok()) return ca.status();
  options.pem_root_certs = *ca;
  if (!files.cert.empty()) {
    absl::StatusOr<std::string> cert = ReadPem(files.cert, files.flags + "_cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem(files.key, files.flags + "_key");
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *cert;
    options.pem_private_key = *key;
  }
  return grpc::SslCredentials(options);
}

bool IsLoopbackAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  const std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  return host == "localhost" || absl::StartsWith(host, "127.") || host == "[::1]";
}

}  // namespace lockstep
