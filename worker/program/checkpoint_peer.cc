#include "worker/program/checkpoint_peer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "common/test_hooks.h"
#include "glog/logging.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "lockstep/v1/program.grpc.pb.h"

namespace lockstep::worker {
namespace {

std::string SecretOf(const grpc::ServerContext& context) {
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find(kCheckpointSecretMetadata);
  return it == metadata.end() ? "" : std::string(it->second.data(), it->second.size());
}

// Constant time in the secret's length.
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string HostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

// The longest a copy may take before it is given up (a peer that stopped reading).
constexpr absl::Duration kCopyDeadline = absl::Minutes(5);

}  // namespace

class CheckpointPeerServer::Service final : public v1::CheckpointPeerService::Service {
 public:
  explicit Service(CheckpointPeerServer* server) : server_(server) {}

  grpc::Status Put(grpc::ServerContext* context, grpc::ServerReader<v1::CheckpointChunk>* reader,
                   v1::CheckpointPutResponse*) override {
    v1::CheckpointChunk chunk;
    if (!reader->Read(&chunk) || !chunk.has_header()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "header: the first message of a copy names the save");
    }
    const v1::CheckpointCopyHeader header = chunk.header();
    if (header.source_worker().empty() || header.payload_bytes() == 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "header: source_worker and payload_bytes are required");
    }
    if (absl::Status s = server_->Admit(header.job_id(), SecretOf(*context)); !s.ok()) {
      return ToGrpcStatus(s);
    }
    CheckpointMemory* const memory = server_->memory();
    absl::StatusOr<std::vector<std::string>> pair = memory->ReplicaSlots(
        header.job_id(), header.source_worker(),
        kCheckpointSlotHeaderBytes + static_cast<int64_t>(header.payload_bytes()));
    if (!pair.ok()) return ToGrpcStatus(pair.status());
    absl::StatusOr<std::unique_ptr<SlotWriter>> writer = SlotWriter::Begin(
        *pair, header.step(), header.payload_bytes(), header.checksum());
    if (!writer.ok()) return ToGrpcStatus(writer.status());
    do {
      if (!chunk.data().empty()) {
        if (absl::Status s = (*writer)->Append(chunk.data().data(), chunk.data().size());
            !s.ok()) {
          return ToGrpcStatus(s);
        }
      }
    } while (reader->Read(&chunk));
    if (context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the copy was cancelled by its sender");
    }
    absl::StatusOr<HeldCheckpoint> held = (*writer)->Commit();
    if (!held.ok()) {
      LOG(WARNING) << "checkpoint copy of " << header.source_worker() << "'s step "
                   << header.step() << " refused: " << held.status().message();
      return ToGrpcStatus(held.status());
    }
    return grpc::Status::OK;
  }

  grpc::Status Fetch(grpc::ServerContext* context, const v1::CheckpointFetchRequest* request,
                     grpc::ServerWriter<v1::CheckpointChunk>* writer) override {
    if (absl::Status s = server_->Admit(request->job_id(), SecretOf(*context)); !s.ok()) {
      return ToGrpcStatus(s);
    }
    std::vector<HeldCheckpoint> held =
        server_->memory()->Committed(request->job_id(), request->source_worker());
    const auto it = std::find_if(held.begin(), held.end(), [&](const HeldCheckpoint& h) {
      return h.step == request->step();
    });
    if (it == held.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("no copy of ", request->source_worker(), "'s step ",
                                       request->step(), " is kept here"));
    }
    v1::CheckpointChunk chunk;
    v1::CheckpointCopyHeader* header = chunk.mutable_header();
    header->set_job_id(request->job_id());
    header->set_source_worker(request->source_worker());
    header->set_step(it->step);
    header->set_payload_bytes(it->payload_bytes);
    header->set_checksum(it->checksum);
    if (!writer->Write(chunk)) return grpc::Status(grpc::StatusCode::CANCELLED, "fetch ended");
    chunk.clear_header();
    const absl::Status read =
        ReadCheckpointPayload(*it, kCheckpointChunkBytes, [&](const void* data, size_t n) {
          chunk.set_data(data, n);
          if (!writer->Write(chunk)) return absl::CancelledError("fetch ended");
          // Test hook: the fetch is on its way, the fetcher has not committed it.
          test_hooks::Reach("checkpoint_fetch_midway", request->step());
          return absl::OkStatus();
        });
    return ToGrpcStatus(read);
  }

 private:
  CheckpointPeerServer* const server_;
};

