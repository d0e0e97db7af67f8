"""Solve time of the checkpointing DP (rotor) vs chain length L and memory slots.

Goals (issue 4): a ResNet-1001 chain (L ~ 339) at slots=500 in <= 2 s on one core; any
L <= 100 in <= 0.1 s. Seed 002 reports < 20 s for ResNet-1001. Times are CPU seconds of one
solve (the best of a few runs: the machine is shared), at several memory limits between the
least feasible memory and the store-everything peak; the table shows the slowest limit.

    python bench/planners_time.py [--quick] [--out DIR]

Writes bench/results/planners_time.json.
"""
from __future__ import annotations

import time

from common import parse_args, print_table, run_meta, say_nothing_written, write_json

from scheduler import Chain, simulate
from scheduler.chain import FIELDS
from scheduler.planners import periodic, revolve, rotor

FRACTIONS = (0.02, 0.1, 0.3, 0.6, 1.0)   # of the way from the least memory to store-all


def byte_chain(L: int, seed: int) -> Chain:
    """A random chain with MiB-scale sizes and millisecond times (sizes far above any slot)."""
    c = Chain.random(L, seed=seed, max_size=100)
    return c.replace(**{f: [v << 20 for v in getattr(c, f)] for f in FIELDS[2:]},  # the sizes
                     fw=[v / 1e3 for v in c.fw], bw=[v / 1e3 for v in c.bw], name=f"random-L{L}")


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def measure(chain: Chain, slots: int, repeat: int, planner=rotor) -> dict:
    full = simulate(chain, periodic.solve(chain, 1)).peak_memory
    least = planner.min_memory(chain, slots=slots, memory=full / 50)
    times = []
    for f in FRACTIONS:
        m = least + f * (full - least)
        times.append(timed(lambda: planner.solve(chain, m, slots=slots), repeat))
    return {"chain": chain.name, "L": chain.L, "slots": slots, "planner": planner.__name__.split(".")[-1],
            "max_s": max(times), "mean_s": sum(times) / len(times), "per_fraction_s": times}


def main(argv=None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    repeat = 1 if args.quick else 3
    lengths = (10, 50, 100) if args.quick else (10, 25, 50, 100, 200, 339)
    slot_counts = (100, 500) if args.quick else (100, 250, 500, 1000)
    rows = []
    for L in lengths:
        for S in slot_counts:
            rows.append(measure(byte_chain(L, seed=L), S, repeat))
    from chains import load, names   # the bundled zoo (bench/chains)
    zoo = [n for n in ("resnet1001-i224-b1", "resnet1001-i224-b8", "resnet152-i224-b8",
                       "densenet201-i224-b8", "gpt2-s1024-b8") if n in names()]
    if args.quick:
        zoo = zoo[:1]
    for name in zoo:
        rows.append(measure(load(name), 500, repeat))
    if not args.quick:
        rows.append(measure(load("resnet1001-i224-b1"), 500, repeat, planner=revolve))
    cols = ["chain", "planner", "L", "slots", "max_s", "mean_s"]
    print_table(rows, cols, title="checkpointing DP solve time (CPU s, slowest / mean over "
                                   f"{len(FRACTIONS)} memory limits)")
    big = [r["max_s"] for r in rows if r["L"] >= 330 and r["slots"] == 500 and r["planner"] == "rotor"]
    small = [r["max_s"] for r in rows if r["L"] <= 100 and r["slots"] <= 500]
    goals = {"L339_slots500_max_s": max(big) if big else None, "goal_L339_s": 2.0,
             "L100_slots500_max_s": max(small), "goal_L100_s": 0.1}
    print("goals:", goals)
    # the tags every results file carries (machine, torch, date; timed on the CPU)
    meta = run_meta("python bench/planners_time.py" + (" --quick" if args.quick else ""), "cpu")
    out = {"meta": meta, "rows": rows, "goals": goals, "fractions": FRACTIONS, "quick": args.quick,
           "note": "CPU seconds (time.process_time), best of %d runs, shared 2-core machine" % repeat}
    if args.out is None:
        say_nothing_written()
    else:
        print("wrote", write_json("planners_time", out, args.out))
    return out


if __name__ == "__main__":
    main()
