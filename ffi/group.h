// Which group and rank a device has, from the attributes every gather carries.
//
// The Python side bakes two int64 arrays into each custom call (the same on every device):
//   table  = rows of [process_index, local_ordinal, group_index, rank], one per mesh device
//   groups = [num_groups, group_size] global device ids, each row in rank order
// A device finds its row by (process, ordinal); its group's row of `groups` is the
// communicator key (the ordered device group).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxk3 {

struct GroupRef {
  const int64_t* devices = nullptr;  // group_size global device ids, rank order
  int64_t size = 0;
  int rank = 0;
};

// Set by Python at import (jax.process_index()); identical ordinals in two processes are
// different devices.
int64_t ProcessIndex();
void SetProcessIndex(int64_t p);

inline xla::ffi::Error FindGroup(xla::ffi::Span<const int64_t> table,
                                 xla::ffi::Span<const int64_t> groups, int64_t group_size,
                                 int32_t ordinal, GroupRef* out) {
  using xla::ffi::Error;
  using xla::ffi::ErrorCode;
  if (group_size <= 0 || table.size() % 4 != 0 || groups.size() % group_size != 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "jaxk3 gather: malformed group attributes (table " + std::to_string(table.size()) +
                     " values, groups " + std::to_string(groups.size()) + ", group size " +
                     std::to_string(group_size) + ")");
  }
  const int64_t me = ProcessIndex();
  for (size_t i = 0; i < table.size(); i += 4) {
    if (table[i] != me || table[i + 1] != ordinal) continue;
    int64_t g = table[i + 2], r = table[i + 3];
    if (g < 0 || (g + 1) * group_size > static_cast<int64_t>(groups.size()) || r < 0 || r >= group_size) {
      return Error(ErrorCode::kInvalidArgument, "jaxk3 gather: group table row out of range");
    }
    *out = GroupRef{groups.begin() + g * group_size, group_size, static_cast<int>(r)};
    return Error::Success();
  }
  return Error(ErrorCode::kInvalidArgument,
               "jaxk3 gather: device with ordinal " + std::to_string(ordinal) + " of process " +
                   std::to_string(me) + " is not in the gather's device table");
}

}  // namespace jaxk3
