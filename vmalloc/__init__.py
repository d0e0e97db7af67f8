"""vmalloc: a chunked virtual-addressing GPU allocator for PyTorch training.

Physical memory comes in fixed-size chunks mapped through the CUDA driver's VMM API into
contiguous virtual ranges (seed 003, section 4). ``VMALLOC=1`` turns it on with no code
change; see the README for every knob.
"""
from .allocator import Allocator
from .errors import DriverShutDownError, OutOfMemoryError
from .report import add_section as add_report_section
from .report import report
from .sizes import format_size, parse_size
from .torch_allocator import enable, is_enabled, pool, stats

# `vmalloc.report` is the function (DESIGN.md); let `vmalloc.report.add_section(...)` work too
report.add_section = add_report_section  # type: ignore[attr-defined]

__all__ = ["Allocator", "DriverShutDownError", "OutOfMemoryError", "add_report_section", "enable",
           "format_size", "is_enabled", "parse_size", "pool", "report", "stats"]
__version__ = "0.1.0"
