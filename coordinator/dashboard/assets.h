// The dashboard's files (its page, script and style, and the chart library from npm), compiled
// into the coordinator by cmake/embed_files.cmake so that it serves them itself: nothing is
// fetched at run time, and a deployment is the binary alone.
#pragma once

#include <cstddef>

namespace lockstep::coordinator {

struct EmbeddedFile {
  const char* name;  // "app.js"
  const unsigned char* data;
  size_t size;
};

// Every file, and how many.
extern const EmbeddedFile kDashboardFiles[];
extern const size_t kDashboardFileCount;

}  // namespace lockstep::coordinator
