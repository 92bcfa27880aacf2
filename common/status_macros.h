// Status propagation macros. abseil 20220623 ships none, so they live here once.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define LOCKSTEP_CONCAT_INNER_(a, b) a##b
#define LOCKSTEP_CONCAT_(a, b) LOCKSTEP_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define LOCKSTEP_RETURN_IF_ERROR(expr)                  \
  do {                                                  \
    ::absl::Status lockstep_status_ = (expr);           \
    if (!lockstep_status_.ok()) return lockstep_status_; \
  } while (0)

// `lhs` = value of the StatusOr `rexpr`, or returns its status from the enclosing function.
#define LOCKSTEP_ASSIGN_OR_RETURN(lhs, rexpr) \
  LOCKSTEP_ASSIGN_OR_RETURN_IMPL_(LOCKSTEP_CONCAT_(lockstep_statusor_, __LINE__), lhs, rexpr)

#define LOCKSTEP_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                    \
  if (!statusor.ok()) return statusor.status();               \
  lhs = std::move(statusor).value()
