// Jobs and the cluster id in etcd.
#include "coordinator/store/etcd_job_store.h"

#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace lockstep::coordinator {
namespace {

// Jobs read per page: their Job messages stay far below gRPC's 4 MiB message limit.
constexpr int64_t kJobsPerPage = 32;

bool IsClusterId(const std::string& id) {
  return id.size() == 6 && std::all_of(id.begin(), id.end(), [](char c) {
           return absl::ascii_isxdigit(static_cast<unsigned char>(c));
         });
}

}  // namespace

absl::Status EtcdJobStore::Save(const v1::Job& job) {
  if (job.job_id().empty() || job.job_id().find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("job id '", job.job_id(), "' is not a key"));
  }
  etcdserverpb::TxnRequest txn;
  leadership_->AddFence(&txn);
  etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(absl::StrCat(prefix_, "jobs/", job.job_id()));
  if (!job.SerializeToString(put->mutable_value())) {
    return absl::InternalError(absl::StrCat("cannot serialize ", job.job_id()));
  }
  absl::StatusOr<etcdserverpb::TxnResponse> answer = etcd_->Txn(txn);
  if (!answer.ok()) {
    // Unreachable, or etcd full (its space quota): what this coordinator decided is not
    // durable, so it must not go on as the leader (a job it accepted would be lost with it);
    // the standbys then refuse every call, saying why. A request too large for etcd fails that
    // one job's save (logged), as a disk error does on the file backend.
    if (absl::IsUnavailable(answer.status()) || absl::IsDeadlineExceeded(answer.status()) ||
        absl::IsResourceExhausted(answer.status())) {
      leadership_->WriteFailed(
          absl::StrCat("the write of ", job.job_id(), " (", answer.status().message(), ")"));
    }
    return absl::Status(answer.status().code(),
                        absl::StrCat("saving ", job.job_id(), " (", put->value().size(),
                                     " bytes) in etcd: ", answer.status().message()));
  }
  if (!answer->succeeded()) {
    const std::string what = absl::StrCat("the write of ", job.job_id());
    leadership_->Refused(what);
    return absl::FailedPreconditionError(absl::StrCat(
        what, " was refused: this coordinator no longer leads (term ", leadership_->term(), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::Job>> EtcdJobStore::LoadAll() {
  const std::string first = prefix_ + "jobs/";
  etcdserverpb::RangeRequest request;
  request.set_key(first);
  request.set_range_end(EtcdClient::PrefixEnd(first));
  request.set_limit(kJobsPerPage);
  std::vector<v1::Job> jobs;
  for (;;) {
    absl::StatusOr<etcdserverpb::RangeResponse> page = etcd_->Range(request);
    if (!page.ok()) return page.status();
    for (const etcdserverpb::KeyValue& kv : page->kvs()) {
      v1::Job job;
      if (!job.ParseFromString(kv.value()) || kv.key() != first + job.job_id()) {
        LOG(WARNING) << "skipping etcd key " << kv.key() << ": not a saved job";
        continue;
      }
      jobs.push_back(std::move(job));
    }
    if (!page->more() || page->kvs().empty()) break;
    request.set_key(page->kvs().rbegin()->key() + std::string(1, '\0'));
    // Later pages at the first page's revision: one consistent view.
    if (request.revision() == 0) request.set_revision(page->header().revision());
  }
  return jobs;
}

absl::StatusOr<std::string> EtcdClusterId(EtcdClient* etcd, const std::string& prefix) {
  const std::string key = prefix + "cluster_id";
  std::random_device rd;
  const std::string fresh = absl::StrFormat("%06x", rd() & 0xffffff);
  etcdserverpb::TxnRequest txn;
  EtcdClient::AddAbsent(&txn, key);
  // Created only under an empty prefix: keys without a cluster id are not ours.
  EtcdClient::AddAbsent(&txn, prefix, EtcdClient::PrefixEnd(prefix));
  etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(fresh);
  txn.add_failure()->mutable_request_range()->set_key(key);
  etcdserverpb::RangeRequest* other = txn.add_failure()->mutable_request_range();
  other->set_key(prefix);
  other->set_range_end(EtcdClient::PrefixEnd(prefix));
  other->set_limit(1);
  other->set_keys_only(true);
  absl::StatusOr<etcdserverpb::TxnResponse> answer = etcd->Txn(txn);
  if (!answer.ok()) return answer.status();
  if (answer->succeeded()) return fresh;
  if (answer->responses_size() == 2 && answer->responses(0).response_range().kvs_size() == 1) {
    const std::string id = answer->responses(0).response_range().kvs(0).value();
    if (!IsClusterId(id)) {
      return absl::DataLossError(
          absl::StrCat("etcd key ", key, " is not a cluster id (six hex digits): ", id));
    }
    return id;
  }
  std::string example;
  if (answer->responses_size() == 2 && answer->responses(1).response_range().kvs_size() > 0) {
    example = answer->responses(1).response_range().kvs(0).key();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("etcd prefix ", prefix, " holds keys that are not a Lockstep cluster's (",
                   example, ", and no ", key, "): choose another --etcd_prefix"));
}

}  // namespace lockstep::coordinator
