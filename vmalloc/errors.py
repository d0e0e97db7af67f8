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