absl::StatusOr<std::unique_ptr<CheckpointPeerServer>> CheckpointPeerServer::Start(
    const std::string& host, CheckpointMemory* memory) {
  auto server = std::unique_ptr<CheckpointPeerServer>(new CheckpointPeerServer());
  server->memory_ = memory;
  server->service_ = std::make_unique<Service>(server.get());
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(HostPort(host, 0), grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(kCheckpointMessageLimit);
  builder.AddChannelArgument("grpc.http2.lookahead_bytes", kCheckpointMessageLimit * 4);
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve checkpoint copies on ", HostPort(host, 0)));
  }
  server->address_ = HostPort(host, port);
  return server;
}

CheckpointPeerServer::~CheckpointPeerServer() {
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
}

std::unique_ptr<CheckpointPeerServer::Registration> CheckpointPeerServer::Serve(
    const std::string& job_id, const std::string& secret) {
  absl::MutexLock lock(&mu_);
  secrets_[job_id] = secret;
  return std::unique_ptr<Registration>(new Registration(this, job_id, secret));
}

CheckpointPeerServer::Registration::~Registration() {
  absl::MutexLock lock(&server_->mu_);
  const auto it = server_->secrets_.find(job_id_);
  if (it != server_->secrets_.end() && it->second == secret_) server_->secrets_.erase(it);
}

absl::Status CheckpointPeerServer::Admit(const std::string& job_id,
                                         const std::string& secret) const {
  absl::MutexLock lock(&mu_);
  const auto it = secrets_.find(job_id);
  if (it == secrets_.end() || it->second.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("this worker does not serve a generation of job ", job_id, " now"));
  }
  if (!SameSecret(it->second, secret)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "wrong or missing ", kCheckpointSecretMetadata, " for job ", job_id,
        " (a caller of another generation)"));
  }
  return absl::OkStatus();
}

CheckpointReplicator::CheckpointReplicator(CheckpointMemory* memory, std::string job_id,
                                           std::string worker, std::string peer_worker,
                                           std::string peer_address, std::string secret,
                                           absl::Duration interval)
    : job_id_(std::move(job_id)),
      worker_(std::move(worker)),
      peer_address_(std::move(peer_address)),
      secret_(std::move(secret)),
      channel_(grpc::CreateChannel(peer_address_, grpc::InsecureChannelCredentials())) {
  follower_ = std::make_unique<SaveFollower>(
      memory, job_id_, absl::StrCat("checkpoint copies to ", peer_worker, " (", peer_address_, ")"),
      SaveFollower::Options{1, interval, kDuty},
      [this](const HeldCheckpoint& save) { return Copy(save); },
      [this] {
        absl::MutexLock lock(&mu_);
        cancelled_ = true;
        stopping_ = true;
        if (in_flight_ != nullptr) in_flight_->TryCancel();
      });
}

CheckpointReplicator::~CheckpointReplicator() { follower_.reset(); }

