// The training step loop.
#include "worker/train/trainer.h"


#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/hash.h"
#include "common/job_memory.h"
#include "common/model_family.h"
#include "common/process_memory.h"
#include "glog/logging.h"
#include "kernels/cpu_kernels.h"
#include "common/checkpoint.h"
#include "worker/step/cpu_step.h"
#include "worker/model/generate.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/job_identity.h"
#include "common/test_hooks.h"
#include "xxhash.h"

namespace lockstep::worker {
namespace {

// The evaluation's loss is summed in fixed point with this resolution: a chunk's loss sum (at
// most about 1024 samples, or a micro-batch of windows, times a loss near ln(vocabulary))
// stays far below the 2^51 limit, and its rounding (2^-25 per chunk) far below what is shown.
constexpr int kEvalFracBits = 24;

// The samples of an epoch: a classifier's training samples, or a language model's windows.
int64_t TrainSamples(const v1::JobSpec& spec, const Dataset& data) {
  return data.language ? data.train_tokens.Windows(TokenShapeOf(spec.model()).context)
                       : data.train.samples;
}

// What the data must offer a language model; INVALID_ARGUMENT naming the field.
absl::Status CheckLanguageData(const v1::JobSpec& spec, const Dataset& data) {
  const v1::ModelSpec& m = spec.model();
  if (!IsLanguageModel(m)) {
    return absl::InvalidArgumentError(absl::StrCat("model.type: \"", m.type(), "\" cannot train on ",
                                                   spec.dataset().type(),
                                                   " data (use a language model)"));
  }
  const TokenShape shape = TokenShapeOf(m);
  const int context = shape.context;
  // The family's fields, as a user names them ("model.gpt.context_length").
  const std::string family = absl::StrCat("model.", m.type(), ".");
  if (data.train_tokens.Windows(context) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        family, "context_length: ", context, " is beyond what the data set can fill: ",
        data.source, " has ", data.train_tokens.tokens, " training tokens, fewer than one window of ",
        context + 1));
  }
  if (!spec.skip_evaluation() || spec.eval_every_steps() > 0) {
    if (data.valid_tokens.Windows(context) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          family, "context_length: ", context, " is beyond what the validation split can fill (",
          data.valid_tokens.tokens, " tokens; a window takes ", context + 1,
          "): raise dataset.validation_fraction, give a longer validation file, or set "
          "skip_evaluation"));
    }
  }
  if (data.max_token >= shape.vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        family, "vocab_size: ", shape.vocab, " is smaller than the data's largest token + 1 (",
        data.max_token + 1, ", in ", data.source, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const std::string& job_id,
                                                         const v1::JobSpec& given,
                                                         std::shared_ptr<const Dataset> data,
                                                         Communicator* comm) {
  // The model in its canonical form (a spec of the form before the family messages too).
  v1::JobSpec spec = given;
  NormalizeModelSpec(*spec.mutable_model());
  if (data->language) {
    LOCKSTEP_RETURN_IF_ERROR(CheckLanguageData(spec, *data));
  } else if (IsLanguageModel(spec.model())) {
    return absl::InvalidArgumentError(absl::StrCat("model.type: \"", spec.model().type(),
                                                   "\" trains on \"text\" or \"tokens\" data, not ",
                                                   spec.dataset().type()));
  }
  absl::StatusOr<std::unique_ptr<Model>> model =
      CreateModel(spec.model(), DataShape{data->dim, data->classes});
  if (!model.ok()) return model.status();
  const int64_t samples = TrainSamples(spec, *data);
  if (spec.global_batch_size() > samples) {
    return absl::FailedPreconditionError(absl::StrCat(
        "global_batch_size ", spec.global_batch_size(), " exceeds the ", samples,
        data->language ? " training windows" : " training samples", " of the data set"));
  }
  if (spec.micro_shards() <= 0 || spec.global_batch_size() % spec.micro_shards() != 0 ||
      comm->size() > spec.micro_shards()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot split global batch ", spec.global_batch_size(), " into ",
                     spec.micro_shards(), " micro-shards over ", comm->size(), " workers"));
  }
  return std::unique_ptr<Trainer>(
      new Trainer(job_id, spec, std::move(data), comm, *std::move(model)));
}

