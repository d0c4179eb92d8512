// CallInstance (call_instance.h) and jaxk3_cpu_call_instance, the instantiate-stage handler of
// every CPU collective.
#include "call_instance.h"

#include <atomic>

namespace ffi = xla::ffi;

namespace jaxk3 {

ffi::TypeId CallInstance::id = XLA_FFI_UNKNOWN_TYPE_ID;
const ffi::TypeInfo CallInstance::info = ffi::MakeTypeInfo<CallInstance>();

namespace {

ffi::ErrorOr<std::unique_ptr<CallInstance>> NewCallInstance() {
  static std::atomic<int64_t> next{1};
  auto instance = std::make_unique<CallInstance>();
  instance->call = next.fetch_add(1, std::memory_order_relaxed);
  return instance;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cpu_call_instance, NewCallInstance, ffi::Ffi::BindInstantiate());

}  // namespace jaxk3
