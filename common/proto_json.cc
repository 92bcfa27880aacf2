#include "common/proto_json.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"

namespace lockstep {

absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message, bool multiline) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = multiline;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = false;
  std::string json;
  const auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot serialize ", message.GetTypeName(), " to JSON: ", status.ToString()));
  }
  // Pretty output already ends in a newline; a one-line document gets none from protobuf.
  if (!absl::EndsWith(json, "\n")) json += "\n";
  return json;
}

}  // namespace lockstep