Trainer::Trainer(const std::string& job_id, const v1::JobSpec& spec,
                 std::shared_ptr<const Dataset> data, Communicator* comm,
                 std::unique_ptr<Model> model)
    : job_id_(job_id),
      spec_(spec),
      training_fingerprint_(TrainingFingerprint(spec)),
      data_(std::move(data)),
      comm_(comm),
      model_(std::move(model)),
      sampler_(TrainSamples(spec, *data_), spec.global_batch_size(), spec.micro_shards(),
               spec.seed()) {
  const int64_t spe = sampler_.steps_per_epoch();
  total_steps_ = spec.epochs() > 0 ? spec.epochs() * spe : spec.max_steps();
  if (spec.max_steps() > 0) total_steps_ = std::min(total_steps_, spec.max_steps());
  model_->Initialize(spec.model().init_seed() != 0 ? spec.model().init_seed() : spec.seed());
  optimizer_ = std::make_unique<Optimizer>(spec.optimizer(), model_->segments(), total_steps_);
  layout_ = data_->language ? SampleLayout{0, TokenShapeOf(spec.model()).context + 1}
                            : SampleLayout{data_->dim, 0};
  set_engine(nullptr);
  set_communicator(comm);
  if (model_->num_frozen_params() > 0) {
    LOG(INFO) << job_id_ << ": " << model_->num_frozen_params() << " of " << model_->num_params()
              << " parameters frozen; each step sums " << model_->num_grads() << " gradient values";
  }
}

absl::StatusOr<HostBatch> Trainer::LoadBatch(const int64_t* indices, int n) {
  absl::StatusOr<HostBatch> batch = engine_->HostBuffers(n);
  if (!batch.ok()) return batch.status();
  if (data_->language) {
    const int context = TokenShapeOf(spec_.model()).context;
    for (int i = 0; i < n; ++i) {
      data_->train_tokens.Window(indices[i], context,
                                 batch->tokens + static_cast<size_t>(i) * batch->token_stride);
    }
    return batch;
  }
  data_->train.Gather(indices, n, data_->dim, batch->features);
  for (int i = 0; i < n; ++i) batch->labels[i] = data_->train.y[indices[i]];
  return batch;
}

absl::Status Trainer::FixedPointOutOfRange(int64_t rejected, int64_t step) {
  return absl::OutOfRangeError(absl::StrFormat(
      "deterministic mode: %d gradient values at step %d are not finite or outside the "
      "fixed-point range |g| < %g; lower the learning rate or turn deterministic off",
      rejected, step, std::ldexp(1.0, 51 - kFixedPointFracBits)));
}

int64_t Trainer::ReducedBytesPerStep() const {
  if (comm_->size() <= 1) return 0;
  const bool det = spec_.deterministic();
  const int64_t values = static_cast<int64_t>(model_->num_grads()) + (det ? 2 : 1);
  return values * static_cast<int64_t>(det ? sizeof(int64_t) : sizeof(float));
}

void Trainer::set_memory_budget(int64_t bytes) {
  memory_budget_ = bytes;
  micro_batch_ = ChooseMicroBatch(spec_, comm_->size(), memory_budget_);
}

Trainer::~Trainer() = default;

void Trainer::set_engine(std::unique_ptr<StepEngine> engine) {
  engine_ = engine != nullptr ? std::move(engine)
                              : std::make_unique<CpuStep>(spec_, model_.get(), optimizer_.get(),
                                                          layout_);
}

absl::Status Trainer::TrainStep(int64_t step) {
  sampler_.Indices(step - 1, shards_, &indices_);
  const int n = static_cast<int>(indices_.size());
  if (absl::StatusOr<HostBatch> batch = LoadBatch(indices_.data(), n); !batch.ok()) {
    return batch.status();
  }
  StepArgs args;
  args.n = n;
  args.micro_batch = static_cast<int>(std::clamp<int64_t>(micro_batch_, 1, std::max(n, 1)));
  args.deterministic = spec_.deterministic();
  args.micro_shard = static_cast<int>(sampler_.micro_shard_size());
  args.frac_bits = kFixedPointFracBits;
  args.grad_scale = 1.0f / static_cast<float>(spec_.global_batch_size());
  args.lr = static_cast<float>(optimizer_->LearningRate(step));
  args.step = step;
  absl::StatusOr<StepResult> result = engine_->TakeStep(args);
  if (!result.ok()) return result.status();
  if (result->rejected != 0) return FixedPointOutOfRange(result->rejected, step);
  last_loss_ = result->loss;
  completed_step_ = step;
  timing_.compute += result->compute;
  timing_.exposed_comm += result->exposed_comm;
  timing_.update += result->update;
  ++timing_.steps;
  if (step_observer_) step_observer_(*result);
  return absl::OkStatus();
}

