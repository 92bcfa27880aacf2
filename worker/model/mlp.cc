// MLP forward/backward through the CPU kernels.
#include "worker/model/mlp.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/random.h"

namespace lockstep::worker {

namespace {

// The family's layout (common/models/mlp.cc) of the MLP of `dims`, input first.
std::vector<Tensor> LayerTensors(const std::vector<int>& dims, size_t* num_params) {
  *num_params = 0;
  if (dims.size() < 2) return {};
  v1::ModelSpec spec;
  spec.set_type("mlp");
  for (size_t i = 1; i + 1 < dims.size(); ++i) spec.mutable_mlp()->add_hidden_widths(dims[i]);
  return LayOutTensors(ModelTensors(spec, dims.front(), dims.back()), num_params);
}

}  // namespace

std::vector<Mlp::LayerSlice> Mlp::Layout(const std::vector<int>& dims, size_t* num_params) {
  const std::vector<Tensor> tensors = LayerTensors(dims, num_params);
  const int n_layers = static_cast<int>(dims.size()) - 1;
  std::vector<LayerSlice> layers(std::max(0, n_layers));
  for (int l = n_layers - 1; l >= 0; --l) {
    LayerSlice& s = layers[l];
    s.in = dims[l];
    s.out = dims[l + 1];
    // fcL.weight then fcL.bias, the last layer's first.
    s.offset = tensors[2 * static_cast<size_t>(n_layers - 1 - l)].offset;
    s.count = static_cast<size_t>(s.in) * s.out + s.out;
  }
  return layers;
}

int Mlp::RowsPerChunk(const LayerSlice& layer, size_t chunk_floats) {
  const size_t in = static_cast<size_t>(layer.in);
  return static_cast<int>(std::clamp<size_t>(chunk_floats / in, 1, layer.out));
}

Mlp::Mlp(std::vector<int> dims, kernels::Activation activation)
    : dims_(std::move(dims)), activation_(activation) {
  const int n_layers = static_cast<int>(dims_.size()) - 1;
  tensors_ = LayerTensors(dims_, &num_params_);
  layers_ = Layout(dims_, &num_params_);
  params_.assign(num_params_, 0.0f);
  LayOutGradients();
  z_.resize(n_layers);
  a_.resize(n_layers);
}

std::string Mlp::Describe() const {
  const char* act = activation_ == kernels::Activation::kRelu   ? "relu"
                    : activation_ == kernels::Activation::kGelu ? "gelu"
                                                                : "identity";
  std::string id = absl::StrCat("mlp/", act);
  for (int d : dims_) absl::StrAppend(&id, "/", d);
  return id;
}

std::string Mlp::ConfigJson() const {
  const std::string id = Describe();
  std::string dims;
  for (size_t i = 0; i < dims_.size(); ++i) absl::StrAppend(&dims, i == 0 ? "" : ", ", dims_[i]);
  // The activation is the second part of Describe ("mlp/relu/...").
  const std::string act = id.substr(4, id.find('/', 4) - 4);
  return absl::StrCat("{\n  \"model_type\": \"lockstep_mlp\",\n  \"dims\": [", dims,
                      "],\n  \"activation\": \"", act,
                      "\",\n  \"layers\": \"fc1..fc", dims_.size() - 1,
                      ": torch.nn.Linear, weight [out, in]\"\n}");
}

void Mlp::Initialize(uint64_t seed) {
  for (int l = 0; l < num_layers(); ++l) {
    const LayerSlice& s = layers_[l];
    SplitMix64 rng(MixSeed(seed, static_cast<uint64_t>(l) + 1));
    const double bound = 1.0 / std::sqrt(static_cast<double>(s.in));
    for (size_t i = 0; i < s.count; ++i) {
      params_[s.offset + i] = static_cast<float>((2.0 * rng.Uniform() - 1.0) * bound);
    }
  }
}

void Mlp::Reserve(int n) {
  if (n <= capacity_) return;
  capacity_ = n;
  int max_width = 0;
  for (int l = 0; l < num_layers(); ++l) {
    z_[l].resize(static_cast<size_t>(n) * layers_[l].out);
    if (l + 1 < num_layers()) a_[l].resize(static_cast<size_t>(n) * layers_[l].out);
    max_width = std::max({max_width, layers_[l].in, layers_[l].out});
  }
  dz_.resize(static_cast<size_t>(n) * max_width);
  da_.resize(static_cast<size_t>(n) * max_width);
}

void Mlp::Forward(const float* x, int n) {
  Reserve(n);
  const float* in = x;
  for (int l = 0; l < num_layers(); ++l) {
    const LayerSlice& s = layers_[l];
    const float* w = params_.data() + s.offset;
    const float* b = w + static_cast<size_t>(s.in) * s.out;
    float* z = z_[l].data();
    // z = in * W^T: W is (out x in) row-major, as in PyTorch.
    kernels::Gemm(false, true, n, s.out, s.in, 1.0f, in, s.in, w, s.in, 0.0f, z, s.out);
    const bool last = l + 1 == num_layers();
    if (last) {
      kernels::BiasActivationForward(b, n, s.out, kernels::Activation::kIdentity, z, z);
    } else {
      kernels::BiasActivationForward(b, n, s.out, activation_, z, a_[l].data());
      in = a_[l].data();
    }
  }
}

std::vector<size_t> Mlp::LayoutReadyPoints(const std::vector<LayerSlice>& layers,
                                           size_t chunk_floats) {
  std::vector<size_t> points;
  for (int l = static_cast<int>(layers.size()) - 1; l >= 0; --l) {
    const LayerSlice& s = layers[l];
    const int rows = RowsPerChunk(s, chunk_floats);
    for (int r = 0; r < s.out; r += rows) {
      points.push_back(s.offset + static_cast<size_t>(std::min(r + rows, s.out)) * s.in);
    }
    points.push_back(s.offset + s.count);
  }
  return points;
}

double Mlp::ForwardBackward(const float* x, const int32_t* y, int n, float grad_scale,
                            size_t chunk_floats, const std::function<void(double)>& on_loss,
                            const std::function<void(size_t)>& on_ready, bool accumulate) {
  Forward(x, n);
  const int last = num_layers() - 1;
  float* dz = dz_.data();
  const double loss = kernels::SoftmaxCrossEntropy(z_[last].data(), y, n, layers_[last].out,
                                                   grad_scale, dz, nullptr);
  if (on_loss) on_loss(loss);
  ReadyReporter ready(*this, on_ready);
  for (int l = last; l >= 0; --l) {
    const LayerSlice& s = layers_[l];
    const float* in = l == 0 ? x : a_[l - 1].data();
    float* dw = GradFor(s.offset);  // null when frozen
    float* db = GradFor(s.offset + static_cast<size_t>(s.in) * s.out);
    // dW = dz^T * in (out x in), in row blocks so that communication of the first rows starts
    // while later rows are computed; then db = column sums of dz.
    const int rows = RowsPerChunk(l, chunk_floats);
    for (int r = 0; r < s.out && dw != nullptr; r += rows) {
      const int m = std::min(rows, s.out - r);
      kernels::Gemm(true, false, m, s.in, n, 1.0f, dz + r, s.out, in, s.in, accumulate ? 1.0f : 0.0f,
                    dw + static_cast<size_t>(r) * s.in, s.in);
      ready(s.offset + static_cast<size_t>(r + m) * s.in);
    }
    if (db != nullptr) kernels::BiasGradient(dz, n, s.out, db, accumulate);
    ready(s.offset + s.count);
    if (l == 0) break;
    // da = dz * W (n x in), then through the activation of layer l-1.
    const float* w = params_.data() + s.offset;
    kernels::Gemm(false, false, n, s.in, s.out, 1.0f, dz, s.out, w, s.in, 0.0f, da_.data(), s.in);
    kernels::ActivationBackward(activation_, z_[l - 1].data(), da_.data(), dz,
                                static_cast<size_t>(n) * s.in);
  }
  return loss;
}

double Mlp::Evaluate(const float* x, const int32_t* y, int n, int64_t* correct) {
  Forward(x, n);
  const int last = num_layers() - 1;
  return kernels::SoftmaxCrossEntropy(z_[last].data(), y, n, layers_[last].out, 0.0f, nullptr,
                                      correct);
}

absl::StatusOr<std::unique_ptr<Model>> CreateMlp(const v1::ModelSpec& model,
                                                 const DataShape& shape) {
  const v1::MlpSpec& spec = model.mlp();
  kernels::Activation activation;
  if (!kernels::ParseActivation(spec.activation(), &activation)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.mlp.activation: unknown \"", spec.activation(), "\""));
  }
  std::vector<int> dims = {shape.features};
  for (int w : spec.hidden_widths()) dims.push_back(w);
  dims.push_back(shape.classes);
  return std::unique_ptr<Model>(new Mlp(std::move(dims), activation));
}

}  // namespace lockstep::worker
