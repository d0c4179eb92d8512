// What every jaxk3 handler shares: the group attributes and their decoding, the output-size
// check, error helpers, and the address of a handler symbol for registration.
//
// Every collective carries the same four attributes (baked into the HLO by Python, identical on
// every device):
//   site       a process-unique id of the call (diagnostics)
//   group_size n, the devices of one group
//   table      rows of [process_index, ffi_ordinal, group_index, rank], one per mesh device
//   groups     [num_groups, n] global device ids, each row in rank order
// A device finds its row by (process, ordinal); its group's row of `groups` is the
// communicator key (the ordered device group).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxk3 {

struct GroupAttrs {
  int64_t site = 0;
  int64_t group_size = 0;
  xla::ffi::Span<const int64_t> table;
  xla::ffi::Span<const int64_t> groups;
};

// This device's place in its group.
struct GroupRef {
  const int64_t* devices = nullptr;  // group_size global device ids, rank order
  int64_t size = 0;
  int64_t index = 0;  // which row of `groups`
  int rank = 0;
};

// Finds the group and rank of the device with FFI ordinal `ordinal` in this process.
xla::ffi::Error FindGroup(const GroupAttrs& attrs, int32_t ordinal, GroupRef* out);

// The FFI ordinal of every rank of `group` (all of them in this process), rank order.
xla::ffi::Error GroupOrdinals(const GroupAttrs& attrs, const GroupRef& group, std::vector<int>* out);

// Errors, always returned (never thrown, never fatal).
inline xla::ffi::Error InvalidArgument(std::string msg) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument, std::move(msg));
}
inline xla::ffi::Error Internal(std::string msg) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kInternal, std::move(msg));
}
inline xla::ffi::Error FailedPrecondition(std::string msg) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kFailedPrecondition, std::move(msg));
}

// A buffer's dimensions as "[d0, d1, ...]", for the errors that name a bad shape.
inline std::string DimsText(xla::ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// An asynchronous handler's result that is already a failure.
inline xla::ffi::Future FailedFuture(xla::ffi::Error error) {
  xla::ffi::Promise promise;
  xla::ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

// `op`'s output must hold `want` bytes.
inline xla::ffi::Error CheckOutputBytes(const char* op, size_t have, size_t want) {
  if (have == want) return xla::ffi::Error::Success();
  return InvalidArgument(std::string(op) + ": output has " + std::to_string(have) + " bytes, expected " +
                         std::to_string(want));
}

// `op`'s output must hold a whole number (>= 1) of copies of a non-empty operand.
inline xla::ffi::Error CheckWholeCopies(const char* op, size_t have, size_t operand) {
  if (operand > 0 && have > 0 && have % operand == 0) return xla::ffi::Error::Success();
  return InvalidArgument(std::string(op) + ": output of " + std::to_string(have) +
                         " bytes is not a whole number of " + std::to_string(operand) + "-byte operands");
}

// The address of a handler symbol (XLA_FFI_DEFINE_HANDLER_SYMBOL), for a registration capsule.
template <typename Fn>
void* HandlerAddress(Fn* fn) {
  static_assert(std::is_same_v<Fn, XLA_FFI_Error*(XLA_FFI_CallFrame*)>,
                "registered targets must be XLA FFI handler symbols");
  return reinterpret_cast<void*>(fn);
}

}  // namespace jaxk3

// Handlers bind the four attributes as one struct: `.Attrs<jaxk3::GroupAttrs>()`.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxk3::GroupAttrs,
                                      ::xla::ffi::StructMember<int64_t>("site"),
                                      ::xla::ffi::StructMember<int64_t>("group_size"),
                                      ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("table"),
                                      ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("groups"));