absl::Status Trainer::SyncHost() {
  LOCKSTEP_RETURN_IF_ERROR(engine_->Sync());
  host_step_ = completed_step_;
  return absl::OkStatus();
}

void Trainer::set_communicator(Communicator* comm) {
  comm_ = comm;
  device_group_ = nullptr;
  shards_ = RankShards(spec_.micro_shards(), comm->rank(), comm->size());
  micro_batch_ = ChooseMicroBatch(spec_, comm->size(), memory_budget_);
}

uint64_t Trainer::ModelFingerprint() const {
  const std::string id = absl::StrCat(model_->Describe(), "/", spec_.optimizer().type());
  return Fnv1a64(id.data(), id.size());
}

absl::Status Trainer::MaybeCheckpoint(int64_t step, const CheckpointFn& report) {
  const int64_t every = spec_.checkpoint_every_steps();
  if (every <= 0 || comm_->rank() != 0 || step % every != 0) return absl::OkStatus();
  absl::StatusOr<std::string> path;
  if (absl::Status synced = SyncHost(); !synced.ok()) {
    path = synced;
  } else {
    CheckpointData data;
    data.step = step;
    data.job_id = job_id_;
    data.training_fingerprint = training_fingerprint_;
    data.model_fingerprint = ModelFingerprint();
    data.manifest = Manifest(*model_).SerializeAsString();
    data.params.assign(model_->params(), model_->params() + model_->num_params());
    data.optimizer_state = optimizer_->state();
    const int keep = spec_.keep_checkpoints() > 0 ? spec_.keep_checkpoints() : 3;
    path = WriteCheckpoint(spec_.checkpoint_dir(), data, keep);
  }
  v1::CheckpointReport r;
  r.set_step(step);
  if (path.ok()) {
    r.set_path(*path);
  } else {
    r.set_error(std::string(path.status().message()));
    LOG(WARNING) << "checkpoint at step " << step << " not written: " << path.status();
  }
  if (report) report(r);
  if (!path.ok() && spec_.checkpoint_failure_policy() == "fail") {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint at step ", step, " not written: ", path.status().message(),
                     " (checkpoint_failure_policy \"fail\")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Trainer::LoadStateFromDisk() {
  if (comm_->rank() != 0) return false;
  std::vector<float>& opt = optimizer_->state();
  if (spec_.checkpoint_every_steps() > 0 && !spec_.checkpoint_dir().empty()) {
    absl::StatusOr<CheckpointData> ckpt =
        LoadLatestCheckpoint(spec_.checkpoint_dir(), job_id_, training_fingerprint_,
                             model_->num_params(), opt.size(), completed_step_, total_steps_);
    if (ckpt.ok()) {
      std::copy(ckpt->params.begin(), ckpt->params.end(), model_->params());
      opt = std::move(ckpt->optimizer_state);
      HostStateWritten(false);
      LOG(INFO) << "loaded " << job_id_ << "'s checkpoint of step " << ckpt->step << " from "
                << spec_.checkpoint_dir() << " (held step " << completed_step_ << ")";
      completed_step_ = ckpt->step;
      return true;
    }
  }
  const v1::InitFromCheckpoint& init = spec_.init_from_checkpoint();
  if (completed_step_ == 0 && !initialized_from_checkpoint_ && !init.path().empty()) {
    absl::StatusOr<CheckpointData> ckpt =
        LoadCheckpointForInit(init.path(), ModelFingerprint(), model_->num_params(),
                              init.load_optimizer_state() ? opt.size() : kAnyOptimizerState);
    // The job cannot start as asked: that is final.
    if (!ckpt.ok()) return absl::FailedPreconditionError(ckpt.status().message());
    std::copy(ckpt->params.begin(), ckpt->params.end(), model_->params());
    if (init.load_optimizer_state()) opt = std::move(ckpt->optimizer_state);
    HostStateWritten(false);
    initialized_from_checkpoint_ = true;
    LOG(INFO) << job_id_ << " starts from the parameters of " << ckpt->job_id << " at step "
              << ckpt->step << (init.load_optimizer_state() ? " and its optimizer state" : "");
  }
  return false;
}

namespace {

// What the heal source sends first: which state follows and how to check it.
struct StateHeader {
  int64_t step;
  int64_t from_checkpoint_init;  // the state descends from init_from_checkpoint
  uint64_t num_params;
  uint64_t optimizer_floats;
  uint64_t checksum;  // StateChecksum of step, parameters, optimizer state
};

// Pieces of a heal broadcast: large enough to keep Gloo busy, small enough that a big model's
// state never needs a second full copy in flight.
constexpr size_t kHealPieceFloats = size_t{1} << 20;

uint64_t StateChecksum(int64_t step, const float* params, size_t n, const float* opt, size_t m) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  XXH3_64bits_update(state, &step, sizeof(step));
  XXH3_64bits_update(state, params, n * sizeof(float));
  XXH3_64bits_update(state, opt, m * sizeof(float));
  const uint64_t sum = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return sum;
}

}  // namespace

