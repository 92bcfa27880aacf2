// Token files: uint16 token ids, with or without llm.c's header; mapped, not copied.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/data/files.h"

namespace lockstep::worker {
namespace {

// llm.c's token files: 256 int32 (magic, version, token count, unused), then uint16 tokens.
constexpr int32_t kLlmcMagic = 20240520;
constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

absl::StatusOr<TokenSplit> MapTokenFile(const std::string& path, std::shared_ptr<const void>* storage) {
  absl::StatusOr<Mapping> m = MapReadOnly(path);
  if (!m.ok()) {
    return absl::IsNotFound(m.status())
               ? absl::NotFoundError(absl::StrCat("token file ", path, " does not exist"))
               : m.status();
  }
  TokenSplit split;
  int32_t header[3] = {0, 0, 0};
  if (m->size >= kLlmcHeaderBytes) std::memcpy(header, m->data, sizeof(header));
  if (header[0] == kLlmcMagic) {
    if (header[1] != 1) {
      return absl::DataLossError(
          absl::StrCat(path, ": an llm.c token file of another version (expected 1)"));
    }
    const size_t payload = m->size - kLlmcHeaderBytes;
    if (header[2] < 0 || payload != static_cast<size_t>(header[2]) * sizeof(uint16_t)) {
      return absl::DataLossError(absl::StrCat(
          path, ": the llm.c header's token count does not match the file's size (2 bytes a "
                "token)"));
    }
    split.ids = reinterpret_cast<const uint16_t*>(m->data + kLlmcHeaderBytes);
    split.tokens = header[2];
  } else {
    // A header in llm.c's shape (version 1, a count that matches the size) with another magic
    // is a damaged or foreign header, not tokens.
    if (m->size >= kLlmcHeaderBytes && header[1] == 1 && header[2] > 0 &&
        m->size - kLlmcHeaderBytes == static_cast<size_t>(header[2]) * sizeof(uint16_t)) {
      return absl::DataLossError(
          absl::StrCat(path, ": a damaged header (its magic is not llm.c's 20240520)"));
    }
    if (m->size % sizeof(uint16_t) != 0) {
      return absl::DataLossError(absl::StrCat(
          path, ": an odd number of bytes: not uint16 tokens, and no llm.c header (magic "
                "20240520)"));
    }
    split.ids = reinterpret_cast<const uint16_t*>(m->data);
    split.tokens = static_cast<int64_t>(m->size / sizeof(uint16_t));
  }
  if (split.tokens == 0) return absl::DataLossError(absl::StrCat(path, ": holds no tokens"));
  *storage = m->storage;
  return split;
}

}  // namespace

absl::StatusOr<Dataset> LoadTokenDataset(const std::string& train_path,
                                         const std::string& validation_path) {
  if (validation_path.empty()) {
    return absl::InvalidArgumentError("dataset.validation_path is required for token files");
  }
  std::shared_ptr<const void> train_storage, valid_storage;
  Dataset ds;
  ds.language = true;
  LOCKSTEP_ASSIGN_OR_RETURN(ds.train_tokens, MapTokenFile(train_path, &train_storage));
  LOCKSTEP_ASSIGN_OR_RETURN(ds.valid_tokens, MapTokenFile(validation_path, &valid_storage));
  ds.max_token = std::max(MaxToken(ds.train_tokens), MaxToken(ds.valid_tokens));
  ds.parts.push_back({std::filesystem::path(train_path).filename().string(),
                      HashTokens(ds.train_tokens)});
  ds.parts.push_back({std::filesystem::path(validation_path).filename().string(),
                      HashTokens(ds.valid_tokens)});
  ds.source = absl::StrCat(train_path, " and ", validation_path);
  // One owner keeping both mappings alive.
  ds.storage = std::make_shared<std::pair<std::shared_ptr<const void>, std::shared_ptr<const void>>>(
      std::move(train_storage), std::move(valid_storage));
  return ds;
}

std::string TokensIdentity(const v1::DatasetSpec& spec) {
  std::string identity;
  for (const std::string& f : {spec.path(), spec.validation_path()}) {
    if (absl::StatusOr<std::string> id = FileIdentity(f); id.ok()) {
      absl::StrAppend(&identity, "@", *id);
    }
  }
  return identity;
}

}  // namespace lockstep::worker
