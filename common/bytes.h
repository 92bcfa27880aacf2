// Sizes in words: one formatter for every message, log line and table.
#pragma once

#include <cstdint>
#include <string>

namespace lockstep {

// Binary units with one decimal: "512 B", "1.5 KiB", "3.2 GiB".
std::string HumanBytes(int64_t bytes);

}  // namespace lockstep
