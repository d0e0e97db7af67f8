#include "driver/driver.hpp"

namespace vmalloc {
namespace driver {

std::unique_ptr<Driver> make_driver(const std::string& backend, int device) {
  if (backend == "host") return make_host_driver();
  if (backend == "host-lazy") return make_host_driver(false);
  if (backend == "cuda") return make_cuda_driver(device);
  throw std::invalid_argument("backend: unknown backend '" + backend +
                              "' (expected 'host', 'host-lazy' or 'cuda')");
}

void Driver::inject_fault(const std::string&, uint64_t, int, uint64_t) {
  throw std::invalid_argument(std::string("backend: fault injection is a test hook of the host backend, not of '") +
                              name() + "'");
}

}  // namespace driver
}  // namespace vmalloc
