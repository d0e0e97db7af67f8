"""The op tracer (and every ``EagerDispatchMode``) leaves torch.compile'd code compiled: under a
dispatch mode Dynamo skips a compiled function and marks its code to be skipped for good, so
one measurement left a compiled block eager for the rest of the process."""
from __future__ import annotations

import torch
import torch._dynamo.eval_frame as eval_frame
from torch.utils._python_dispatch import TorchDispatchMode

from scheduler.profile.op_tracer import OpTracer


def _counted():
    runs = [0]

    def backend(gm, example_inputs):
        def run(*args):
            runs[0] += 1
            return gm(*args)
        return run

    def f(x):   # a code object of its own per call: a skip mark on another cannot reach it
        return torch.relu(x) * 2
    return torch.compile(f, backend=backend), runs


def _stance() -> str:
    return eval_frame._stance.stance


def test_a_compiled_function_traced_under_the_op_tracer_stays_compiled():
    torch._dynamo.reset()
    x = torch.randn(4)
    f, runs = _counted()
    f(x)
    with OpTracer() as tracer:
        f(x)   # eagerly, seen by the tracer
    assert tracer.ops and runs[0] == 1
    f(x)
    assert runs[0] == 2
    # the bare dispatch mode is what marked the code (the torch behaviour guarded against)
    g, g_runs = _counted()
    g(x)

    class Bare(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    with Bare():
        g(x)
    g(x)
    assert g_runs[0] == 1, "torch no longer marks the code: eager_mode.py's note is stale"
    torch._dynamo.reset()


def test_the_stance_is_given_back_in_any_order_and_only_if_still_ours():
    assert _stance() == "default"
    a, b = OpTracer(), OpTracer()
    a.__enter__()
    b.__enter__()
    assert _stance() == "force_eager"
    b.__exit__(None, None, None)
    assert _stance() == "force_eager"   # a is still on
    a.__exit__(None, None, None)
    assert _stance() == "default"
    try:   # a stray exit of a mode never entered does not lower the count
        OpTracer().__exit__(None, None, None)
    except IndexError:
        pass
    with OpTracer():
        assert _stance() == "force_eager"
    assert _stance() == "default"
    with OpTracer():   # a stance the program sets meanwhile is the program's
        torch.compiler.set_stance("eager_on_recompile")
    assert _stance() == "eager_on_recompile"
    torch.compiler.set_stance("default")
