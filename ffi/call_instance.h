// The identity of one custom-call instance in a compiled program.
//
// XLA runs the FFI instantiate stage once per custom-call thunk, when the program is compiled;
// the state it returns lives with the thunk, and every device of the process runs the same
// thunks.  So the state's `call` id is the same on every device for one instance, and
// different for two instances of one call site (a nested jax.jit inlined twice, a scan body
// unrolled by XLA): the host rounds are keyed by it, and XLA's CPU runtime may run independent
// instances in any order per device without two ranks meeting at different instances.
#pragma once

#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace jaxk3 {

struct CallInstance {
  static xla::ffi::TypeId id;          // registered with XLA from Python (module.cc: ffi_types)
  static const xla::ffi::TypeInfo info;
  int64_t call = 0;                    // process-unique, never reused
};

}  // namespace jaxk3
