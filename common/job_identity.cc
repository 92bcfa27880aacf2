// Training fingerprint: everything but the operational fields, serialized deterministically.
#include "common/job_identity.h"

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "common/hash.h"

namespace lockstep {

uint64_t TrainingFingerprint(const v1::JobSpec& spec) {
  v1::JobSpec s = spec;
  s.clear_name();
  s.clear_min_workers();
  s.clear_max_workers();
  s.clear_heartbeat_timeout_ms();
  s.clear_step_timeout_ms();
  s.clear_collective_timeout_ms();
  s.clear_rendezvous_timeout_ms();
  s.clear_max_restarts();
  s.clear_checkpoint_every_steps();
  s.clear_checkpoint_dir();
  s.clear_keep_checkpoints();
  s.clear_checkpoint_failure_policy();
  s.clear_skip_evaluation();
  s.clear_threads_per_worker();
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream out(&stream);
    out.SetSerializationDeterministic(true);
    s.SerializeToCodedStream(&out);
  }
  return Fnv1a64(bytes.data(), bytes.size());
}

}  // namespace lockstep
