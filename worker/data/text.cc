// Byte-level text: a file, or a directory's text files concatenated once per host in the cache.
#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/utf8.h"
#include "glog/logging.h"
#include "worker/data/files.h"

namespace lockstep::worker {
namespace {

// Text read from a directory, concatenated: a header, then the bytes.
struct TextCacheHeader {
  char magic[8];
  uint64_t bytes;
  uint64_t files;
};
constexpr char kTextCacheMagic[8] = {'L', 'S', 'T', 'X', 'T', 'v', '1', '\0'};

// Why `data` is not text we train on, or empty.
std::string NotText(std::string_view data) {
  if (const size_t nul = data.find('\0'); nul != std::string_view::npos) {
    return absl::StrCat("a NUL byte at offset ", nul, " (binary data)");
  }
  if (const size_t bad = FirstInvalidUtf8(data); bad != std::string_view::npos) {
    return absl::StrCat("not UTF-8 text (byte ", bad, ")");
  }
  return "";
}

bool HasGlob(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

// The files a text source names: `path` itself, the entries of a directory, or those of its
// directory matching its last component's glob; regular files only, in name order.
struct TextSource {
  std::vector<std::string> files;
  std::vector<std::string> skipped;  // "name: why"
  bool single_file = false;
};

absl::StatusOr<TextSource> ListTextSource(const std::string& path) {
  TextSource source;
  std::error_code ec;
  std::filesystem::path dir = path, pattern;
  if (HasGlob(dir.filename().string())) {
    pattern = dir.filename();
    dir = dir.parent_path();
  } else if (std::filesystem::is_regular_file(path, ec)) {
    source.files.push_back(path);
    source.single_file = true;
    return source;
  }
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("text data set ", path, " does not exist"));
  }
  std::vector<std::filesystem::directory_entry> entries;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) entries.push_back(entry);
  if (ec) return absl::NotFoundError(absl::StrCat("cannot list ", dir.string(), ": ", ec.message()));
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.path().filename() < b.path().filename(); });
  for (const auto& entry : entries) {
    const std::string name = entry.path().filename().string();
    if (!pattern.empty() && fnmatch(pattern.c_str(), name.c_str(), 0) != 0) continue;
    if (entry.is_symlink(ec)) {
      source.skipped.push_back(name + ": a link");
    } else if (!entry.is_regular_file(ec)) {
      source.skipped.push_back(name + ": not a regular file");
    } else {
      source.files.push_back(entry.path().string());
    }
  }
  return source;
}

// The source's text files concatenated behind a TextCacheHeader; the files that are not text
// are left out and named in `skipped`.
absl::StatusOr<std::string> ConcatenateText(TextSource* source, StopFlag stop) {
  std::string out(sizeof(TextCacheHeader), '\0');
  TextCacheHeader h{};
  std::memcpy(h.magic, kTextCacheMagic, sizeof(h.magic));
  for (const std::string& file : source->files) {
    if (Stopped(stop)) return StoppedError();
    std::ifstream in(file, std::ios::binary);
    std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) return absl::DataLossError(absl::StrCat("cannot read ", file));
    if (std::string why = NotText(data); !why.empty()) {
      source->skipped.push_back(absl::StrCat(std::filesystem::path(file).filename().string(), ": ", why));
      continue;
    }
    out += data;
    ++h.files;
  }
  h.bytes = out.size() - sizeof(h);
  std::memcpy(out.data(), &h, sizeof(h));
  return out;
}

bool TextCacheValid(const Mapping& m) {
  TextCacheHeader h{};
  if (m.size < sizeof(h)) return false;
  std::memcpy(&h, m.data, sizeof(h));
  return std::memcmp(h.magic, kTextCacheMagic, sizeof(h.magic)) == 0 &&
         m.size == sizeof(h) + h.bytes;
}

}  // namespace

