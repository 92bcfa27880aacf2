// A small, fully specified PRNG: results must be identical on every worker and platform, which
// std::*_distribution does not promise.
#pragma once

#include <cmath>
#include <cstdint>

namespace lockstep {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound) by multiply-shift (bias below 2^-40 for the sizes used here).
  uint64_t Below(uint64_t bound) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(Next()) * bound) >> 64);
  }
  // Uniform in [0, 1) with 53 random bits.
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  // Standard normal by Box-Muller (one value per call; simplicity over speed).
  double Normal() {
    double u1 = Uniform();
    while (u1 <= 0.0) u1 = Uniform();
    const double u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

// Mixes two values into one seed.
inline uint64_t MixSeed(uint64_t a, uint64_t b) {
  SplitMix64 r(a ^ (b * 0xd6e8feb86659fd93ULL + 0x632be59bd9b4e019ULL));
  r.Next();
  return r.Next();
}

}  // namespace lockstep
