#include <nanobind/nanobind.h>
namespace nb = nanobind;
void bind_rotor(nb::module_& m) { (void)m; }  // filled in by its issue
