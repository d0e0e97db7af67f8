// Python binding of the allocator core: vmalloc._core.Allocator (subclassed by vmalloc.Allocator,
// so malloc/free go straight to C++), backend_granularity, and the C++ loops used by the benchmark
// and the thread stress test.
#include <nanobind/nanobind.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "alloc/allocator.hpp"
#include "alloc/bench_loops.hpp"
#include "driver/driver.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using vmalloc::Allocator;

nb::dict stats_dict(const vmalloc::Stats& s) {
  nb::dict d;
  // DESIGN.md keys first.
  d["requested_current"] = s.requested_current;
  d["requested_peak"] = s.requested_peak;
  d["mapped_current"] = s.mapped_current;
  d["mapped_peak"] = s.mapped_peak;
  d["physical_current"] = s.physical_current;
  d["physical_peak"] = s.physical_peak;
  d["internal_fragmentation"] = s.internal_fragmentation;
  d["num_malloc"] = s.num_malloc;
  d["num_free"] = s.num_free;
  d["num_map"] = s.num_map;
  d["num_unmap"] = s.num_unmap;
  d["num_chunks_created"] = s.num_chunks_created;
  d["chunk_size"] = s.chunk_size;
  // Extras.
  d["budget"] = s.budget;
  d["granularity"] = s.granularity;
  d["num_chunks_released"] = s.num_chunks_released;
  d["cached_bytes"] = s.cached_bytes;
  d["num_live"] = s.num_live;
  d["num_cache_hits"] = s.num_cache_hits;
  d["num_remaps"] = s.num_remaps;
  d["num_splits"] = s.num_splits;
  d["num_merges"] = s.num_merges;
  d["num_small_malloc"] = s.num_small_malloc;
  d["num_small_free"] = s.num_small_free;
  d["small_requested_current"] = s.small_requested_current;
  d["small_pool_bytes"] = s.small_pool_bytes;
  d["num_oom"] = s.num_oom;
  d["num_pressure_calls"] = s.num_pressure_calls;
  d["num_stream_waits"] = s.num_stream_waits;
  d["num_va_reserve"] = s.num_va_reserve;
  d["va_reserved"] = s.va_reserved;
  d["driver_seconds"] = s.driver_seconds;
  d["num_trace_dropped"] = s.num_trace_dropped;
  return d;
}

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

std::string py_repr(nb::handle h) {
  try {
    return nb::cast<std::string>(nb::repr(h));
  } catch (...) {
    return "<unrepresentable>";
  }
}

// An unsigned 64-bit argument (a size, a stream handle, an address) from any int (or anything
// with __index__, e.g. numpy integers), never a bool. Checked here rather than by nanobind's
// uint64_t caster so a bad value names the parameter (not "incompatible function arguments"),
// and here rather than in vmalloc/allocator.py so malloc/free stay one native call.
// `what` says what the int stands for.
uint64_t u64_arg(nb::handle n, const char* name, const char* what) {
  if (PyBool_Check(n.ptr()) || !PyIndex_Check(n.ptr()))
    throw nb::type_error((std::string(name) + ": expected an int (" + what + "), got " + py_repr(n)).c_str());
  nb::object i = nb::steal(PyNumber_Index(n.ptr()));
  if (!i.is_valid()) throw nb::python_error();
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow < 0 || (overflow == 0 && v < 0))
    throw std::invalid_argument(std::string(name) + ": expected an int >= 0 (" + what + "), got " + py_repr(n));
  if (overflow == 0) return static_cast<uint64_t>(v);
  unsigned long long u = PyLong_AsUnsignedLongLong(i.ptr());  // 2**63 .. 2**64-1, else OverflowError
  if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw std::invalid_argument(std::string(name) + ": " + py_repr(n) + " is too large: " + what + " is below 2**64");
  }
  return static_cast<uint64_t>(u);
}