absl::Status Trainer::ReceiveState(int source, bool take) {
  const bool sending = comm_->rank() == source;
  std::vector<float>& opt = optimizer_->state();
  const size_t n = model_->num_params(), m = opt.size();
  StateHeader header{};
  if (sending) {
    header = {completed_step_, initialized_from_checkpoint_ ? 1 : 0, n, m,
              StateChecksum(completed_step_, model_->params(), n, opt.data(), m)};
  }
  LOCKSTEP_RETURN_IF_ERROR(comm_->Broadcast(&header, sizeof(header), source));
  if (header.num_params != n || header.optimizer_floats != m) {
    return absl::InternalError(absl::StrCat("rank ", source, " sent ", header.num_params,
                                            " parameters and ", header.optimizer_floats,
                                            " optimizer values, not ", n, " and ", m));
  }
  // Receivers stage everything and touch their own state only after the checksum holds.
  std::vector<float> staged_params, staged_opt;
  if (!sending) {
    staged_params.resize(n);
    staged_opt.resize(m);
  }
  int pieces = 0;
  bool through_engine = true;  // every piece went through the engine's transport
  using Part = StepEngine::StatePart;
  for (auto [part, mine, staged, count] :
       {std::tuple<Part, float*, float*, size_t>{Part::kParams, model_->params(),
                                                 staged_params.data(), n},
        {Part::kOptimizer, opt.data(), staged_opt.data(), m}}) {
    for (size_t offset = 0; offset < count; offset += kHealPieceFloats) {
      const size_t len = std::min(kHealPieceFloats, count - offset);
      float* buffer = sending ? mine + offset : staged + offset;
      // Between devices when the engine has a transport of its own (GPUs: NCCL, from and into
      // device memory), else over the communicator.
      absl::Status sent =
          engine_->BroadcastState(group(), part, offset, len, buffer, source, take);
      if (absl::IsUnimplemented(sent)) {
        through_engine = false;
        sent = comm_->Broadcast(buffer, len * sizeof(float), source);
      }
      LOCKSTEP_RETURN_IF_ERROR(sent);
      // Tests hold the source here, with part of its state sent, and kill it.
      if (sending && ++pieces == 1) test_hooks::Reach("heal_broadcast");
    }
  }
  if (sending || !take) return absl::OkStatus();
  if (StateChecksum(header.step, staged_params.data(), n, staged_opt.data(), m) !=
      header.checksum) {
    return absl::DataLossError(absl::StrCat("the state of step ", header.step, " from rank ",
                                            source, " failed its checksum; not taken"));
  }
  std::copy(staged_params.begin(), staged_params.end(), model_->params());
  opt = std::move(staged_opt);
  HostStateWritten(through_engine);
  completed_step_ = header.step;
  initialized_from_checkpoint_ = header.from_checkpoint_init != 0;
  return absl::OkStatus();
}

