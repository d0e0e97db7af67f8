#include <nanobind/nanobind.h>
namespace nb = nanobind;
void bind_pofo(nb::module_& m) { (void)m; }  // filled in by its issue