// A byte count: positive and below 2**64 (the README's size rule; the core answers anything
// above what the device holds with OutOfMemoryError, naming the true request).
uint64_t byte_count(nb::handle n, const char* name) {
  if (PyBool_Check(n.ptr()) || !PyIndex_Check(n.ptr()))
    throw nb::type_error((std::string(name) + ": expected an int byte count, got " + py_repr(n)).c_str());
  nb::object i = nb::steal(PyNumber_Index(n.ptr()));
  if (!i.is_valid()) throw nb::python_error();
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow < 0 || (overflow == 0 && v <= 0))
    throw std::invalid_argument(std::string(name) + ": must be a positive byte count, got " + py_repr(n));
  return overflow == 0 ? static_cast<uint64_t>(v) : u64_arg(i, name, "a byte count");
}

}  // namespace

void bind_alloc(nb::module_& m) {
  // vmalloc::OutOfMemory -> vmalloc.errors.OutOfMemoryError(message, requested, in_use, budget);
  // driver::DriverShutDown -> vmalloc.errors.DriverShutDownError(message).
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const vmalloc::OutOfMemory& e) {
      nb::object cls = nb::module_::import_("vmalloc.errors").attr("OutOfMemoryError");
      nb::object err = cls(e.what(), e.requested, e.in_use, e.budget);
      PyErr_SetObject(cls.ptr(), err.ptr());
    } catch (const vmalloc::driver::DriverShutDown& e) {
      nb::object cls = nb::module_::import_("vmalloc.errors").attr("DriverShutDownError");
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  // every keyword default below, and DEFAULT_CONFIG, is the core's own (allocator.hpp: Config)
  const vmalloc::Config defaults;
  nb::dict default_config;
  default_config["backend"] = defaults.backend;
  default_config["chunk_size"] = defaults.chunk_size;
  default_config["budget"] = defaults.budget;
  default_config["device"] = defaults.device;
  default_config["small_threshold"] = defaults.small_threshold;
  default_config["split_cached"] = defaults.split_cached;
  default_config["merge_cached"] = defaults.merge_cached;
  default_config["prefer_remap"] = defaults.prefer_remap;
  // (< 0 is no cap: None, as vmalloc.Allocator takes it)
  default_config["cache_slack"] =
      defaults.cache_slack < 0 ? nb::object(nb::none()) : nb::object(nb::float_(defaults.cache_slack));
  default_config["trace_capacity"] = defaults.trace_capacity;
  m.attr("DEFAULT_CONFIG") = default_config;

  nb::class_<Allocator>(m, "Allocator",
                        "Native chunked VMM allocator. Use vmalloc.Allocator (it validates arguments).")
      .def(
          "__init__",
          [](Allocator* self, const std::string& backend, size_t chunk_size, size_t budget, int device,
             size_t small_threshold, bool split_cached, bool prefer_remap, double cache_slack,
             size_t trace_capacity, bool merge_cached) {
            vmalloc::Config cfg;
            cfg.backend = backend;
            cfg.chunk_size = chunk_size;
            cfg.budget = budget;
            cfg.device = device;
            cfg.small_threshold = small_threshold;
            cfg.split_cached = split_cached;
            cfg.prefer_remap = prefer_remap;
            cfg.cache_slack = cache_slack;
            cfg.trace_capacity = trace_capacity;
            cfg.merge_cached = merge_cached;
            new (self) Allocator(cfg);
          },
          "backend"_a = defaults.backend, "chunk_size"_a = defaults.chunk_size,
          "budget"_a = defaults.budget, "device"_a = defaults.device,
          "small_threshold"_a = defaults.small_threshold, "split_cached"_a = defaults.split_cached,
          "prefer_remap"_a = defaults.prefer_remap, "cache_slack"_a = defaults.cache_slack,
          "trace_capacity"_a = defaults.trace_capacity, "merge_cached"_a = defaults.merge_cached)
      .def(
          "malloc",
          [](Allocator& a, nb::handle n, nb::handle s) -> uintptr_t {
            uint64_t nbytes = byte_count(n, "nbytes");
            uint64_t stream = u64_arg(s, "stream", "a stream handle");
            nb::gil_scoped_release release;
            return reinterpret_cast<uintptr_t>(a.malloc(static_cast<size_t>(nbytes), stream));
          },
          "nbytes"_a.none(), "stream"_a.none() = 0, "Allocate at least `nbytes` bytes usable on `stream`; returns the address.")
      .def(
          "free",
          [](Allocator& a, nb::handle p) {
            void* ptr = as_ptr(u64_arg(p, "ptr", "an address"));
            nb::gil_scoped_release release;
            a.free(ptr);
          },
          "ptr"_a.none(), "Free an address returned by malloc.")
      .def(
          "record_stream",
          [](Allocator& a, nb::handle p, nb::handle s) {
            void* ptr = as_ptr(u64_arg(p, "ptr", "an address"));
            uint64_t stream = u64_arg(s, "stream", "a stream handle");
            nb::gil_scoped_release release;
            a.record_stream(ptr, stream);
          },
          "ptr"_a.none(), "stream"_a.none(),
          "The allocation is also used on `stream`: its memory waits for that stream's work before reuse.")
      .def("add_peer", &Allocator::add_peer, "device"_a, nb::call_guard<nb::gil_scoped_release>(),
           "Give CUDA device `device` read-write access to all memory this allocator has mapped and "
           "will map (one process, several GPUs). False when it has no peer-to-peer path (and on "
           "the host backend).")
      .def("stats", [](const Allocator& a) { return stats_dict(a.stats()); })
      .def("reset_peak", &Allocator::reset_peak, "Set the *_peak stats to their current values.")
      .def("trim", &Allocator::trim, nb::call_guard<nb::gil_scoped_release>(),
           "Release cached physical chunks to the driver; returns the bytes released.")
      .def("set_budget", &Allocator::set_budget, "bytes"_a, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "set_pressure_callback",
          [](Allocator& a, nb::object fn) {
            if (fn.is_none()) {
              a.set_pressure_callback(nullptr);
              return;
            }
            if (!PyCallable_Check(fn.ptr())) throw nb::type_error("callback: expected a callable or None");
            // The allocator copies the std::function without the GIL: hold the Python object behind a
            // shared_ptr (atomic refcount) and touch it only with the GIL held.
            std::shared_ptr<nb::object> holder(new nb::object(fn), [](nb::object* o) {
              nb::gil_scoped_acquire g;
              delete o;
            });
            a.set_pressure_callback([holder](size_t needed) -> bool {
              nb::gil_scoped_acquire g;
              nb::object r = (*holder)(needed);
              if (!PyBool_Check(r.ptr()))
                throw nb::type_error(("pressure callback: must return True (it freed memory) or False, got " +
                                      py_repr(r))
                                         .c_str());
              return r.ptr() == Py_True;
            });
          },
          "callback"_a.none())
      .def("set_trace", &Allocator::set_trace, "on"_a)
      .def("set_trace_capacity", &Allocator::set_trace_capacity, "events"_a,
           "Keep at most `events` trace events (a ring: the oldest are dropped and counted in "
           "stats()['num_trace_dropped']).")
      .def("take_trace",
           [](Allocator& a) {
             nb::list out;
             for (const auto& e : a.take_trace()) {
               nb::dict d;
               d["action"] = e.action_name();
               d["id"] = e.id;
               d["size"] = e.size;
               d["stream"] = e.stream;
               d["time"] = e.time;
               d["addr"] = e.addr;
               out.append(d);
             }
             return out;
           })
      .def("allocation_size",
           [](const Allocator& a, nb::handle p) {
             return a.allocation_size(as_ptr(u64_arg(p, "ptr", "an address")));
           },
           "ptr"_a.none())
      .def("live_allocations",
           [](const Allocator& a) {
             nb::list out;
             for (const auto& [addr, size] : a.live_allocations()) out.append(nb::make_tuple(addr, size));
             return out;
           },
           "(address, requested bytes) of every live allocation, sorted by address.")
      .def("close", &Allocator::close, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("closed", &Allocator::closed)
      .def_prop_ro("forked", &Allocator::forked,
                   "True in a process forked after the allocator was created: it is dead there.")
      .def(
          "_inject_fault",
          [](Allocator& a, const std::string& call, uint64_t nth, int err, uint64_t count) {
            a.inject_fault(call, nth, err, count);
          },
          "call"_a, "nth"_a = 1, "errno"_a = 5 /*EIO*/, "count"_a = 1,
          "Test hook (host backend): the `nth` next driver call named `call` (create, release, map, unmap, "
          "reserve, unreserve, record, any) fails with `errno`, and so do the `count` - 1 after it "
          "(count 0: all). nth=0 disarms.")
      .def("_debug_state",
           [](const Allocator& a) {
             auto s = a.debug_state();
             nb::dict d;
             d["committed_bytes"] = s.committed_bytes;
             d["mapped_bytes"] = s.mapped_bytes;
             d["faults_fired"] = s.faults_fired;
             d["free_chunks"] = s.free_chunks;
             d["cached_range_chunks"] = s.cached_range_chunks;
             d["slab_chunks"] = s.slab_chunks;
             d["chunks_held"] = s.chunks_held;
             d["close_block_visits"] = s.close_block_visits;
             d["trace_events"] = s.trace_events;
             return d;
           },
           "Test hook: the backend's own counts (committed, mapped bytes) and the pools' sizes.")
      .def_prop_ro("trace_capacity", [](const Allocator& a) { return a.config().trace_capacity; })
      .def_prop_ro("backend", [](const Allocator& a) { return a.config().backend; })
      .def_prop_ro("chunk_size", [](const Allocator& a) { return a.config().chunk_size; })
      .def_prop_ro("budget", [](const Allocator& a) { return a.config().budget; })
      .def_prop_ro("device", [](const Allocator& a) { return a.config().device; })
      .def_prop_ro("small_threshold", [](const Allocator& a) { return a.config().small_threshold; })
      .def_prop_ro("split_cached", [](const Allocator& a) { return a.config().split_cached; })
      .def_prop_ro("prefer_remap", [](const Allocator& a) { return a.config().prefer_remap; })
      .def_prop_ro("merge_cached", [](const Allocator& a) { return a.config().merge_cached; })
      .def_prop_ro("cache_slack",
                   [](const Allocator& a) -> nb::object {  // (no cap: None, as it is given)
                     double slack = a.config().cache_slack;
                     return slack < 0 ? nb::object(nb::none()) : nb::object(nb::float_(slack));
                   })
      .def_prop_ro("granularity", &Allocator::granularity)
      .def_prop_ro("total_memory", &Allocator::total_memory)
      .def("largest_available", &Allocator::largest_available, nb::call_guard<nb::gil_scoped_release>(),
           "Bytes of the largest malloc that succeeds now without the pressure callback: cached chunks "
           "plus the whole chunks the budget and the device's free memory (less 1/64, for what others "
           "may take meanwhile) allow.");

  m.def("backend_granularity", &vmalloc::backend_granularity, "backend"_a, "device"_a = 0,
        "Allocation granularity of a backend (host: the page size; cuda: cuMemGetAllocationGranularity).");

  m.def(
      "alloc_bench_cycle",
      [](Allocator& a, const std::vector<size_t>& sizes, size_t repeats) {
        return vmalloc::bench::malloc_free_cycle(a, sizes, repeats);
      },
      "allocator"_a, "sizes"_a, "repeats"_a, nb::call_guard<nb::gil_scoped_release>(),
      "Time `repeats` rounds of malloc+free for each size, in C++ (seconds).");

  m.def(
      "alloc_stress_threads",
      [](Allocator& a, int threads, size_t iters, size_t max_bytes, uint64_t seed) {
        vmalloc::bench::StressResult r;
        {
          nb::gil_scoped_release release;
          r = vmalloc::bench::stress_threads(a, threads, iters, max_bytes, seed);
        }
        nb::dict d;
        d["operations"] = r.operations;
        d["corruptions"] = r.corruptions;
        d["overlaps"] = r.overlaps;
        d["oom"] = r.oom;
        return d;
      },
      "allocator"_a, "threads"_a, "iters"_a, "max_bytes"_a, "seed"_a = 0,
      "C++ threads hammering malloc/free with content checks (host backend).");
}
