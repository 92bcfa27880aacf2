// UTF-8 well-formedness (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace lockstep {

// The offset of the first byte that does not start a well-formed sequence, or npos.
size_t FirstInvalidUtf8(std::string_view text);
// `text` with each ill-formed sequence replaced by U+FFFD (one per maximal bad subpart).
std::string ToValidUtf8(std::string_view text);

}  // namespace lockstep
