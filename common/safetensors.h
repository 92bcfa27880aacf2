// The safetensors format (Hugging Face's): an 8-byte little-endian header length, a JSON header
// naming each tensor's dtype, shape and byte range in the data that follows, padded with
// spaces to 8 bytes, then the raw little-endian data. Lockstep writes float32 ("F32") only.
#pragma once

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "lockstep/v1/model.pb.h"

namespace lockstep {

// The file's bytes for `params` (the manifest's flat buffer, num_params floats), the tensors
// under their manifest names; `metadata` goes into "__metadata__". INVALID_ARGUMENT when the
// tensors do not tile the buffer exactly.
absl::StatusOr<std::string> SafetensorsHeader(const v1::ModelManifest& manifest, size_t num_params,
                                              const std::map<std::string, std::string>& metadata);

// Writes DIR/model.safetensors and DIR/config.json (atomically; creating DIR). Returns the
// safetensors path. Errors name the file and the system's reason.
absl::StatusOr<std::string> WriteModelExport(const std::string& dir,
                                             const v1::ModelManifest& manifest,
                                             const float* params, size_t num_params,
                                             const std::map<std::string, std::string>& metadata);
// Writes only the safetensors file at `path` (and config.json beside it when `with_config`).
absl::Status WriteSafetensors(const std::string& path, const v1::ModelManifest& manifest,
                              const float* params, size_t num_params,
                              const std::map<std::string, std::string>& metadata,
                              bool with_config);

}  // namespace lockstep
