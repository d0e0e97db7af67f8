"""Exceptions of the allocator."""


class OutOfMemoryError(MemoryError):
    """A request that would take physical memory past the allocator's budget.

    The allocator stays usable: free something (or raise the budget) and try again.
    """

    def __init__(self, message: str, requested: int = 0, in_use: int = 0, budget: int = 0):
        super().__init__(message)
        self.requested = requested
        self.in_use = in_use
        self.budget = budget


class DriverShutDownError(RuntimeError):
    """The CUDA driver is shutting down (``CUDA_ERROR_DEINITIALIZED``): the process is exiting and
    the CUDA runtime has been torn down, so no device memory can be allocated or used any more.

    Raised by ``malloc``, ``trim``, ``record_stream`` and constructing an allocator; ``free`` and
    ``close`` stay quiet then (the driver takes the memory with it).
    """