absl::StatusOr<Trainer::HealInfo> Trainer::Heal(const std::vector<std::string>& member_names) {
  const absl::Time start = absl::Now();
  absl::StatusOr<bool> from_disk = LoadStateFromDisk();
  if (!from_disk.ok()) return from_disk.status();
  // The exchange, in one sum; each rank fills its own slots: the rank of its state (its step,
  // and at step 0 whether it holds init_from_checkpoint's parameters rather than the seed's), a
  // hash of the state itself (two members at one step may still differ: a step trained again
  // after a rollback, in another world size, has other bits), whether it was read from the
  // job's checkpoint (rank 0 only), and a hash of each part of the data.
  constexpr int kParts = 4;
  const int world = comm_->size(), me = comm_->rank();
  const std::vector<float>& opt = optimizer_->state();
  const size_t data_slots = static_cast<size_t>(world) * kParts;
  std::vector<int64_t> x(3 * static_cast<size_t>(world) + data_slots, 0);
  int64_t* const key = x.data();
  int64_t* const hash = key + world;
  int64_t* const disk = hash + world;
  int64_t* const data = disk + world;
  key[me] = completed_step_ * 2 + (initialized_from_checkpoint_ ? 1 : 0);
  hash[me] = static_cast<int64_t>(
      StateChecksum(completed_step_, model_->params(), model_->num_params(), opt.data(), opt.size()));
  disk[me] = *from_disk ? 1 : 0;
  for (size_t i = 0; i < data_->parts.size() && i < kParts; ++i) {
    data[me * kParts + i] = static_cast<int64_t>(data_->parts[i].hash);
  }
  if (absl::Status s = comm_->AllreduceSum(x.data(), x.size()); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("healing: ", s.message()));
  }
  auto name = [&](int r) {
    return r < static_cast<int>(member_names.size())
               ? absl::StrCat(member_names[r], " (rank ", r, ")")
               : absl::StrCat("rank ", r);
  };
  for (int r = 1; r < world; ++r) {
    for (size_t i = 0; i < data_->parts.size() && i < kParts; ++i) {
      const int64_t theirs = data[r * kParts + i], first = data[i];
      if (theirs == first) continue;
      return absl::FailedPreconditionError(absl::StrFormat(
          "the members hold different data: %s of %s is %016x on %s but %016x on %s; every "
          "member must read the same files",
          data_->parts[i].name, data_->source, static_cast<uint64_t>(theirs), name(r),
          static_cast<uint64_t>(first), name(0)));
    }
  }
  int source = 0;
  for (int r = 1; r < world; ++r) {
    if (key[r] > key[source]) source = r;
  }
  HealInfo info;
  if (key[source] > 0) {
    info.source_rank = source;
    // Whoever is behind the source, or at its step with other bits, takes its state.
    bool anyone_takes = false;
    for (int r = 0; r < world; ++r) {
      anyone_takes = anyone_takes || key[r] != key[source] || hash[r] != hash[source];
    }
    if (anyone_takes) {
      const bool take = key[me] != key[source] || hash[me] != hash[source];
      if (absl::Status s = ReceiveState(source, take); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("healing from rank ", source, ": ", s.message()));
      }
    }
    // The state came from disk when the source read it there and nobody else held it.
    bool in_memory_elsewhere = false;
    for (int r = 0; r < world; ++r) {
      in_memory_elsewhere = in_memory_elsewhere || (r != source && key[r] == key[source] &&
                                                    hash[r] == hash[source] && disk[r] == 0);
    }
    info.from_checkpoint = disk[source] != 0 && !in_memory_elsewhere;
  }
  info.resumed_from_step = completed_step_;
  info.took = absl::Now() - start;
  return info;
}

