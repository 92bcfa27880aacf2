// Certificates for tests, made once per test process with openssl in a temporary directory: a
// CA ("ca") and another ("other-ca"); a server certificate for 127.0.0.1 and localhost
// ("server"); client certificates "w0" and "w1" (common names w0, w1), "ctl" (lockstepctl) and
// "stranger" (signed by other-ca); and "expired" (signed by ca, expired in 2020). Each NAME has
// NAME.crt and NAME.key.
#pragma once

#include <string>

namespace lockstep::testing {

class Pki {
 public:
  static const Pki& Get();
  std::string dir;
  bool ok = false;    // openssl made them all
  std::string error;  // what openssl said otherwise
  std::string Path(const std::string& name) const { return dir + "/" + name; }

 private:
  Pki();
};

}  // namespace lockstep::testing
