// XLA FFI handler for platform "cpu": the all-reduce sum through HostComm.
//
// The last rank to arrive sums every rank's operand in rank order (+0, then ranks 0, 1, ..., n-1:
// XLA's init value first, so signed zeros come out as lax.psum's), bfloat16
// and float16 in a float32 accumulator rounded once, float32 and float64 in their own type,
// integers modulo 2^bits, and writes the one result into every rank's output: the result is
// bit-identical on every rank and does not depend on arrival order.
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_collective.h"
#include "float_convert.h"

namespace ffi = xla::ffi;

namespace jaxk3 {
namespace {

template <typename T, bool = std::is_integral_v<T>>
struct AccumulatorOf {
  using Type = T;
};
template <typename T>
struct AccumulatorOf<T, true> {
  using Type = std::make_unsigned_t<T>;
};

template <typename T>
struct Exact {  // accumulate in T itself (integers: unsigned, wrapping)
  using Acc = typename AccumulatorOf<T>::Type;
  static Acc Load(T v) { return static_cast<Acc>(v); }
  static T Store(Acc a) { return static_cast<T>(a); }
};

struct Bf16 {
  using Acc = float;
  static Acc Load(uint16_t v) { return Bf16ToFloat(v); }
  static uint16_t Store(Acc a) { return FloatToBf16(a); }
};

struct Half {
  using Acc = float;
  static Acc Load(uint16_t v) { return HalfToFloat(v); }
  static uint16_t Store(Acc a) { return FloatToHalf(a); }
};

// out[0] = +0 + the sum over ranks in rank order; then copied to every other rank's output.
template <typename T, typename Conv>
void SumInRankOrder(const RoundBuffers& r) {
  using Acc = typename Conv::Acc;
  const size_t count = r.bytes / sizeof(T);
  thread_local std::vector<Acc> acc;
  // From the init value +0 as XLA's reduction does, not from rank 0's value: ranks that all
  // hold -0.0 sum to +0.0, like lax.psum (0 + x is x for every other x).
  acc.assign(count, Acc{});
  for (int s = 0; s < r.n; ++s) {
    const T* in = static_cast<const T*>(r.in[s]);
    for (size_t i = 0; i < count; ++i) acc[i] += Conv::Load(in[i]);
  }
  T* out = static_cast<T*>(r.out[0]);
  for (size_t i = 0; i < count; ++i) out[i] = Conv::Store(acc[i]);
  for (int q = 1; q < r.n; ++q) std::memcpy(r.out[q], out, r.bytes);
}

ffi::Error SumCombine(const RoundBuffers& r) {
  switch (static_cast<ffi::DataType>(r.dtype)) {
    case ffi::DataType::F32: SumInRankOrder<float, Exact<float>>(r); break;
    case ffi::DataType::F64: SumInRankOrder<double, Exact<double>>(r); break;
    case ffi::DataType::BF16: SumInRankOrder<uint16_t, Bf16>(r); break;
    case ffi::DataType::F16: SumInRankOrder<uint16_t, Half>(r); break;
    case ffi::DataType::S8: SumInRankOrder<int8_t, Exact<int8_t>>(r); break;
    case ffi::DataType::S16: SumInRankOrder<int16_t, Exact<int16_t>>(r); break;
    case ffi::DataType::S32: SumInRankOrder<int32_t, Exact<int32_t>>(r); break;
    case ffi::DataType::S64: SumInRankOrder<int64_t, Exact<int64_t>>(r); break;
    case ffi::DataType::U8: SumInRankOrder<uint8_t, Exact<uint8_t>>(r); break;
    case ffi::DataType::U16: SumInRankOrder<uint16_t, Exact<uint16_t>>(r); break;
    case ffi::DataType::U32: SumInRankOrder<uint32_t, Exact<uint32_t>>(r); break;
    case ffi::DataType::U64: SumInRankOrder<uint64_t, Exact<uint64_t>>(r); break;
    default:
      return InvalidArgument("jaxk3 all-reduce: no sum for XLA element type " + std::to_string(r.dtype));
  }
  return ffi::Error::Success();
}

ffi::Future CpuAllReduce(int32_t ordinal, ffi::RunId run_id, CallInstance* instance, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, GroupAttrs attrs) {
  return RunCpuCollective("jaxk3 all-reduce", SumCombine, OutputSize::kSameAsOperand, ordinal, run_id, instance, x,
                          y, attrs);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxk3_cpu_all_reduce, CpuAllReduce, CpuCollectiveBinding());

}  // namespace jaxk3
