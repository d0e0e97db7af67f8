"""bandwidth._probe's stream ordering, on the CPU with a fake torch.cuda that logs each device
allocation (with the stream current then), each copy (with the stream it runs on) and each
wait. The probe can run mid-step (a planner's first plan, inside autograd's final callback)
with kernels still queued on the current stream: its copies must not land in memory those
kernels may still read."""
import contextlib

import torch

from scheduler.runtime import bandwidth


def test_probe_copies_only_into_its_own_streams_memory_after_waiting(monkeypatch):
    log, cur = [], ["default"]

    class FakeStream:
        n = 0

        def __init__(self, *a, **k):
            FakeStream.n += 1
            self.name = f"side{FakeStream.n}"

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    class FakeEvent:
        def __init__(self, **k):
            pass

        def record(self, s=None):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, o):
            return 1.0

    @contextlib.contextmanager
    def stream_ctx(s):
        prev, cur[0] = cur[0], s.name
        try:
            yield
        finally:
            cur[0] = prev

    alloc_stream = {}
    real_empty, real_copy = torch.empty, torch.Tensor.copy_

    def empty(*a, device=None, pin_memory=False, **k):
        t = real_empty(*a, **k)
        if device is not None and "cuda" in str(device):
            alloc_stream[id(t)] = cur[0]
            log.append(("alloc", id(t), cur[0]))
        return t

    def copy_(self, src, non_blocking=False):
        log.append(("write", id(self), cur[0]))
        return real_copy(self, src)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
    monkeypatch.setattr(torch.cuda, "device", lambda i: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a: type("S", (), {"name": cur[0]})())
    monkeypatch.setattr(bandwidth, "PROBE_BYTES", 1024)
    assert bandwidth._probe(0) > 0
    writes = [(i, t, s) for i, (k, t, s) in enumerate(log) if k == "write" and t in alloc_stream]
    assert writes, log
    # every write into device memory from another stream than the one it was allocated on
    # comes after that stream waited for the allocating one (whose queued kernels may still
    # read the block)
    for i, t, s in writes:
        a = alloc_stream[t]
        assert s == a or ("wait", s, a) in log[:i], (i, log)
