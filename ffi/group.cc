// Group decoding: which group and rank a device has, from the attributes every collective carries.
#include <string>
#include <vector>

#include "common.h"
#include "settings.h"

namespace jaxk3 {
namespace {

constexpr size_t kRow = 4;  // process_index, ffi_ordinal, group_index, rank

}  // namespace

xla::ffi::Error FindGroup(const GroupAttrs& a, int32_t ordinal, GroupRef* out) {
  const int64_t n = a.group_size;
  if (n <= 0 || a.table.size() % kRow != 0 || a.groups.size() % n != 0) {
    return InvalidArgument("jaxk3: malformed group attributes (table " + std::to_string(a.table.size()) +
                           " values, groups " + std::to_string(a.groups.size()) + ", group size " +
                           std::to_string(n) + ")");
  }
  const int64_t me = ProcessIndex();
  for (size_t i = 0; i < a.table.size(); i += kRow) {
    if (a.table[i] != me || a.table[i + 1] != ordinal) continue;
    const int64_t g = a.table[i + 2], r = a.table[i + 3];
    if (g < 0 || (g + 1) * n > static_cast<int64_t>(a.groups.size()) || r < 0 || r >= n) {
      return InvalidArgument("jaxk3: group table row out of range");
    }
    *out = GroupRef{a.groups.begin() + g * n, n, g, static_cast<int>(r)};
    return xla::ffi::Error::Success();
  }
  return InvalidArgument("jaxk3: device with ordinal " + std::to_string(ordinal) + " of process " +
                         std::to_string(me) + " is not in the collective's device table");
}

xla::ffi::Error GroupOrdinals(const GroupAttrs& a, const GroupRef& group, std::vector<int>* out) {
  const int64_t me = ProcessIndex();
  out->assign(static_cast<size_t>(group.size), -1);
  for (size_t i = 0; i + kRow <= a.table.size(); i += kRow) {
    const int64_t r = a.table[i + 3];
    if (a.table[i] == me && a.table[i + 2] == group.index && r >= 0 && r < group.size) {
      (*out)[static_cast<size_t>(r)] = static_cast<int>(a.table[i + 1]);
    }
  }
  for (int o : *out) {
    if (o < 0) return InvalidArgument("jaxk3: the group spans processes");
  }
  return xla::ffi::Error::Success();
}

}  // namespace jaxk3
