// Raising PyTorch's own out-of-memory exception (see torch_oom.cpp for how).
#pragma once

#include <string>

namespace vmalloc {

// kAuto: the exported constructor, else the vtable route, else std::runtime_error. The others
// force one route (tests), falling back to std::runtime_error when it is unavailable.
enum class OomPath { kAuto = 0, kConstructor = 1, kVtable = 2 };

// Throws c10::OutOfMemoryError(msg) when torch's libraries are loaded, else std::runtime_error.
[[noreturn]] void throw_torch_oom(const std::string& msg, OomPath path = OomPath::kAuto);

// What throw_torch_oom(path) throws now: "c10::OutOfMemoryError (constructor)",
// "c10::OutOfMemoryError (vtable)" or "std::runtime_error".
const char* torch_oom_kind(OomPath path);

}  // namespace vmalloc
