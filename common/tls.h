// TLS for the gRPC API: server credentials for the coordinator (and mutual TLS when it is given
// a CA for clients), channel credentials for workers and lockstepctl. Plaintext when no file is
// given. Peers' collectives (Gloo, shared memory, NCCL) are not carried by these channels.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace lockstep {

struct TlsFiles {
  std::string cert;  // PEM certificate chain: the server's, or a client's for mutual TLS
  std::string key;   // its PEM private key
  std::string ca;    // server: CA whose client certificates are required; client: CA that
                     // signed the server's certificate
  // Client: the name to check the server's certificate against, when the address is not in
  // it (e.g. an IP address the certificate does not list).
  std::string server_name;
  // The flags' common prefix, which errors name: "--tls" (--tls_cert, ...) or, for the
  // coordinator's connection to etcd, "--etcd_tls".
  std::string flags = "--tls";
  bool any() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// The files from the flags, each defaulting to its environment variable ($LOCKSTEP_TLS_CERT,
// $LOCKSTEP_TLS_KEY, $LOCKSTEP_TLS_CA) when the flag is empty.
TlsFiles ServerTlsFiles(const std::string& cert, const std::string& key, const std::string& ca);
TlsFiles ClientTlsFiles(const std::string& cert, const std::string& key, const std::string& ca,
                        const std::string& server_name);

// Plaintext when no file is given. INVALID_ARGUMENT for a certificate without its key (or the
// reverse), a CA-only server, or a file that cannot be read (naming it and the flag).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files);
// Plaintext when no file is given; TLS needs --tls_ca (the server's CA), and a client
// certificate and key for mutual TLS.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files);

// True when `address` (HOST:PORT) listens only on a loopback interface.
bool IsLoopbackAddress(const std::string& address);

}  // namespace lockstep
