// Data formats: what the coordinator knows about each kind of data set (dataset.type), in one
// place: whether it feeds a language model, its defaults and the checks of its fields. The
// worker loads each format in worker/data/dataset.cc.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep {

// Where Fashion-MNIST is read from when a spec names no path (Debian's layout).
inline constexpr char kDefaultFashionMnistPath[] = "/usr/share/datasets/fashion-mnist";

struct DataFormat {
  const char* name;  // dataset.type
  // Token data (text, tokens), for language models; otherwise labelled features.
  bool language = false;
  // Fills the format's defaults into the spec's data set (before validation).
  void (*apply_defaults)(v1::DatasetSpec& data) = nullptr;
  // The format's own fields: INVALID_ARGUMENT naming the field ("dataset.path: ...").
  absl::Status (*validate)(const v1::DatasetSpec& data) = nullptr;
};

// Every format, in the order error messages list them.
const std::vector<const DataFormat*>& DataFormats();
// The format of dataset.type `name`; null when there is none.
const DataFormat* FindDataFormat(absl::string_view name);
// "fashion_mnist, idx, synthetic, text, tokens": for error messages.
std::string DataFormatNames();

}  // namespace lockstep
