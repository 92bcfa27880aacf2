#include "common/path_roots.h"

#include <filesystem>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace lockstep {
namespace {

// "/a//b/./c/" -> "/a/b/c"; "" for a relative path or one with a ".." component.
std::string Normalize(const std::string& path) {
  if (path.empty() || path.front() != '/') return "";
  std::vector<absl::string_view> parts;
  for (absl::string_view part : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    if (part == ".") continue;
    if (part == "..") return "";
    parts.push_back(part);
  }
  return absl::StrCat("/", absl::StrJoin(parts, "/"));
}

}  // namespace

bool PathIsWithin(const std::string& path, const std::string& root) {
  if (root == "/") return !path.empty() && path.front() == '/';
  return path == root || (path.size() > root.size() && path.compare(0, root.size(), root) == 0 &&
                          path[root.size()] == '/');
}

bool PathRoots::allows_any_path() const {
  for (const std::string& root : roots_) {
    if (root == "/") return true;
  }
  return false;
}

absl::StatusOr<PathRoots> PathRoots::Parse(const std::string& flag) {
  PathRoots roots;
  for (absl::string_view entry : absl::StrSplit(flag, ',', absl::SkipWhitespace())) {
    const std::string raw(absl::StripAsciiWhitespace(entry));
    const std::string normalized = Normalize(raw);
    if (normalized.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", raw, "\" is not an absolute directory without \"..\""));
    }
    roots.roots_.push_back(normalized);
  }
  return roots;
}

absl::Status ParseRootFlags(const std::string& data_root_flag,
                            const std::string& checkpoint_root_flag, PathRoots* data,
                            PathRoots* checkpoints) {
  for (const auto& [flag, value, out] :
       {std::tuple<const char*, const std::string&, PathRoots*>{"--data_root", data_root_flag, data},
        {"--checkpoint_root", checkpoint_root_flag, checkpoints}}) {
    absl::StatusOr<PathRoots> parsed = PathRoots::Parse(value);
    if (parsed.ok() && !parsed->restricted()) {
      parsed = absl::InvalidArgumentError(
          "empty: name the directories jobs may use, comma-separated, or \"/\" for any path");
    }
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": ", parsed.status().message()));
    }
    *out = *std::move(parsed);
  }
  return absl::OkStatus();
}

std::string PathRoots::Describe() const { return absl::StrJoin(roots_, ", "); }

absl::Status PathRoots::Check(const std::string& field, const std::string& path) const {
  if (!restricted() || path.empty()) return absl::OkStatus();
  const std::string normalized = Normalize(path);
  if (normalized.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": \"", path, "\" must be an absolute path without \"..\" (allowed: ",
        Describe(), ")"));
  }
  for (const std::string& root : roots_) {
    if (PathIsWithin(normalized, root)) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": \"", path, "\" is outside the allowed directories (", Describe(), ")"));
}

absl::Status PathRoots::CheckOnHost(const std::string& field, const std::string& path) const {
  if (absl::Status s = Check(field, path); !s.ok() || !restricted() || path.empty()) return s;
  // The nearest ancestor that exists, resolved; the rest is appended as it is (it cannot
  // hold a symlink yet).
  std::filesystem::path existing = std::filesystem::path(Normalize(path));
  std::filesystem::path rest;
  std::error_code ec;
  while (!std::filesystem::exists(existing, ec) && existing.has_parent_path() &&
         existing != existing.parent_path()) {
    rest = existing.filename() / rest;
    existing = existing.parent_path();
  }
  const std::filesystem::path real = std::filesystem::canonical(existing, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": cannot resolve \"", path, "\": ", ec.message()));
  }
  const std::string resolved = Normalize((real / rest).lexically_normal().string());
  for (const std::string& root : roots_) {
    std::error_code root_ec;
    const std::filesystem::path real_root = std::filesystem::canonical(root, root_ec);
    const std::string r = root_ec ? root : real_root.string();
    if (!resolved.empty() && PathIsWithin(resolved, r)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      field, ": \"", path, "\" leads to ", resolved.empty() ? real.string() : resolved,
      " (through a symbolic link), outside the allowed directories (", Describe(), ")"));
}

}  // namespace lockstep
