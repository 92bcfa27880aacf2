// The copy at the heart of lockstep.torch.Checkpointer.save (python/lockstep/checkpoint.py),
// loaded with ctypes from liblockstep_checkpoint.so next to the package's modules: the state's
// tensors gathered into a slot and the slot's payload hashed, in one call and one pass over the
// memory (each piece hashed while it is still in cache). Without this library (a package
// installed from python/ with pip) a save copies with torch.cat and hashes with the xxhash
// module, to the same bytes.
//
// The slot's layout is the Python side's alone: this file knows addresses and lengths.
#include <algorithm>
#include <cstdint>
#include <cstring>

// The hash is libxxhash's, through its dispatch where the library has one (Debian's does): it
// picks the widest vector unit the CPU has at run time (AVX2 hashes about 2.4x as fast as the
// SSE2 a portable build is limited to). Its state is the library's to allocate: its layout is
// not a stable ABI.
#include <xxhash.h>
#if __has_include(<xxh_x86dispatch.h>)
#include <xxh_x86dispatch.h>
#endif

namespace {

// Copied and hashed a piece at a time, small enough to stay in a core's cache in between.
constexpr uint64_t kPiece = 256 << 10;

}  // namespace

extern "C" {

// Copies sizes[i] bytes from srcs[i] to dsts[i] for i in [0, n), then returns in *checksum the
// XXH3-64 of [begin, begin + length): the payload, which holds every destination, in order
// (dsts ascending, none overlapping another or the end); the bytes between and after them
// are hashed as they are; with checksum null, copies only. Returns 0, or -1 without copying
// when the destinations are not so, a source of some bytes is null, or the hash's state could
// not be allocated.
// The caller holds the memory: ctypes releases the GIL for the call.
__attribute__((visibility("default"))) int lockstep_gather_xxh3(int64_t n, const uint64_t* srcs,
                                                                const uint64_t* dsts,
                                                                const uint64_t* sizes,
                                                                uint64_t begin, uint64_t length,
                                                                uint64_t* checksum) {
  const uint64_t end = begin + length;
  if (end < begin) return -1;
  uint64_t at = begin;
  for (int64_t i = 0; i < n; ++i) {
    if (dsts[i] < at || dsts[i] > end || sizes[i] > end - dsts[i]) return -1;
    if (srcs[i] == 0 && sizes[i] != 0) return -1;
    at = dsts[i] + sizes[i];
  }
  if (checksum == nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      if (sizes[i] == 0) continue;  // an empty tensor's address may be null
      std::memcpy(reinterpret_cast<void*>(dsts[i]), reinterpret_cast<const void*>(srcs[i]),
                  sizes[i]);
    }
    return 0;
  }
  // The payload a window at a time: the copies that land in it, then its hash, while it is in
  // cache (one update per window: XXH3 streams fast in large updates, slowly in small ones).
  XXH3_state_t* const state = XXH3_createState();
  if (state == nullptr) return -1;
  XXH3_64bits_reset(state);
  int64_t i = 0;
  uint64_t copied = 0;  // of entry i
  for (uint64_t window = begin; window < end;) {
    const uint64_t window_end = end - window < kPiece ? end : window + kPiece;
    for (; i < n && dsts[i] + copied < window_end; copied = 0, ++i) {
      const uint64_t upto = std::min(dsts[i] + sizes[i], window_end) - dsts[i];
      if (upto > copied) {
        std::memcpy(reinterpret_cast<unsigned char*>(dsts[i]) + copied,
                    reinterpret_cast<const unsigned char*>(srcs[i]) + copied, upto - copied);
      }
      if (upto < sizes[i]) {
        copied = upto;  // the rest of entry i lands in the next window
        break;
      }
    }
    XXH3_64bits_update(state, reinterpret_cast<const void*>(window), window_end - window);
    window = window_end;
  }
  *checksum = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return 0;
}

}  // extern "C"