absl::Status CheckpointReplicator::Copy(const HeldCheckpoint& save) {
  auto stub = v1::CheckpointPeerService::NewStub(channel_);
  grpc::ClientContext context;
  context.AddMetadata(kCheckpointSecretMetadata, secret_);
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(kCopyDeadline));
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return absl::CancelledError("stopping");
    in_flight_ = &context;
  }
  v1::CheckpointPutResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::CheckpointChunk>> writer =
      stub->Put(&context, &response);
  v1::CheckpointChunk chunk;
  v1::CheckpointCopyHeader* header = chunk.mutable_header();
  header->set_job_id(job_id_);
  header->set_source_worker(worker_);
  header->set_step(save.step);
  header->set_payload_bytes(save.payload_bytes);
  header->set_checksum(save.checksum);
  bool open = writer->Write(chunk);
  chunk.clear_header();
  absl::Status read = absl::OkStatus();
  if (open) {
    read = ReadCheckpointPayload(save, kCheckpointChunkBytes, [&](const void* data, size_t n) {
      chunk.set_data(data, n);
      if (!writer->Write(chunk)) return absl::UnavailableError("stream closed");
      // Test hook: the copy is on its way, the peer has not committed it.
      test_hooks::Reach("checkpoint_copy_midway", save.step, &stopping_);
      return absl::OkStatus();
    });
    // A save overwritten while read is not committed there: the stream ends cancelled.
    if (!read.ok() && !absl::IsUnavailable(read)) context.TryCancel();
    writer->WritesDone();
  }
  const grpc::Status finished = writer->Finish();
  {
    absl::MutexLock lock(&mu_);
    in_flight_ = nullptr;
  }
  if (!read.ok() && !absl::IsUnavailable(read)) return read;
  return ToAbslStatus(finished);
}

absl::StatusOr<HeldCheckpoint> FetchCheckpoint(CheckpointMemory* memory, const std::string& address,
                                               const std::string& holder, const std::string& secret,
                                               const std::string& job_id,
                                               const std::string& source_worker, int64_t step,
                                               const std::atomic<bool>* abort) {
  const auto named = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("fetching ",
                                               source_worker.empty() ? holder : source_worker,
                                               "'s checkpoint of step ", step, " from ", holder,
                                               " (", address, "): ", s.message()));
  };
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kCheckpointMessageLimit);
  args.SetInt("grpc.http2.lookahead_bytes", kCheckpointMessageLimit * 4);
  auto stub = v1::CheckpointPeerService::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext context;
  context.AddMetadata(kCheckpointSecretMetadata, secret);
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(kCopyDeadline));
  v1::CheckpointFetchRequest request;
  request.set_job_id(job_id);
  request.set_source_worker(source_worker);
  request.set_step(step);
  std::unique_ptr<grpc::ClientReader<v1::CheckpointChunk>> reader = stub->Fetch(&context, request);
  v1::CheckpointChunk chunk;
  std::unique_ptr<SlotWriter> writer;
  absl::Status status = absl::OkStatus();
  while (status.ok() && reader->Read(&chunk)) {
    if (writer == nullptr) {
      if (!chunk.has_header() || chunk.header().step() != step ||
          chunk.header().payload_bytes() == 0) {
        status = absl::DataLossError("the holder's first message is not the save's header");
        break;
      }
      const v1::CheckpointCopyHeader& h = chunk.header();
      absl::StatusOr<std::vector<std::string>> pair =
          memory->Slots(job_id, kCheckpointSlotHeaderBytes + static_cast<int64_t>(h.payload_bytes()));
      if (!pair.ok()) {
        status = pair.status();
        break;
      }
      absl::StatusOr<std::unique_ptr<SlotWriter>> begun =
          SlotWriter::Begin(*pair, h.step(), h.payload_bytes(), h.checksum());
      if (!begun.ok()) {
        status = begun.status();
        break;
      }
      writer = *std::move(begun);
    }
    if (!chunk.data().empty()) status = writer->Append(chunk.data().data(), chunk.data().size());
    if (status.ok() && abort != nullptr && abort->load()) {
      status = absl::CancelledError("the generation was aborted");
    }
  }
  if (!status.ok()) context.TryCancel();
  const grpc::Status finished = reader->Finish();
  if (!status.ok()) return named(status);
  if (!finished.ok()) return named(ToAbslStatus(finished));
  if (writer == nullptr) return named(absl::DataLossError("the holder sent nothing"));
  absl::StatusOr<HeldCheckpoint> held = writer->Commit();
  if (!held.ok()) return named(held.status());
  return held;
}

}  // namespace lockstep::worker
