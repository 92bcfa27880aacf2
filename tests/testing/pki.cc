#include "tests/testing/pki.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/testing/cluster.h"

namespace lockstep::testing {

const Pki& Pki::Get() {
  static const Pki* pki = new Pki();
  return *pki;
}

Pki::Pki() {
  dir = std::filesystem::temp_directory_path() / absl::StrCat("lockstep-pki-", getpid());
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/san.ext") << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
  std::ofstream(dir + "/ca.cnf")
      << "[ca]\ndefault_ca=ca\n[ca]\ndir=" << dir << "\ndatabase=" << dir
      << "/index.txt\nserial=" << dir << "/serial\nnew_certs_dir=" << dir
      << "\ndefault_md=sha256\npolicy=any\nunique_subject=no\n[any]\ncommonName=supplied\n";
  std::ofstream(dir + "/index.txt");
  std::ofstream(dir + "/serial") << "1000\n";
  const std::vector<std::string> lines = {
      "set -e",
      "cd " + dir,
      "gen() { openssl req -newkey rsa:2048 -nodes -keyout $1.key -subj /CN=$2 -out $1.csr "
      "2>/dev/null; }",
      "sign() { openssl x509 -req -in $1.csr -CA $2.crt -CAkey $2.key -CAcreateserial "
      "-days 30 -out $1.crt $3 2>/dev/null; }",
      "for ca in ca other-ca; do openssl req -x509 -newkey rsa:2048 -nodes -keyout $ca.key "
      "-subj /CN=$ca -days 30 -out $ca.crt 2>/dev/null; done",
      "gen server localhost && sign server ca '-extfile san.ext'",
      // A worker's certificate carries its name (under mutual TLS it registers as that).
      "for w in w0 w1; do gen $w $w && sign $w ca; done",
      "gen ctl lockstepctl && sign ctl ca",
      "gen stranger stranger && sign stranger other-ca",
      "gen expired expired",
      "openssl ca -batch -config ca.cnf -cert ca.crt -keyfile ca.key -in expired.csr "
      "-out expired.crt -startdate 20200101000000Z -enddate 20200102000000Z 2>/dev/null",
  };
  const std::string script = absl::StrJoin(lines, "\n");
  absl::StatusOr<CommandResult> made = RunCommand({"/bin/bash", "-c", script}, absl::Seconds(120));
  ok = made.ok() && made->exit_code == 0;
  error = made.ok() ? made->output : std::string(made.status().message());
}

}  // namespace lockstep::testing
