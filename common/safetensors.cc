// Safetensors files from a model manifest. The manifest may come from a checkpoint file that
// lockstepctl export was handed, so it is checked as untrusted input before a header is built.
#include "common/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/status_macros.h"
#include "common/utf8.h"

namespace lockstep {
namespace {

constexpr char kMetadataKey[] = "__metadata__";

std::string JsonQuote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out + "\"";
}

// A name for messages: untrusted text, escaped and cut short.
std::string Shown(const std::string& name) {
  constexpr size_t kLongest = 80;
  const std::string escaped = EscapeForTerminal(name.substr(0, kLongest));
  return absl::StrCat("\"", escaped, name.size() > kLongest ? "...\"" : "\"");
}

// The tensors in offset order (the order of the data section).
std::vector<const v1::TensorInfo*> ByOffset(const v1::ModelManifest& manifest) {
  std::vector<const v1::TensorInfo*> order;
  order.reserve(manifest.tensors_size());
  for (const v1::TensorInfo& t : manifest.tensors()) order.push_back(&t);
  std::stable_sort(
      order.begin(), order.end(),
      [](const v1::TensorInfo* a, const v1::TensorInfo* b) { return a->offset() < b->offset(); });
  return order;
}

}  // namespace

absl::Status CheckManifest(const v1::ModelManifest& manifest, size_t num_params) {
  if (FirstInvalidUtf8(manifest.architecture()) != std::string::npos) {
    return absl::InvalidArgumentError("the architecture is not UTF-8");
  }
  std::set<std::string> names;
  for (const v1::TensorInfo& t : manifest.tensors()) {
    // A JSON object with a repeated key is read differently by different parsers (safetensors'
    // own takes the last), and "__metadata__" is the header's; neither may name a tensor.
    if (t.name().empty()) return absl::InvalidArgumentError("a tensor has no name");
    if (FirstInvalidUtf8(t.name()) != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name ", Shown(t.name()), " is not UTF-8"));
    }
    if (t.name() == kMetadataKey) {
      return absl::InvalidArgumentError(
          absl::StrCat("a tensor is named \"", kMetadataKey, "\", the header's reserved key"));
    }
    if (!names.insert(t.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name ", Shown(t.name()), " appears twice"));
    }
  }
  // The data section is the flat buffer as it is: each tensor's byte range is its place in it,
  // so the tensors must cover it exactly once (safetensors allows no holes or overlaps).
  size_t next = 0;  // invariant: next <= num_params
  for (const v1::TensorInfo* t : ByOffset(manifest)) {
    // The element count, stopped as soon as it passes what is left of the buffer: the product
    // of untrusted dimensions never has to be formed, so it cannot wrap.
    const size_t room = num_params - next;
    size_t count = 1;
    for (int d = 0; d < t->shape_size(); ++d) {
      const int64_t dim = t->shape(d);
      if (dim <= 0) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", Shown(t->name()), ": dimension ",
                                                       d, " is ", dim, "; it must be >= 1"));
      }
      if (static_cast<uint64_t>(dim) > room / count) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", Shown(t->name()), ": its shape holds more elements than the ",
                         room, " parameters left from its place on (of ", num_params, ")"));
      }
      count *= static_cast<size_t>(dim);
    }
    if (count > room) {  // a scalar (no dimensions) where no parameter is left
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", Shown(t->name()), " lies beyond the ", num_params, " parameters"));
    }
    if (t->offset() != next) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", Shown(t->name()), " starts at ", t->offset(),
                       ", not where the one before ends (", next, ")"));
    }
    next += count;
  }
  if (next != num_params) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tensors cover ", next, " of ", num_params, " parameters"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SafetensorsHeader(const v1::ModelManifest& manifest, size_t num_params,
                                              const std::map<std::string, std::string>& metadata) {
  LOCKSTEP_RETURN_IF_ERROR(CheckManifest(manifest, num_params));
  std::string json = "{";
  if (!metadata.empty()) {
    absl::StrAppend(&json, "\"", kMetadataKey, "\":{");
    bool first = true;
    for (const auto& [key, value] : metadata) {
      // JSON is UTF-8; a header that is not is refused by every reader.
      if (FirstInvalidUtf8(key) != std::string::npos ||
          FirstInvalidUtf8(value) != std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat("metadata ", Shown(key), " is not UTF-8: ", Shown(value)));
      }
      absl::StrAppend(&json, first ? "" : ",", JsonQuote(key), ":", JsonQuote(value));
      first = false;
    }
    json += "},";
  }
  const std::vector<const v1::TensorInfo*> order = ByOffset(manifest);
  for (size_t i = 0; i < order.size(); ++i) {
    const v1::TensorInfo& t = *order[i];
    // CheckManifest bounded every count by num_params, so the products below do not wrap.
    size_t count = 1;
    std::string shape;
    for (int d = 0; d < t.shape_size(); ++d) {
      count *= static_cast<size_t>(t.shape(d));
      absl::StrAppend(&shape, d == 0 ? "" : ",", t.shape(d));
    }
    absl::StrAppend(&json, i == 0 ? "" : ",", JsonQuote(t.name()),
                    ":{\"dtype\":\"F32\",\"shape\":[", shape, "],\"data_offsets\":[",
                    t.offset() * sizeof(float), ",", (t.offset() + count) * sizeof(float), "]}");
    if (json.size() > kMaxSafetensorsHeaderBytes) break;
  }
  json += "}";
  if (json.size() > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the safetensors header would pass ", kMaxSafetensorsHeaderBytes,
        " bytes, more than safetensors reads (", manifest.tensors_size(), " tensors)"));
  }
  // Pad to 8 bytes, so the data is aligned.
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int b = 0; b < 8; ++b) out[b] = static_cast<char>((n >> (8 * b)) & 0xff);
  return out + json;
}

