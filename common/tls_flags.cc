#include "common/tls_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_ca, "",
          "TLS to the coordinator: the CA certificate (PEM) that signed its certificate "
          "(default $LOCKSTEP_TLS_CA; none: plaintext).");
ABSL_FLAG(std::string, tls_cert, "",
          "Mutual TLS: this client's certificate (PEM), signed by a CA the coordinator trusts "
          "(default $LOCKSTEP_TLS_CERT).");
ABSL_FLAG(std::string, tls_key, "",
          "Mutual TLS: the private key of --tls_cert (default $LOCKSTEP_TLS_KEY).");
ABSL_FLAG(std::string, tls_server_name, "",
          "The name to check the coordinator's certificate against when the address is not in "
          "it.");

namespace lockstep {

TlsFiles ClientTlsFilesFromFlags() {
  return ClientTlsFiles(absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                        absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_server_name));
}

}  // namespace lockstep
