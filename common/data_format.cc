#include "common/data_format.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lockstep {
namespace {

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// IDX files (MNIST's format, optionally gzipped) in a directory.
absl::Status ValidateIdx(const v1::DatasetSpec& data) {
  if (data.path().empty()) {
    return Invalid("dataset.path", absl::StrCat("required for dataset type ", data.type()));
  }
  return absl::OkStatus();
}

void FashionMnistDefaults(v1::DatasetSpec& data) {
  if (data.path().empty()) data.set_path(kDefaultFashionMnistPath);
}

// Labelled features drawn from a seeded generator.
absl::Status ValidateSynthetic(const v1::DatasetSpec& data) {
  const v1::SyntheticDatasetSpec& s = data.synthetic();
  if (s.train_samples() <= 0) {
    return Invalid("dataset.synthetic.train_samples",
                   absl::StrCat("must be > 0, got ", s.train_samples()));
  }
  if (s.test_samples() <= 0) {
    return Invalid("dataset.synthetic.test_samples",
                   absl::StrCat("must be > 0, got ", s.test_samples()));
  }
  if (s.input_dim() <= 0) {
    return Invalid("dataset.synthetic.input_dim", absl::StrCat("must be > 0, got ", s.input_dim()));
  }
  if (s.num_classes() < 2) {
    return Invalid("dataset.synthetic.num_classes",
                   absl::StrCat("must be >= 2, got ", s.num_classes()));
  }
  if (s.train_samples() > (int64_t{1} << 26) || s.test_samples() > (int64_t{1} << 26) ||
      s.input_dim() > 65536 || s.num_classes() > 65536) {
    return Invalid("dataset.synthetic", "too large (at most 2^26 samples, 65536 features)");
  }
  if ((s.train_samples() + s.test_samples()) * s.input_dim() > (int64_t{1} << 31)) {
    return Invalid("dataset.synthetic",
                   "(train_samples + test_samples) * input_dim must be <= 2^31 values");
  }
  return absl::OkStatus();
}

// The bytes of a text file (or of the files of a directory), a fraction held out.
void TextDefaults(v1::DatasetSpec& data) {
  if (data.validation_fraction() == 0) data.set_validation_fraction(0.05);
}

absl::Status ValidateText(const v1::DatasetSpec& data) {
  if (data.path().empty()) {
    return Invalid("dataset.path", "required for dataset type text (a file or a directory)");
  }
  if (!(data.validation_fraction() > 0 && data.validation_fraction() < 1)) {
    return Invalid("dataset.validation_fraction",
                   absl::StrCat("must be in (0, 1), got ", data.validation_fraction()));
  }
  return absl::OkStatus();
}

// Files of uint16 token ids, training and validation.
absl::Status ValidateTokens(const v1::DatasetSpec& data) {
  if (data.path().empty()) return Invalid("dataset.path", "required for dataset type tokens");
  if (data.validation_path().empty()) {
    return Invalid("dataset.validation_path", "required for dataset type tokens");
  }
  return absl::OkStatus();
}

// name, language, apply_defaults, validate
const DataFormat kFashionMnist = {"fashion_mnist", false, FashionMnistDefaults, ValidateIdx};
const DataFormat kIdx = {"idx", false, nullptr, ValidateIdx};
const DataFormat kSynthetic = {"synthetic", false, nullptr, ValidateSynthetic};
const DataFormat kText = {"text", true, TextDefaults, ValidateText};
const DataFormat kTokens = {"tokens", true, nullptr, ValidateTokens};

}  // namespace

const std::vector<const DataFormat*>& DataFormats() {
  static const std::vector<const DataFormat*> formats = {&kFashionMnist, &kIdx, &kSynthetic,
                                                         &kText, &kTokens};
  return formats;
}

const DataFormat* FindDataFormat(absl::string_view name) {
  for (const DataFormat* format : DataFormats()) {
    if (name == format->name) return format;
  }
  return nullptr;
}

std::string DataFormatNames() {
  return absl::StrJoin(DataFormats(), ", ", [](std::string* out, const DataFormat* f) {
    out->append(f->name);
  });
}

}  // namespace lockstep