std::string ConfigJsonPathFor(const std::string& safetensors_path) {
  return (std::filesystem::path(safetensors_path).parent_path() / "config.json").string();
}

absl::Status WriteSafetensors(const std::string& path, const v1::ModelManifest& manifest,
                              const float* params, size_t num_params,
                              const std::map<std::string, std::string>& metadata, bool with_config,
                              ExistingOutput existing) {
  absl::StatusOr<std::string> header = SafetensorsHeader(manifest, num_params, metadata);
  if (!header.ok()) return header.status();
  const bool write_config = with_config && !manifest.config_json().empty();
  const std::string config = ConfigJsonPathFor(path);
  if (write_config && std::filesystem::path(path).filename() == "config.json") {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": the model file cannot be named config.json, which is written "
                     "beside it"));
  }
  // Every output is checked before the first is written, so a refusal leaves nothing behind.
  // (A file created between this check and the rename is replaced: the check guards against
  // mistakes, not against a concurrent writer.)
  bool model_existed = false;
  for (const std::string& file : {path, config}) {
    if (file == config && !write_config) continue;
    std::error_code ec;
    const std::filesystem::file_status status = std::filesystem::symlink_status(file, ec);
    if (ec && ec != std::errc::no_such_file_or_directory) {
      return ErrnoStatus(ec.value(), "checking", file);
    }
    if (!std::filesystem::exists(status)) continue;
    if (std::filesystem::is_directory(std::filesystem::status(file, ec))) {
      return absl::InvalidArgumentError(absl::StrCat(file, " is a directory"));
    }
    if (file == path) model_existed = true;
    if (existing == ExistingOutput::kRefuse) {
      return absl::AlreadyExistsError(absl::StrCat(file, " already exists"));
    }
  }
  LOCKSTEP_RETURN_IF_ERROR(WriteFileAtomically(
      path,
      {*header,
       absl::string_view(reinterpret_cast<const char*>(params), num_params * sizeof(float))},
      Durability::kDurable));
  if (!write_config) return absl::OkStatus();
  absl::Status s = WriteFileAtomically(config, manifest.config_json() + "\n", Durability::kDurable);
  if (!s.ok() && !model_existed) {
    // Half an export is worse than none: the model without its configuration does not load.
    std::error_code ignored;
    std::filesystem::remove(path, ignored);
  }
  return s;
}

absl::StatusOr<std::string> WriteModelExport(const std::string& dir,
                                             const v1::ModelManifest& manifest, const float* params,
                                             size_t num_params,
                                             const std::map<std::string, std::string>& metadata) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return ErrnoStatus(ec.value(), "creating output directory", dir);
  const std::string path = (std::filesystem::path(dir) / "model.safetensors").string();
  LOCKSTEP_RETURN_IF_ERROR(WriteSafetensors(path, manifest, params, num_params, metadata, true));
  return path;
}

}  // namespace lockstep
