// GlooStore: Status -> gloo::IoException, at Gloo's boundary only.
#include "worker/comm/gloo_store.h"

#include "gloo/common/error.h"

namespace lockstep::worker {

GlooStore::GlooStore(std::shared_ptr<StoreClient> client, absl::Duration timeout)
    : client_(std::move(client)), timeout_(timeout) {}

void GlooStore::Throw(absl::Status status) {
  {
    absl::MutexLock lock(&mu_);
    if (failure_.ok()) failure_ = status;
  }
  throw gloo::IoException(status.ToString());
}

absl::Status GlooStore::failure() const {
  absl::MutexLock lock(&mu_);
  return failure_;
}

void GlooStore::set(const std::string& key, const std::vector<char>& data) {
  absl::Status s = client_->Set(key, std::string(data.begin(), data.end()));
  if (!s.ok()) Throw(std::move(s));
}

std::vector<char> GlooStore::get(const std::string& key) {
  absl::StatusOr<std::string> value = client_->Get(key, timeout_);
  if (!value.ok()) Throw(value.status());
  return std::vector<char>(value->begin(), value->end());
}

void GlooStore::wait(const std::vector<std::string>& keys) { wait(keys, absl::ToChronoMilliseconds(timeout_)); }

void GlooStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  absl::Status s = client_->Wait(keys, absl::FromChrono(timeout));
  if (!s.ok()) Throw(std::move(s));
}

}  // namespace lockstep::worker
