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
// Text from elsewhere (a worker's message, a job's reason) made safe for one terminal line:
// valid UTF-8, and every control byte (newline, escape, ...) written as \xNN, so it can
// neither forge a line of output nor drive the terminal.
std::string EscapeForTerminal(std::string_view text);

}  // namespace lockstep
