// Best-effort calls: close(), the destructor and rollbacks after a failure try each driver call on
// its own and go on whatever happens (the driver may already be shutting down).
#pragma once

namespace vmalloc {

// Calls f and swallows whatever it throws; true when f returned.
template <class F>
bool quiet(F&& f) noexcept {
  try {
    f();
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace vmalloc
