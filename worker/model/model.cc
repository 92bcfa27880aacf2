// The models a job can name: each family's host model (worker/model/NAME.cc), by its name.
#include "worker/model/model.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/model_family.h"
#include "common/model_layout.h"
#include "common/status_macros.h"
#include "kernels/cpu_kernels.h"
#include "worker/model/gpt.h"
#include "worker/model/mlp.h"

namespace lockstep::worker {
namespace {

// The host model of each family (common/model_family.h); a new family adds its line.
struct HostFamily {
  const char* name;
  HostModelFactory create;
};
constexpr HostFamily kHostFamilies[] = {{"mlp", CreateMlp}, {"gpt", CreateGpt}};

absl::StatusOr<std::unique_ptr<Model>> CreateUnfrozenModel(const v1::ModelSpec& spec,
                                                           const DataShape& shape) {
  // The canonical form and the family's defaults, as the coordinator makes every spec it
  // accepts.
  v1::ModelSpec model = spec;
  NormalizeModelSpec(model);
  const ModelFamily* family = FindModelFamily(model.type());
  if (family == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.type: unknown model \"", model.type(), "\""));
  }
  LOCKSTEP_RETURN_IF_ERROR(ValidateModelForm(model));
  if (family->apply_defaults != nullptr) family->apply_defaults(model);
  LOCKSTEP_RETURN_IF_ERROR(family->validate(model));
  for (const HostFamily& host : kHostFamilies) {
    if (model.type() == host.name) return host.create(model, shape);
  }
  return absl::UnimplementedError(
      absl::StrCat("model.type: this worker has no host model for \"", spec.type(), "\""));
}

}  // namespace

void Model::LayOutGradients() {
  const std::vector<Tensor>& t = tensors();
  frozen_.resize(t.size(), false);
  grad_offsets_.assign(t.size(), 0);
  segments_.clear();
  size_t g = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    grad_offsets_[i] = g;
    if (frozen_[i]) continue;
    if (!segments_.empty() && segments_.back().decay == t[i].decay &&
        segments_.back().embedding == t[i].embedding &&
        segments_.back().param_offset + segments_.back().count == t[i].offset) {
      segments_.back().count += t[i].count;
    } else {
      segments_.push_back({t[i].offset, g, t[i].count, t[i].decay, t[i].embedding});
    }
    g += t[i].count;
  }
  num_grads_ = g;
  grads_.assign(num_grads_ + 1, 0.0f);
}

std::vector<Tensor> LayOutTensors(const std::vector<TensorSize>& layout, size_t* num_params) {
  std::vector<Tensor> tensors;
  size_t offset = 0;
  for (const TensorSize& t : layout) {
    const size_t count = static_cast<size_t>(t.count);
    tensors.push_back({t.name, t.shape, offset, count, t.decay, t.embedding});
    offset += count;
  }
  *num_params = offset;
  return tensors;
}

absl::Status Model::Freeze(const std::vector<std::string>& patterns) {
  std::vector<TensorSize> sizes;
  for (const Tensor& t : tensors()) sizes.push_back({t.name, static_cast<int64_t>(t.count)});
  absl::StatusOr<std::vector<bool>> frozen = MatchFrozen(sizes, patterns);
  if (!frozen.ok()) return frozen.status();
  frozen_ = *std::move(frozen);
  LayOutGradients();
  return absl::OkStatus();
}

size_t Model::GradOffset(size_t param_offset) const {
  const std::vector<Tensor>& t = tensors();
  // The tensor holding param_offset (an end offset belongs to the tensor it ends).
  auto it = std::lower_bound(t.begin(), t.end(), param_offset,
                             [](const Tensor& x, size_t p) { return x.offset + x.count < p; });
  if (it == t.end()) return num_grads_;
  const size_t i = static_cast<size_t>(it - t.begin());
  if (frozen_[i]) return grad_offsets_[i];
  return grad_offsets_[i] + std::min(param_offset - std::min(param_offset, it->offset), it->count);
}

float* Model::GradFor(size_t param_offset) {
  const std::vector<Tensor>& t = tensors();
  auto it = std::lower_bound(t.begin(), t.end(), param_offset,
                             [](const Tensor& x, size_t p) { return x.offset < p; });
  const size_t i = static_cast<size_t>(it - t.begin());
  if (frozen_[i]) return nullptr;
  return grads_.data() + grad_offsets_[i];
}

std::vector<size_t> Model::ReadyPoints(size_t chunk_floats) const {
  std::vector<size_t> points;
  for (size_t p : ParamReadyPoints(chunk_floats)) {
    const size_t g = GradOffset(p);
    if (g > (points.empty() ? 0 : points.back())) points.push_back(g);
  }
  return points;
}

void Model::ReadyReporter::operator()(size_t param_end) {
  const size_t g = model_.GradOffset(param_end);
  if (g <= last_) return;
  last_ = g;
  if (on_ready_) on_ready_(g);
}

v1::ModelManifest Manifest(const Model& model) {
  v1::ModelManifest m;
  m.set_architecture(model.Describe());
  for (const Tensor& t : model.tensors()) {
    v1::TensorInfo* info = m.add_tensors();
    info->set_name(t.name);
    for (int64_t d : t.shape) info->add_shape(d);
    info->set_offset(t.offset);
  }
  m.set_config_json(model.ConfigJson());
  return m;
}

absl::StatusOr<std::vector<float>> Model::NextTokenLogits(const std::vector<int32_t>&) {
  return absl::UnimplementedError(absl::StrCat(Describe(), " does not generate text"));
}

absl::StatusOr<std::unique_ptr<Model>> CreateModel(const v1::ModelSpec& spec,
                                                   const DataShape& shape) {
  absl::StatusOr<std::unique_ptr<Model>> model = CreateUnfrozenModel(spec, shape);
  if (!model.ok() || spec.frozen_parameters().empty()) return model;
  const std::vector<std::string> patterns(spec.frozen_parameters().begin(),
                                          spec.frozen_parameters().end());
  LOCKSTEP_RETURN_IF_ERROR((*model)->Freeze(patterns));
  return model;
}

}  // namespace lockstep::worker
