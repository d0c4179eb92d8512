// Constants and combines of the transports, shared by the handlers and the test hooks.
#pragma once

#include <cstddef>

#include "host_comm.h"

namespace jaxk3 {

// Slot alignment of the padded variant: each rank's payload is padded to this in transport.
constexpr size_t kTransportAlign = 16;

// The host gather's Combine: the one-shot one (align 1) or the padded one (align > 1).
Combine HostGatherCombine(size_t align);

}  // namespace jaxk3