absl::Status Trainer::Train(int64_t start_step, const std::atomic<bool>& abort,
                            const ProgressFn& progress, const CheckpointFn& checkpoint,
                            absl::Duration report_interval) {
  // A generation with no step left (it only finishes the job) keeps the figures of the one
  // that trained: they are what the job reports as its throughput.
  if (start_step <= total_steps_) timing_ = Timing{};
  // The engine sums over this generation's communicator: it must have let go of it (its
  // threads joined) before Train returns, whatever the outcome. A device's state comes back to
  // the host on the way out too, so that healing, evaluation and checksums see the last
  // completed step (a failed step updates nothing: the update follows the sum).
  if (absl::Status s = engine_->Begin(group()); !s.ok()) {
    (void)engine_->End();
    return s;
  }
  host_step_ = completed_step_;
  absl::Status trained = TrainSteps(start_step, abort, progress, checkpoint, report_interval);
  if (absl::Status ended = engine_->End(); !ended.ok()) {
    // The host keeps the state it last had: claim only that step, so that healing sends this
    // member the newer state instead of trusting parameters that do not match. The
    // generation fails with it (a worker that finished would report a step it does not hold).
    LOG(WARNING) << "reading the device's state back: " << ended << "; back to step "
                 << host_step_;
    completed_step_ = host_step_;
    if (trained.ok()) {
      trained = absl::Status(ended.code(),
                             absl::StrCat("reading the device's state back: ", ended.message()));
    }
  }
  return trained;
}

