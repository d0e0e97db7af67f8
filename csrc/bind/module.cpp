// The one extension module, vmalloc._core. Each part of csrc binds itself in its own file.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void bind_alloc(nb::module_& m);    // csrc/bind/alloc_py.cpp: Allocator, stats, backends
void bind_rotor(nb::module_& m);    // csrc/bind/rotor_py.cpp: checkpointing DP (seed 002)
void bind_offload(nb::module_& m);  // csrc/bind/offload_py.cpp: offloading DYNPROG (seed 000)
void bind_pofo(nb::module_& m);     // csrc/bind/pofo_py.cpp: combined DP (seed 001)
void bind_torch(nb::module_& m);    // csrc/bind/torch_c_api.cpp: PyTorch entry points + device registry

NB_MODULE(_core, m) {
  m.doc() = "vmalloc native core: chunked VMM allocator and the planners' dynamic programs";
  bind_alloc(m);
  bind_rotor(m);
  bind_offload(m);
  bind_pofo(m);
  bind_torch(m);
}
