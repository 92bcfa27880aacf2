// The safetensors format (Hugging Face's): an 8-byte little-endian header length, a JSON header
// naming each tensor's dtype, shape and byte range in the data that follows, padded with
// spaces to 8 bytes, then the raw little-endian data. Lockstep writes float32 ("F32") only.
#pragma once

#include <cstddef>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "lockstep/v1/model.pb.h"

namespace lockstep {

// The largest JSON header safetensors' own reader accepts (its MAX_HEADER_SIZE).
inline constexpr size_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Checks that `manifest` lays out a flat buffer of `num_params` floats as safetensors needs it:
// every tensor named (non-empty UTF-8, unique, not "__metadata__", the header's reserved key),
// every dimension at least 1, and the tensors covering the buffer exactly once, in offset
// order, with no gap or overlap. Element counts and ends are computed without overflow, so a
// manifest from an untrusted file is safe to check. INVALID_ARGUMENT naming the tensor and the
// problem.
absl::Status CheckManifest(const v1::ModelManifest& manifest, size_t num_params);

// The file's bytes for `params` (the manifest's flat buffer, num_params floats), the tensors
// under their manifest names; `metadata` goes into "__metadata__". INVALID_ARGUMENT when
// CheckManifest fails, a metadata key or value is not UTF-8, or the header would pass
// kMaxSafetensorsHeaderBytes.
absl::StatusOr<std::string> SafetensorsHeader(const v1::ModelManifest& manifest, size_t num_params,
                                              const std::map<std::string, std::string>& metadata);

// Where WriteSafetensors puts config.json: beside the safetensors file.
std::string ConfigJsonPathFor(const std::string& safetensors_path);

// What WriteSafetensors does with output files that exist already.
enum class ExistingOutput {
  kReplace,  // replace them (atomically)
  kRefuse,   // ALREADY_EXISTS, before anything is written
};

// Writes DIR/model.safetensors and DIR/config.json (atomically, replacing older ones; creating
// DIR). Returns the safetensors path. Errors name the file and the system's reason.
absl::StatusOr<std::string> WriteModelExport(const std::string& dir,
                                             const v1::ModelManifest& manifest, const float* params,
                                             size_t num_params,
                                             const std::map<std::string, std::string>& metadata);
// Writes only the safetensors file at `path` (and config.json beside it when `with_config` and
// the manifest has a configuration), each atomically: a reader sees the old file or the new one.
// Everything is checked before anything is written: INVALID_ARGUMENT as SafetensorsHeader, or
// when `path` is a directory or is itself the config.json to write; ALREADY_EXISTS naming the
// file when `existing` is kRefuse and either output exists (a dangling link counts). When the
// config cannot be written, a model file this call created is removed again. Otherwise the
// system's error for the file.
absl::Status WriteSafetensors(const std::string& path, const v1::ModelManifest& manifest,
                              const float* params, size_t num_params,
                              const std::map<std::string, std::string>& metadata, bool with_config,
                              ExistingOutput existing = ExistingOutput::kReplace);

}  // namespace lockstep
