"""``eager_hook``: a saved-tensor hook that always runs eagerly (as torch.compiler.disable runs
it), paying for that only while Dynamo's frame callback is set; and ``BlockCall``'s fast path
for calls of tensors only, which must bind as the pytree path does."""
from __future__ import annotations

import operator

import pytest
import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback

from scheduler.runtime import not_compiled
from scheduler.runtime.block_calls import BlockCall
from scheduler.runtime.not_compiled import eager_hook


def _recording():
    calls = []

    def fn(t):
        calls.append((get_eval_frame_callback() is None, type(t).__name__))
        return t * 1
    return fn, calls


def _count_disabled_runs(monkeypatch):
    """torch.compiler.disable whose disabled functions count their calls (in the list)."""
    runs = []
    real = torch.compiler.disable

    def counting_disable(f, *a, **kw):
        wrapped = real(f, *a, **kw)

        def run(*args):
            runs.append(1)
            return wrapped(*args)
        return run
    monkeypatch.setattr(torch.compiler, "disable", counting_disable)
    return runs


def test_without_compiled_code_the_hook_runs_fn_itself(monkeypatch):
    fn, calls = _recording()
    disabled = _count_disabled_runs(monkeypatch)
    hook = eager_hook(fn)
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(hook, hook):
        (x.sin() * x).sum().backward()
    assert calls and all(off for off, _ in calls)
    assert disabled == []   # fn ran directly: no wrapper where no callback is set


def test_called_from_compiled_code_the_hook_runs_eagerly_every_time():
    """A compiled function that calls the hook itself: Dynamo breaks the graph there (the hook
    is marked disabled) and runs it eagerly at each call, with no callback set inside fn, and
    fn's own op never reaches the backend's graphs."""
    torch._dynamo.reset()
    fn, calls = _recording()
    hook = eager_hook(fn)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes])
        return gm

    @torch.compile(backend=backend)
    def f(x):
        return hook(x.cos()) + 1

    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(f(x), x.cos() + 1)
    assert len(calls) == 3 and all(off and kind == "Tensor" for off, kind in calls)
    assert graphs and not any(operator.mul in g for g in graphs)


def test_with_a_callback_set_the_hook_takes_the_disabled_path(monkeypatch):
    """Where Dynamo's callback is set (compiled code running), fn runs through the disabled
    wrapper, which unsets it: fn never sees it."""
    api = not_compiled._frame_api()
    if api is None:
        pytest.skip("this torch lacks the private frame API: eager_hook is plain disable")
    skip_code = api[1]
    state = {"set": True}
    monkeypatch.setattr(not_compiled, "_frame_api",
                        lambda: ((lambda: object() if state["set"] else None), skip_code))
    fn, calls = _recording()
    ran_disabled = _count_disabled_runs(monkeypatch)
    hook = eager_hook(fn)
    hook(torch.ones(2))
    state["set"] = False
    hook(torch.ones(2))
    assert ran_disabled == [1] and len(calls) == 2


@pytest.mark.parametrize("prev", [False, True])
def test_block_call_fast_path_binds_as_the_pytree_path(prev):
    a, b = torch.randn(2), torch.randn(3)
    out = (a,) if prev else None
    fast = BlockCall((a, b), {}, out)
    slow = BlockCall((a, b), {"flag": None}, out)   # a keyword: the pytree path
    assert fast.spec is None and slow.spec is not None
    assert fast.slots == slow.slots and fast.anchored == slow.anchored
    assert all(u is v for u, v in zip(fast.x, slow.x))
    y = tuple(torch.zeros_like(t) for t in fast.x)
    args_fast, kw_fast = fast.bind(y)
    args_slow, kw_slow = slow.bind(y)
    assert kw_fast == {} and kw_slow == {"flag": None}
    assert len(args_fast) == len(args_slow) == 2
    assert all(u is v for u, v in zip(args_fast, args_slow))
