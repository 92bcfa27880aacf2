// The models a job can name. A new model is one more branch here.
#include "worker/train/model.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/model_layout.h"
#include "kernels/cpu_kernels.h"
#include "worker/train/gpt.h"
#include "worker/train/mlp.h"

namespace lockstep::worker {
namespace {

absl::StatusOr<std::unique_ptr<Model>> CreateUnfrozenModel(const v1::ModelSpec& spec,
                                                           const DataShape& shape) {
  if (spec.type() == "mlp") {
    kernels::Activation activation;
    if (!kernels::ParseActivation(spec.activation(), &activation)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.activation: unknown \"", spec.activation(), "\""));
    }
    std::vector<int> dims = {shape.features};
    for (int w : spec.hidden_widths()) dims.push_back(w);
    dims.push_back(shape.classes);
    return std::unique_ptr<Model>(new Mlp(std::move(dims), activation));
  }
  if (spec.type() == "gpt") {
    const std::pair<const char*, int> sizes[] = {{"vocab_size", spec.vocab_size()},
                                                 {"context_length", spec.context_length()},
                                                 {"n_layer", spec.n_layer()},
                                                 {"n_head", spec.n_head()},
                                                 {"d_model", spec.d_model()}};
    for (const auto& [field, value] : sizes) {
      if (value <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("model.", field, ": must be > 0, got ", value));
      }
    }
    if (spec.d_model() % spec.n_head() != 0) {
      return absl::InvalidArgumentError(absl::StrCat("model.d_model: ", spec.d_model(),
                                                     " is not divisible by n_head ",
                                                     spec.n_head()));
    }
    return std::unique_ptr<Model>(new Gpt({spec.vocab_size(), spec.context_length(),
                                           spec.n_layer(), spec.n_head(), spec.d_model()}));
  }
  return absl::InvalidArgumentError(absl::StrCat("model.type: unknown model \"", spec.type(), "\""));
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
  if (absl::Status s = (*model)->Freeze(patterns); !s.ok()) return s;
  return model;
}

}  // namespace lockstep::worker
