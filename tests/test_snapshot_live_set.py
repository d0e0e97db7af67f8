"""The recorded history behind ``torch.cuda.memory`` snapshots and the live report, on the host
backend (no GPU): snapshot segments come from the allocator's live allocations, not from the
bounded history (a model's weights stay in them, made before recording or not), a snapshot
whose trace lost events says so, N_max counts what was live when recording started, and a user's "record, dump, stop"
leaves VMALLOC_REPORT's own recording alone."""
import subprocess
import sys

import pytest

from _subproc import HOST_REGISTRY, python_env

pytest.importorskip("vmalloc._core")
pytest.importorskip("torch")

# the public torch functions reach the shims; CUDA seen initialised on device 0
SETUP = HOST_REGISTRY + r"""
import pickle, warnings
import torch, torch.cuda.memory as M
from vmalloc.pluggable import live_report as R
from vmalloc.replay import from_snapshot
MiB = 1 << 20
a = core._torch_allocator(0, True)
ta.install_shims(torch)
M.is_initialized = lambda: True
M._get_device_index = lambda d, optional=False: 0 if d is None else int(getattr(d, "index", d) or 0)
"""


def run(script: str, tmp_path) -> str:
    r = subprocess.run([sys.executable, "-c", SETUP + script], capture_output=True, text=True,
                       timeout=120, env=python_env(), cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
    return r.stderr


def test_snapshot_keeps_live_allocations_whose_events_the_ring_dropped(tmp_path):
    run(r"""
M._record_memory_history(max_entries=1000)
ta.set_trace_capacity(50)
weights = [a.malloc(4 * MiB, 0) for _ in range(4)]    # long-lived: 16 MiB
for step in range(40):                                  # 240 events: the ring keeps 50
    ta.drain_history()                                  # (a report, a snapshot, ...)
    acts = [a.malloc(MiB, 0) for _ in range(3)]
    for p in acts:
        a.free(p)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    snap = M._snapshot()
segs = snap["segments"]
assert sorted(s["address"] for s in segs) == sorted(weights), segs
assert sum(s["requested_size"] for s in segs) == 16 * MiB
# the trace itself lost events: said, with nothing missing from the segments
inc = snap["vmalloc_incomplete"]
assert inc[0]["events_dropped"] > 0, inc
assert any("trace events were dropped" in str(x.message) for x in w), [str(x.message) for x in w]
assert from_snapshot(snap).peak_requested() == 19 * MiB     # the weights count in a replay
print("OK")
""", tmp_path)


def test_snapshot_drops_a_live_entry_whose_free_event_was_dropped(tmp_path):
    run(r"""
M._record_memory_history(max_entries=1000)
ta.set_trace_capacity(10)
p = a.malloc(2 * MiB, 0)
keep = a.malloc(3 * MiB, 0)
ta.drain_history()            # both seen live
a.free(p)                     # its free event falls out of the native ring below
for _ in range(20):
    a.free(a.malloc(4096, 0))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    segs = torch.cuda.memory_snapshot()
assert [s["address"] for s in segs] == [keep], segs
print("OK")
""", tmp_path)


def test_snapshot_lists_allocations_made_before_the_recording(tmp_path):
    """PyTorch's "record, dump, stop" starts after the model is built: its weights are live
    before the history begins, and a snapshot (and its replay) still has them (the allocator
    lists its live set: ``Allocator.live_allocations``)."""
    run(r"""
old = a.malloc(5 * MiB, 0)                       # before anyone records
M._record_memory_history(max_entries=1000)
new = a.malloc(MiB, 0)
M._dump_snapshot("s.pickle")
snap = pickle.load(open("s.pickle", "rb"))
assert sorted(s["address"] for s in snap["segments"]) == sorted([old, new]), snap["segments"]
assert "vmalloc_incomplete" not in snap, snap
assert from_snapshot(snap).peak_requested() == 6 * MiB
print("OK")
""", tmp_path)


def test_a_replay_of_a_snapshot_whose_events_were_dropped_says_so(tmp_path):
    run(r"""
M._record_memory_history(max_entries=1000)
ta.set_trace_capacity(10)
for _ in range(30):
    a.free(a.malloc(4096, 0))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    snap = M._snapshot()
    t = from_snapshot(snap, name="s.pickle")
assert snap["vmalloc_incomplete"][0]["events_dropped"] > 0, snap["vmalloc_incomplete"]
assert t.meta["incomplete"] == snap["vmalloc_incomplete"]
assert any("s.pickle: incomplete" in str(x.message) for x in w), [str(x.message) for x in w]
print("OK")
""", tmp_path)


def test_complete_snapshot_has_no_incomplete_key(tmp_path):
    stderr = run(r"""
M._record_memory_history(max_entries=1000)
p = a.malloc(MiB, 0)
snap = M._snapshot()
assert "vmalloc_incomplete" not in snap and len(snap["segments"]) == 1, snap
print("OK")
""", tmp_path)
    assert "incomplete" not in stderr, stderr


def test_n_max_counts_allocations_live_when_recording_started(tmp_path):
    run(r"""
old = [a.malloc(100 << 10, 0) for _ in range(8)]     # live before recording starts
M._record_memory_history(max_entries=1000)
for p in old[:6]:
    a.free(p)
new = [a.malloc(100 << 10, 0) for _ in range(3)]     # 5 live now
fr = R.collect(0)["fragmentation"]
assert fr["n_max"] == 8 and fr["bound_eq2"] == 8 * (64 << 10), fr
assert fr["internal_current"] < fr["bound_eq2"]
print("OK")
""", tmp_path)


def test_users_record_dump_stop_keeps_the_exit_reports_recording(tmp_path):
    run(r"""
ta.start_recording()          # what VMALLOC_REPORT does at torch import
ps = [a.malloc(n, 0) for n in (100 << 10, 3 << 20, 5000)]
before = R.collect(0)
M._record_memory_history(max_entries=100000)       # the PyTorch docs' record, dump, stop
q = a.malloc(MiB, 0)
snap = M._snapshot()
assert [e["size"] for e in snap["device_traces"][0]] == [MiB]    # the user's window only
assert len(snap["segments"]) == 4 and "vmalloc_incomplete" not in snap
M._record_memory_history(max_entries=100000, clear_history=True)
assert M._snapshot()["device_traces"] == [[]]
M._record_memory_history(enabled=None)
a.free(q)
after = R.collect(0)
assert ta.registry().recording
for key in ("histogram", "history"):
    assert key in before and key in after, (key, before.keys(), after.keys())
assert [b["count"] for b in after["histogram"]] == [1, 1, 1, 1], after["histogram"]
assert before["fragmentation"]["n_max"] == 3 and after["fragmentation"]["n_max"] == 4
assert after["history"]["events_kept"] == 5
assert M._snapshot()["device_traces"] == [[]]      # stopped: the user's trace is empty
print("OK")
""", tmp_path)


def test_users_stop_ends_the_recording_when_only_they_recorded(tmp_path):
    run(r"""
M._record_memory_history(max_entries=1000)
p = a.malloc(MiB, 0)
M._record_memory_history(enabled=None)
reg = ta.registry()
assert not reg.recording and not reg.recorders and not reg.history.get(0)
assert "history" not in R.collect(0)
print("OK")
""", tmp_path)
