// CUDAAllocator::cacheInfo for vmalloc's CUDAPluggableAllocator (cuDNN's autotuner asks it).
#pragma once

#include <cstddef>
#include <string>

namespace vmalloc {

// What cacheInfo answers for a device: the largest block an allocation could get now.
using LargestBlockFn = size_t (*)(int device) noexcept;

// Makes PyTorch's current CUDA allocator (which must be a plain CUDAPluggableAllocator, the one
// vmalloc.enable() installs) answer cacheInfo with `largest`. Returns "" when installed (or
// already), else why not; changes nothing then. See torch_cache_info.cpp.
std::string install_cache_info(LargestBlockFn largest);

}  // namespace vmalloc