absl::Status Trainer::TrainSteps(int64_t start_step, const std::atomic<bool>& abort,
                                 const ProgressFn& progress, const CheckpointFn& checkpoint,
                                 absl::Duration report_interval) {
  absl::Time window_start = absl::Now();
  int64_t window_steps = 0;
  double samples_per_second = 0;
  absl::Time last_report = absl::InfinitePast();
  absl::Time first_step_end = absl::InfinitePast();
  for (int64_t step = start_step; step <= total_steps_; ++step) {
    if (abort.load(std::memory_order_relaxed)) {
      return absl::AbortedError(absl::StrCat("aborted before step ", step));
    }
    test_hooks::Reach("before_step", step, &abort);
    if (absl::Status s = TrainStep(step); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("step ", step, ": ", s.message()));
    }
    LOCKSTEP_RETURN_IF_ERROR(MaybeCheckpoint(step, checkpoint));
    // Held-out loss every eval_every_steps (the last step's is the final evaluation's).
    std::optional<v1::EvalResult> eval;
    const int64_t eval_every = spec_.eval_every_steps();
    if (eval_every > 0 && step % eval_every == 0 && step < total_steps_) {
      const absl::Time eval_start = absl::Now();
      LOCKSTEP_RETURN_IF_ERROR(SyncHost());
      absl::StatusOr<v1::EvalResult> result = Evaluate();
      // Throughput is training's: the evaluation's time is left out of it.
      const absl::Duration took = absl::Now() - eval_start;
      timing_.evaluation += took;
      window_start += took;
      if (step > start_step) first_step_end += took;
      if (!result.ok()) {
        return absl::Status(result.status().code(),
                            absl::StrCat("after step ", step, ": ", result.status().message()));
      }
      eval = *std::move(result);
    }
    ++window_steps;
    const absl::Time now = absl::Now();
    if (step == start_step) first_step_end = now;
    timing_.after_first = now - first_step_end;
    const bool first = step == start_step, last = step == total_steps_;
    if (first || last || eval.has_value() || now - last_report >= report_interval) {
      // The first step includes warm-up costs; throughput is measured from its end on.
      if (!first && now > window_start) {
        samples_per_second = static_cast<double>(window_steps * spec_.global_batch_size()) /
                             absl::ToDoubleSeconds(now - window_start);
      }
      window_start = now;
      window_steps = 0;
      last_report = now;
      v1::ProgressReport report;
      report.set_step(step);
      report.set_loss(last_loss_);
      report.set_samples_per_second(samples_per_second);
      report.set_peak_memory_bytes(ReadProcessMemory().peak_bytes);
      report.set_total_steps(total_steps_);
      if (data_->language) {
        report.set_tokens_per_second(samples_per_second * TokenShapeOf(spec_.model()).context);
      }
      if (eval.has_value()) *report.mutable_eval() = *eval;
      progress(report);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::EvalResult> Trainer::Evaluate() {
  // Classifiers: the test split's samples; language models: the validation windows. They go in
  // fixed chunks of the whole set (a classifier's 1024 samples, or as many windows as a
  // training micro-batch: a language model's forward keeps every layer's activations, and the
  // memory preflight sized them for the micro-batch), each rank a contiguous run of chunks.
  // A chunk's loss is the same bits on whichever rank evaluates it, and the chunks' losses are
  // summed in fixed point (exact, so in no particular order): in deterministic mode, where the
  // micro-batch is the spec's micro-shard, the evaluation is bit for bit the same for every
  // world size.
  const bool language = data_->language;
  const int context = TokenShapeOf(spec_.model()).context;
  const int64_t total = language ? data_->valid_tokens.Windows(context) : data_->test.samples;
  const int64_t chunk = language ? std::max<int64_t>(1, micro_batch_) : 1024;
  const int64_t chunks = (total + chunk - 1) / chunk;
  const int64_t first = chunks * comm_->rank() / comm_->size();
  const int64_t last = chunks * (comm_->rank() + 1) / comm_->size();
  // Loss in fixed point (2^-kEvalFracBits), correct predictions, items, rejected losses.
  int64_t sums[4] = {0, 0, 0, 0};
  std::vector<float> x(language ? 0 : static_cast<size_t>(chunk) * data_->dim);
  std::vector<int32_t> tokens(language ? static_cast<size_t>(chunk) * (context + 1) : 0);
  for (int64_t c = first; c < last; ++c) {
    const int64_t i = c * chunk;
    const int n = static_cast<int>(std::min(chunk, total - i));
    int64_t correct = 0;
    Batch batch;
    if (language) {
      for (int k = 0; k < n; ++k) {
        data_->valid_tokens.Window(i + k, context, tokens.data() + static_cast<size_t>(k) * (context + 1));
      }
      batch = Batch{n, nullptr, 0, nullptr, tokens.data(), context + 1};
    } else {
      data_->test.Range(i, n, data_->dim, x.data());
      batch = Batch{n, x.data(), data_->dim, &data_->test.y[i], nullptr, 0};
    }
    absl::StatusOr<double> loss = engine_->Evaluate(batch, &correct);
    if (!loss.ok()) return loss.status();
    sums[3] += kernels::AccumulateLossFixedPoint(*loss, 1.0f, kEvalFracBits, &sums[0]);
    sums[1] += correct;
    sums[2] += n;
  }
  if (absl::Status s = comm_->AllreduceSum(sums, 4); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("evaluation: ", s.message()));
  }
  v1::EvalResult result;
  result.set_test_samples(sums[2]);
  if (sums[2] > 0) {
    const double count = static_cast<double>(sums[2]);
    // A loss that is not finite (or beyond the fixed-point range) makes the whole one so.
    result.set_test_loss(sums[3] > 0 ? std::numeric_limits<double>::quiet_NaN()
                                     : std::ldexp(static_cast<double>(sums[0]), -kEvalFracBits) /
                                           count);
    // A language model's accuracy is over predicted tokens, `context` per window.
    result.set_test_accuracy(static_cast<double>(sums[1]) / (count * (language ? context : 1)));
    if (language && data_->text) result.set_bits_per_byte(result.test_loss() / std::log(2.0));
  }
  return result;
}

size_t Trainer::largest_collective_bytes() const {
  return CpuStep::LargestCollectiveBytes(spec_, *model_);
}

double Trainer::TrainSamplesPerSecond() const {
  const double seconds = absl::ToDoubleSeconds(timing_.after_first);
  if (timing_.steps < 2 || seconds <= 0) return 0;
  return static_cast<double>((timing_.steps - 1) * spec_.global_batch_size()) / seconds;
}

double Trainer::TrainTokensPerSecond() const {
  return data_->language ? TrainSamplesPerSecond() * TokenShapeOf(spec_.model()).context : 0;
}

absl::StatusOr<v1::Sample> Trainer::GenerateSample() {
  LOCKSTEP_RETURN_IF_ERROR(SyncHost());
  return worker::GenerateSample(*model_, spec_.sample(), data_->text);
}

absl::StatusOr<std::string> Trainer::Export() {
  LOCKSTEP_RETURN_IF_ERROR(SyncHost());
  return WriteModelExport(spec_.output_dir(), Manifest(*model_), model_->params(),
                          model_->num_params(),
                          {{"format", "pt"},
                           {"lockstep_job", job_id_},
                           {"lockstep_step", absl::StrCat(completed_step_)},
                           {"lockstep_architecture", model_->Describe()}});
}

std::string Trainer::ParameterChecksum() const {
  return absl::StrFormat("%016x",
                         Fnv1a64(model_->params(), model_->num_params() * sizeof(float)));
}

}  // namespace lockstep::worker