absl::StatusOr<Dataset> LoadTextDataset(const std::string& path, double validation_fraction,
                                        StopFlag stop) {
  if (!(validation_fraction > 0 && validation_fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.validation_fraction must be in (0, 1), got ", validation_fraction));
  }
  LOCKSTEP_ASSIGN_OR_RETURN(TextSource source, ListTextSource(path));
  Mapping text;
  size_t files = source.files.size();
  if (source.single_file) {
    LOCKSTEP_ASSIGN_OR_RETURN(text, MapReadOnly(path));
    const std::string_view data(reinterpret_cast<const char*>(text.data), text.size);
    if (std::string why = NotText(data); !why.empty()) {
      return absl::DataLossError(absl::StrCat(path, ": ", why));
    }
  } else {
    // The directory's text is concatenated once per host, in the cache, and mapped by every
    // worker; keyed by the identity of every file considered.
    std::string identity = std::filesystem::absolute(path).string() + "|";
    for (const std::string& f : source.files) {
      LOCKSTEP_ASSIGN_OR_RETURN(std::string id, FileIdentity(f));
      identity += id;
    }
    bool built_here = false;
    auto build = [&]() {
      built_here = true;
      return ConcatenateText(&source, stop);
    };
    absl::StatusOr<Mapping> mapped = absl::UnavailableError("no cache");
    if (!CacheDir().empty()) {
      mapped = ThroughCache(CacheDir(), HexKey(identity) + ".txt", TextCacheValid, build);
      if (!mapped.ok() && !absl::IsUnavailable(mapped.status())) return mapped.status();
    }
    if (!mapped.ok()) {
      if (!CacheDir().empty()) {
        LOG(WARNING) << "dataset cache unavailable (" << mapped.status() << "); reading " << path;
      }
      LOCKSTEP_ASSIGN_OR_RETURN(std::string concatenated, build());
      auto storage = std::make_shared<const std::string>(std::move(concatenated));
      mapped = Mapping{reinterpret_cast<const uint8_t*>(storage->data()), storage->size(), storage};
    }
    TextCacheHeader h{};
    std::memcpy(&h, mapped->data, sizeof(h));
    files = h.files;
    text = *std::move(mapped);
    text.data += sizeof(h);
    text.size -= sizeof(h);
    // When another process of the host built the cache, it checked the files and logged what
    // it left out; this one only knows how many.
    if (!built_here && files < source.files.size()) {
      source.skipped.push_back(absl::StrCat(source.files.size() - files,
                                            " files that are not UTF-8 text"));
    }
    if (files == 0 || text.size == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "text data set ", path, " holds no UTF-8 text (", source.skipped.size(),
          " entries skipped", source.skipped.empty() ? "" : ": " + source.skipped.front(), ")"));
    }
  }
  if (!source.skipped.empty()) {
    LOG(INFO) << path << ": read " << files << " text files; skipped " << source.skipped.size()
              << " (" << absl::StrJoin(source.skipped.begin(),
                                        source.skipped.begin() +
                                            std::min<size_t>(5, source.skipped.size()),
                                        "; ")
              << (source.skipped.size() > 5 ? "; ..." : "") << ")";
  }
  Dataset ds;
  ds.language = true;
  ds.text = true;
  const int64_t total = static_cast<int64_t>(text.size);
  const int64_t held_out = static_cast<int64_t>(std::llround(total * validation_fraction));
  ds.train_tokens.bytes = text.data;
  ds.train_tokens.tokens = total - held_out;
  ds.valid_tokens.bytes = text.data + (total - held_out);
  ds.valid_tokens.tokens = held_out;
  ds.max_token = std::max(MaxToken(ds.train_tokens), MaxToken(ds.valid_tokens));
  ds.parts.push_back({"training text", HashTokens(ds.train_tokens)});
  ds.parts.push_back({"validation text", HashTokens(ds.valid_tokens)});
  ds.source = absl::StrCat(path, " (", files, files == 1 ? " text file, " : " text files, ",
                           total, " bytes)");
  ds.storage = std::move(text.storage);
  return ds;
}

std::string TextIdentity(const v1::DatasetSpec& spec) {
  // The directory's listing and each file's identity.
  std::string identity;
  if (absl::StatusOr<TextSource> source = ListTextSource(spec.path()); source.ok()) {
    for (const std::string& f : source->files) {
      if (absl::StatusOr<std::string> id = FileIdentity(f); id.ok()) {
        absl::StrAppend(&identity, "@", *id);
      }
    }
  }
  return identity;
}

}  // namespace lockstep::worker
