"""Make the bundled allocation traces: simulated swap schedules on the bundled chains.

No GPU was available, so these are not recordings of real training: each trace is the
allocation trace of ``scheduler.simulate`` (the project's event simulator) running a byte-window
swap schedule (seed 003 section 3, whole activations as the variables) on a chain from
``bench/chains`` (sizes from the meta-device profile of the model zoo), repeated for a few
training iterations. Each trace's ``meta`` says exactly how it was derived. Re-run after real
GPU traces or the window planner (issue 6) exist:

    python bench/traces/make_traces.py            # writes bench/traces/*.json.gz
    python bench/traces/make_traces.py --out DIR  # ... into DIR instead

The swap plan (built here, simulated by the shared simulator): forward with ``F_all`` on every
stage; once stage s has run, the activation stored as its input is offloaded, except the last
ones whose bytes fit in the window; the backward prefetches offloaded activations in reverse,
looking ahead until the prefetched bytes reach the window (the byte-window rule of seed 003
Fig. 2 applied to whole activations).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if __name__ == "__main__":  # run as a script: bench/checkout.py says where the packages are
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import checkout
    checkout.on_path()

from scheduler import Chain, Plan, simulate  # noqa: E402  (the repository's own scheduler)

from vmalloc.replay.trace import Event, Trace  # noqa: E402

BANDWIDTH = 12e9   # bytes/s host<->device (PCIe 4 x16, effective)


def swap_plan(chain: Chain, window: float) -> Plan:
    """Forward F_all everywhere with offloads behind it; backward with byte-window prefetches."""
    L = chain.L
    ops: List[tuple] = []
    # the input of stage s is held in xbar[s-1] (s >= 1); keep the last `window` bytes resident
    keep, kept = set(), 0.0
    for s in range(L, 0, -1):
        if kept + chain.xbar[s - 1] > window:
            break
        keep.add(s)
        kept += chain.xbar[s - 1]
    offloaded = []
    for s in range(L + 1):
        ops.append(("F_all", s))
        if 1 <= s < L and s not in keep:
            ops.append(("offload", s))
            offloaded.append(s)
    pending = sorted(offloaded, reverse=True)   # prefetch order: deepest first
    issued = set()

    def prefetch_until(stage: int) -> None:
        # issue prefetches for everything B `stage` needs, then look ahead within the window
        ahead = 0.0
        for s in list(pending):
            must = s >= stage          # B stage needs xbar[stage] (= input of stage+1) and its input
            if not must and ahead + chain.xbar[s - 1] > window:
                break
            ops.append(("prefetch", s))
            issued.add(s)
            pending.remove(s)
            if not must:
                ahead += chain.xbar[s - 1]

    for s in range(L, -1, -1):
        prefetch_until(s)
        ops.append(("B", s))
    return Plan(ops, planner=f"byte-window swap (window {window / 2**20:.0f} MiB)")


def iterations(chain: Chain, plan: Plan, n: int, memory: float,
               scales: Sequence[float] = ()) -> List[Event]:
    """The simulator's trace for ``n`` iterations; what is still live at an iteration's end
    (the input and delta[0]) is freed there. ``scales[i]`` multiplies iteration i's sizes
    (a batch-size change: activation sizes are linear in the batch)."""
    events: List[Event] = []
    next_id, t0 = 0, 0.0
    for it in range(n):
        scale = scales[it] if scales else 1.0
        c = chain if scale == 1.0 else _scaled(chain, scale)
        # the simulator holds compute back until the swap keeps memory under the limit
        res = simulate(c, plan, bandwidth=BANDWIDTH, memory=memory * scale)
        tr = res.alloc_trace
        ids: Dict[int, int] = {}
        live: Dict[int, int] = {}
        t_end = t0
        for e in tr["events"]:
            if e["action"] == "alloc":
                ids[e["id"]] = next_id
                live[next_id] = e["size"]
                next_id += 1
            new_id = ids[e["id"]]
            if e["action"] == "free":
                live.pop(new_id)
            t_end = t0 + e["time"]
            events.append(Event(e["action"], new_id, int(e["size"]), int(e["stream"]), round(t_end, 9)))
        for i, size in live.items():
            events.append(Event("free", i, size, 0, round(t_end, 9)))
        t0 = t_end
    return events


def smallest_limit(chain: Chain, plan: Plan) -> float:
    """The smallest memory limit (in 5% steps of the activation bytes) the plan runs under."""
    from scheduler import InvalidPlanError
    total = sum(chain.xbar)
    for pct in range(30, 101, 5):
        try:
            simulate(chain, plan, bandwidth=BANDWIDTH, memory=total * pct / 100)
            return total * pct / 100
        except InvalidPlanError:
            continue
    return total * 2


def _scaled(chain: Chain, k: float) -> Chain:
    d = json.loads(chain.to_json())
    for key in ("x", "xbar", "delta", "fw_tmp", "bw_tmp"):
        d[key] = [float(round(v * k)) for v in d[key]]
    for key in ("fw", "bw"):
        d[key] = [v * k for v in d[key]]
    return Chain.from_json(json.dumps(d))


def _load_chain(name: str) -> Chain:
    with open(os.path.join(ROOT, "bench", "chains", f"{name}.json")) as f:
        return Chain.from_json(f.read())


SPECS: List[Dict[str, Any]] = [
    {"name": "resnet50-b32-swap", "chain": "resnet50-i224-b32", "window_frac": 0.25, "iters": 3},
    {"name": "gpt2-s1024-b1-swap", "chain": "gpt2-s1024-b1", "window_frac": 0.25, "iters": 3},
    {"name": "resnet101-i1000-b2-swap", "chain": "resnet101-i1000-b2", "window_frac": 0.2, "iters": 3},
    # batches that grow (24, 26, 28, 30, 32 images): each iteration's activations are a little
    # larger than any seen before, the case that strands a caching allocator's segments
    {"name": "resnet50-dynbatch-swap", "chain": "resnet50-i224-b32", "window_frac": 0.25,
     "iters": 5, "scales": [24 / 32, 26 / 32, 28 / 32, 30 / 32, 1.0]},
]


def make(spec: Dict[str, Any], out_dir: str = HERE) -> str:
    chain = _load_chain(spec["chain"])
    window = spec["window_frac"] * sum(chain.xbar)
    plan = swap_plan(chain, window)
    memory = smallest_limit(chain, plan)
    events = iterations(chain, plan, spec["iters"], memory, spec.get("scales", ()))
    meta = {
        "name": spec["name"],
        "source": "simulated (no GPU): scheduler.simulate on a byte-window swap plan",
        "derived_from": f"bench/chains/{spec['chain']}.json, swap window "
                        f"{spec['window_frac']:.0%} of activation bytes, {spec['iters']} iterations"
                        + (f", batch scales {spec['scales']}" if spec.get("scales") else "")
                        + f", simulated under a {memory / 2**20:.0f} MiB memory limit",
        "generator": "bench/traces/make_traces.py",
        "planner": plan.planner, "bandwidth": BANDWIDTH, "units": "bytes, seconds",
        "streams": "0 = compute, 1 = transfer channel (prefetch buffers)",
        "real_gpu_trace": False,
    }
    trace = Trace(events, meta)
    path = os.path.join(out_dir, f"{spec['name']}.json.gz")
    trace.save(path)
    return path


def main(argv: Sequence[str] = None) -> None:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=HERE, metavar="DIR",
                   help="folder for the *.json.gz traces (default bench/traces)")
    args = p.parse_args(argv)   # --help (or a typo) no longer rewrites the bundled traces
    os.makedirs(args.out, exist_ok=True)
    for spec in SPECS:
        path = make(spec, args.out)
        from vmalloc.replay import load
        t = load(path)
        print(f"{path}: {len(t)} events, peak requested {t.peak_requested() / 2**20:.0f} MiB, "
              f"N_max {t.max_live()}")


if __name__ == "__main__":
    main()
