"""vmalloc as PyTorch's pluggable CUDA allocator, split by job:

* :mod:`.registry` - the per-device registry (Python side of ``csrc/bind/torch_c_api.cpp``),
  ``stats()``, ``device_allocator()``;
* :mod:`.register` - ``enable()`` (process-wide) and ``pool()`` (scoped, ``torch.cuda.MemPool``);
* :mod:`.shims` - PyTorch's memory API answered by vmalloc while it is the allocator;
* :mod:`.history` - the recorded allocation history as PyTorch memory snapshots;
* :mod:`.live_report` - the live report: ``vmalloc.report()``, its sections, the exit report.

``vmalloc.torch_allocator`` re-exports the public names. No torch import at module level:
``import vmalloc`` stays cheap and works without torch.
"""
