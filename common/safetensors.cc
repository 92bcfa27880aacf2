#include "common/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"

namespace lockstep {
namespace {

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

}  // namespace

absl::StatusOr<std::string> SafetensorsHeader(const v1::ModelManifest& manifest, size_t num_params,
                                              const std::map<std::string, std::string>& metadata) {
  // The data section is the flat buffer as it is: each tensor's byte range is its place in it,
  // so the tensors must cover it exactly once (safetensors allows no holes or overlaps).
  std::vector<const v1::TensorInfo*> order;
  for (const v1::TensorInfo& t : manifest.tensors()) order.push_back(&t);
  std::sort(order.begin(), order.end(),
            [](const v1::TensorInfo* a, const v1::TensorInfo* b) { return a->offset() < b->offset(); });
  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      absl::StrAppend(&json, first ? "" : ",", JsonQuote(key), ":", JsonQuote(value));
      first = false;
    }
    json += "},";
  }
  size_t next = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const v1::TensorInfo& t = *order[i];
    size_t count = 1;
    std::string shape;
    for (int d = 0; d < t.shape_size(); ++d) {
      if (t.shape(d) <= 0) return absl::InvalidArgumentError(absl::StrCat(t.name(), ": bad shape"));
      count *= static_cast<size_t>(t.shape(d));
      absl::StrAppend(&shape, d == 0 ? "" : ",", t.shape(d));
    }
    if (t.offset() != next) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name(), " starts at ", t.offset(),
                                                     ", not where the one before ends (", next, ")"));
    }
    next += count;
    absl::StrAppend(&json, i == 0 ? "" : ",", JsonQuote(t.name()), ":{\"dtype\":\"F32\",\"shape\":[",
                    shape, "],\"data_offsets\":[", t.offset() * sizeof(float), ",",
                    next * sizeof(float), "]}");
  }
  if (next != num_params) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tensors cover ", next, " of ", num_params, " parameters"));
  }
  json += "}";
  // Pad to 8 bytes, so the data is aligned.
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int b = 0; b < 8; ++b) out[b] = static_cast<char>((n >> (8 * b)) & 0xff);
  return out + json;
}

absl::Status WriteSafetensors(const std::string& path, const v1::ModelManifest& manifest,
                              const float* params, size_t num_params,
                              const std::map<std::string, std::string>& metadata,
                              bool with_config) {
  absl::StatusOr<std::string> header = SafetensorsHeader(manifest, num_params, metadata);
  if (!header.ok()) return header.status();
  if (absl::Status s = WriteFileAtomically(
          path,
          {*header, absl::string_view(reinterpret_cast<const char*>(params),
                                      num_params * sizeof(float))},
          Durability::kDurable);
      !s.ok()) {
    return s;
  }
  if (!with_config || manifest.config_json().empty()) return absl::OkStatus();
  const std::filesystem::path config = std::filesystem::path(path).parent_path() / "config.json";
  return WriteFileAtomically(config.string(), manifest.config_json() + "\n", Durability::kDurable);
}

absl::StatusOr<std::string> WriteModelExport(const std::string& dir,
                                             const v1::ModelManifest& manifest,
                                             const float* params, size_t num_params,
                                             const std::map<std::string, std::string>& metadata) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return ErrnoStatus(ec.value(), "creating output directory", dir);
  const std::string path = (std::filesystem::path(dir) / "model.safetensors").string();
  if (absl::Status s = WriteSafetensors(path, manifest, params, num_params, metadata, true);
      !s.ok()) {
    return s;
  }
  return path;
}

}  // namespace lockstep
