// The one byte hash: checksums of parameters and files, fingerprints of specs and data sets.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lockstep {

// 64-bit FNV-1a over `bytes` raw bytes; Fnv1a64(nullptr, 0) is the offset basis
// 0xcbf29ce484222325. Used to compare parameter buffers across ranks, so it hashes the exact
// bit patterns (+0 and -0, or two NaN payloads, hash differently).
uint64_t Fnv1a64(const void* data, size_t bytes);

}  // namespace lockstep
