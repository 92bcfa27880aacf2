// The TLS flags of a client daemon (lockstep-worker, lockstepctl): --tls_ca, --tls_cert,
// --tls_key, --tls_server_name, defined once here for both.
#pragma once

#include "common/tls.h"

namespace lockstep {

// The flags' files, each defaulting to $LOCKSTEP_TLS_CA / _CERT / _KEY (ClientTlsFiles).
TlsFiles ClientTlsFilesFromFlags();

}  // namespace lockstep
