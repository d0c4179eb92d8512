// nanobind module jaxk3._ffi: the targets to register, build facts, the settings Python owns,
// the communicator controls and the test hooks.  No logic of its own.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "host_comm.h"
#include "settings.h"
#include "targets.h"
#include "transport.h"
#include "yield_gauge.h"
#ifdef JAXK3_WITH_CUDA
#include "cuda_comm.h"
#endif

namespace nb = nanobind;

namespace jaxk3 {
namespace {

// name -> the handler capsule, or {"instantiate": ..., "execute": ...} for a stateful one.
nb::dict TargetDict(const std::vector<Target>& targets) {
  nb::dict d;
  for (const Target& t : targets) {
    if (t.instantiate == nullptr) {
      d[t.name] = nb::capsule(t.execute);
    } else {
      nb::dict stages;
      stages["instantiate"] = nb::capsule(t.instantiate);
      stages["execute"] = nb::capsule(t.execute);
      d[t.name] = stages;
    }
  }
  return d;
}

// name -> {"type_id": ..., "type_info": ...}, for jax.ffi.register_ffi_type.
nb::dict TypeDict(const std::vector<FfiType>& types) {
  nb::dict d;
  for (const FfiType& t : types) {
    nb::dict reg;
    reg["type_id"] = nb::capsule(t.type_id);
    reg["type_info"] = nb::capsule(t.type_info);
    d[t.name] = reg;
  }
  return d;
}

// Drives the host rendezvous directly (no XLA), so tests can exercise missing peers and
// disagreeing ranks from Python threads.  `align` > 1 is the padded gather.
nb::bytes HostGatherForTest(std::vector<int64_t> devices, int64_t site, int rank, nb::bytes payload,
                            int32_t dtype, size_t align) {
  HostComm* comm = GetHostComm(devices.data(), devices.size());
  std::string in(payload.c_str(), payload.size());
  std::string out(in.size() * devices.size(), '\0');
  std::optional<std::string> error;
  {
    nb::gil_scoped_release release;
    RankArgs a;
    a.call = site;
    a.site = site;
    a.rank = rank;
    a.in = in.data();
    a.bytes = in.size();
    a.dtype = dtype;
    a.combine = HostGatherCombine(align);
    a.out = out.data();
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    comm->Run(a).OnReady([&](const std::optional<xla::ffi::Error>& e) {
      std::lock_guard<std::mutex> lock(mu);
      if (e) error = e->message();
      done = true;
      cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
  if (error) throw std::runtime_error(*error);
  return nb::bytes(out.data(), out.size());
}

// Drives the yield gauge with made-up yields and times, from a fresh gauge, leaving a fresh one
// behind.  Steps: ("yield", took_us, at_us, own_cpu_us), one rank's yield (own_cpu_us: this
// process's working CPU time meanwhile); ("probe", took_us, 0, own_cpu_us); ("how", 0, at_us, 0),
// whose answer ("yield", "sleep" or "probe") is returned in order.  `keep`: leave the gauge as the
// steps left it (a test of what reads it), not fresh.
std::vector<std::string> YieldGaugeForTest(
    const std::vector<std::tuple<std::string, double, double, double>>& steps, bool keep) {
  const auto us = [](double v) { return std::chrono::nanoseconds(static_cast<int64_t>(v * 1e3)); };
  const GaugeClock::time_point t0 = GaugeClock::now();
  std::atomic<int> slow_in_a_row{0};
  std::vector<std::string> out;
  ResetGaugeForTest();
  for (const auto& [what, took, at, own_cpu] : steps) {
    if (what == "yield") RecordYield(slow_in_a_row, us(took), us(own_cpu), t0 + us(at));
    if (what == "probe") RecordProbe(us(took), us(own_cpu));
    if (what != "how") continue;
    const WaitHow how = HowToWait(t0 + us(at));
    out.push_back(how == WaitHow::kYield ? "yield" : how == WaitHow::kSleep ? "sleep" : "probe");
  }
  if (!keep) ResetGaugeForTest();
  return out;
}

nb::dict BuildInfo() {
  nb::dict d;
  d["ffi_cpu"] = true;
#ifdef JAXK3_WITH_CUDA
  d["ffi_cuda"] = true;
  d["cuda_archs"] = std::string(JAXK3_CUDA_ARCHS_STR);
#else
  d["ffi_cuda"] = false;
  d["cuda_archs"] = std::string();
#endif
  d["built_with_jax"] = std::string(JAXK3_BUILT_WITH_JAX);
  d["transport_align"] = kTransportAlign;
  return d;
}

#ifdef JAXK3_WITH_CUDA
// (ok, reason) for a GPU group in rank order; creates its communicator (receive buffers, peer
// access, kernel loaded on every GPU) so that no execute does setup.  Device ids are taken as
// CUDA ordinals unless `ordinals` is given (true for one process).
nb::tuple CudaGroupOk(std::vector<int64_t> devices, std::optional<std::vector<int>> ordinals) {
  std::vector<int> ords;
  if (ordinals) {
    ords = *ordinals;
  } else {
    for (int64_t d : devices) ords.push_back(static_cast<int>(d));
  }
  std::string why;
  {
    nb::gil_scoped_release release;
    why = CudaGroupSetup(devices, ords);
  }
  return nb::make_tuple(why.empty(), why);
}

nb::tuple CudaLonelyGather(std::vector<int> ordinals, int64_t timeout_ms, bool two_streams) {
  double ms = 0;
  std::string msg;
  {
    nb::gil_scoped_release release;
    msg = CudaLonelyGatherForTest(ordinals, timeout_ms, two_streams, &ms);
  }
  return nb::make_tuple(msg, ms);
}
#endif

}  // namespace
}  // namespace jaxk3

NB_MODULE(_ffi, m) {
  using namespace jaxk3;
  m.def("cpu_targets", [] { return TargetDict(CpuTargets()); });
  m.def("cpu_types", [] { return TypeDict(CpuTypes()); });
  m.def("cuda_targets", [] { return TargetDict(CudaTargets()); });
  m.def("cuda_kernels", [] { return TargetDict(CudaKernels()); });
  m.attr("cuda_kernels_abi") = JAXK3_CUDA_KERNELS_ABI;
  m.def("build_info", &BuildInfo);
  // Settings (jaxk3/collectives/settings.py sets them all when it loads the extension).
  m.def("set_process_index", &SetProcessIndex);
  m.def("set_timeout_ms", &SetTimeoutMs);
  m.def("timeout_ms", &TimeoutMs);
  m.def("set_cuda_capacity_bytes", &SetCudaCapacityBytes);
  m.def("cuda_capacity_bytes", &CudaCapacityBytes);
  m.def("set_verbose", &SetVerbose);
  // Communicators.
  m.def("reset", &ResetHostComms);
  m.def("num_host_comms", &NumHostComms);
#ifdef JAXK3_WITH_CUDA
  m.def("cuda_group_ok", &CudaGroupOk, nb::arg("devices"), nb::arg("ordinals") = nb::none());
  m.def("cuda_device_count", &CudaDeviceCount);
  m.def("_cuda_lonely_gather_for_test", &CudaLonelyGather, nb::arg("ordinals"), nb::arg("timeout_ms"),
        nb::arg("two_streams") = false);
  m.def(
      "_cuda_shared_gpu_gather_for_test",
      [](int ordinal, int n, size_t bytes, int calls) {
        nb::gil_scoped_release release;
        return CudaSharedGpuGatherForTest(ordinal, n, bytes, calls);
      },
      nb::arg("ordinal"), nb::arg("n"), nb::arg("bytes"), nb::arg("calls"));
#endif
  // Test hooks.
  m.def("_set_poison_outputs", &SetPoisonOutputs);
  m.def("_set_match_by_site", &SetMatchBySite);
  m.def("_set_wait_mode", [](const std::string& mode) {  // "auto", "yield" or "sleep"
    if (mode != "auto" && mode != "yield" && mode != "sleep") throw nb::value_error("wait mode: auto, yield or sleep");
    SetWaitModeForTest(mode == "yield" ? WaitMode::kYield : mode == "sleep" ? WaitMode::kSleep : WaitMode::kAuto);
  });
  m.def("_yield_gauge_for_test", &YieldGaugeForTest, nb::arg("steps"), nb::arg("keep") = false);
  m.def("waiters_sleeping", &GaugeSleeping);  // the CPU transport's waiters sleep (busy foreign threads seen)
  m.def("_host_gather_for_test", &HostGatherForTest, nb::arg("devices"), nb::arg("site"), nb::arg("rank"),
        nb::arg("payload"), nb::arg("dtype"), nb::arg("align"));
}
