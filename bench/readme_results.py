"""Write README.md's "Results" block from the benchmark JSON files in bench/results/.

    python bench/readme_results.py            # rewrite the block between the markers
    python bench/readme_results.py --check    # exit 1 (naming the stale parts) if it is out of date

Every number in the block comes from a results file; nothing is typed by hand. One subsection
per benchmark: what was measured where (CPU, GPU, or simulated), a compact table of the numbers
the issues set goals for, the figure beside the JSON when there is one, and the command that
reproduces it. A missing results file gives a one-line note. The output depends only on the
files (fixed float formats, sorted keys), so running it again without new results changes
nothing. Only the standard library: it runs in CI before anything is built.

This module assembles the block (the section order below, the goals table), splices it into the
README and checks it; the sections are rendered by bench/readme_allocator.py,
readme_planners.py, readme_runtime.py and readme_gpu_sessions.py, with the number formats,
tables and shared context in bench/readme_format.py.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
SELF = "python bench/readme_results.py"

if __name__ == "__main__":  # run as a script (bench/ is first on sys.path)
    import checkout
    checkout.on_path()

from bench.readme_allocator import alloc_micro, cache_slack, fragmentation, traces_gpu  # noqa: E402
from bench.readme_format import (Ctx, Goal, g, met, meta_line, num, pct, rate,  # noqa: E402
                                 reproduce, size, table)
from bench.readme_gpu_sessions import gpu_progress, gpu_tests  # noqa: E402
from bench.readme_planners import (checkpointing, new_shape_plan, offloading, planners_time,  # noqa: E402
                                   pofo, pofo_random)
from bench.readme_runtime import (E2E_GPU_GOALS, checkpoint_real, e2e,  # noqa: E402
                                  e2e_gpu_goal_pending, hf, hook_overhead, mimose, swap)

# what this module answers for: its own names and, re-exported, the helpers and renderers that
# lived here before the split (tests call rr.num, rr.size, ...)
__all__ = [
    "HERE", "ROOT", "RESULTS", "README", "BEGIN", "END", "SELF", "Section", "SECTIONS",
    "render", "splice", "stale", "main",
    "Goal", "Ctx", "num", "rate", "size", "pct", "g", "met", "table", "reproduce", "meta_line",
    "alloc_micro", "cache_slack", "fragmentation", "traces_gpu", "gpu_progress", "gpu_tests",
    "planners_time", "checkpointing", "offloading", "pofo", "pofo_random", "new_shape_plan",
    "swap", "hook_overhead", "mimose", "checkpoint_real", "e2e", "hf",
]


# ------------------------------------------------------------------------------ assembly
Section = Tuple[str, str, str, Callable[..., List[str]]]   # (file or glob, title, command, renderer)
SECTIONS: List[Section] = [
    ("gpu-progress.json", "GPU sessions: what has run on a GPU (issue 12)",
     "scripts/gpu-check --next OUT", gpu_progress),
    ("gpu-tests.json", "GPU tests", "scripts/gpu-check --next OUT", gpu_tests),
    ("traces-gpu.json", "Real allocation traces: the caching model vs PyTorch on the GPU",
     "python bench/traces/record_gpu.py", traces_gpu),
    ("e2e-*.json", "End to end: training under a budget", "python bench/e2e.py", e2e),
    ("alloc_micro.json", "Allocator fast path", "python bench/alloc_micro.py", alloc_micro),
    ("cache_slack.json", "cache_slack's default: remap time vs memory (issue 12)",
     "python bench/cache_slack.py", cache_slack),
    ("fragmentation.json", "Fragmentation: vmalloc vs PyTorch's caching allocator",
     "python bench/fragmentation.py", fragmentation),
    ("planners_time.json", "Planner solve time", "python bench/planners_time.py", planners_time),
    ("checkpointing.json", "Checkpointing: rotor vs periodic (seed 002 Figs. 3-5)",
     "python bench/checkpointing.py", checkpointing),
    ("offloading.json", "Offloading: GREEDY, DYNPROG, VDNN vs the lower bound (seed 000 Fig. 4)",
     "python bench/offloading.py", offloading),
    ("pofo.json", "pofo vs rotor, offload-only, GREEDY, autocapper, opportunist (seed 001 Figs. 2-3)",
     "python bench/pofo.py", pofo),
    ("pofo_random.json", "pofo on random chains: simulated time vs its DP value (issue 14)",
     "python bench/pofo.py --random", pofo_random),
    ("swap.json", "Swap runtime overhead", "python bench/swap.py", swap),
    ("hook_overhead.json", "The runtimes' hooks: cost per saved tensor",
     "python bench/hook_overhead.py", hook_overhead),
    ("mimose.json", "Mimose: dynamic input sizes", "python bench/mimose.py", mimose),
    ("new_shape_plan.json", "Input-aware rotor: planning a new shape",
     "python bench/new_shape_plan.py", new_shape_plan),
    ("checkpoint_real-*.json", "Checkpointing real models", "python bench/checkpoint_real.py",
     checkpoint_real),
    ("hf-*.json", "Hugging Face models: plain, HF checkpointing, rotor/pofo/mimose",
     "python bench/hf.py", hf),
]


def _files(results: str, pattern: str) -> List[str]:
    if "*" not in pattern:
        return [pattern] if os.path.exists(os.path.join(results, pattern)) else []
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(results, pattern)))


def _docs(ctx: Ctx, pattern: str) -> List[Dict[str, Any]]:
    """The results files matching `pattern` that parse as JSON objects (the others' sections
    say they could not be read)."""
    out = []
    for n in _files(ctx.results, pattern):
        try:
            d = ctx.load(n)
        except ValueError:
            continue
        if isinstance(d, dict):
            out.append(d)
    return out


def _ran_on_gpu(ctx: Ctx, pattern: str, key: str) -> bool:
    """Whether any results file matching `pattern` records a device other than the CPU."""
    return any(isinstance(d.get("meta"), dict) and d["meta"].get(key, "cpu") != "cpu"
               for d in _docs(ctx, pattern))


def render(results: str = RESULTS, readme_dir: str = ROOT) -> str:
    """The whole generated block (without the markers)."""
    ctx = Ctx(results, readme_dir)
    body: List[str] = []
    for pattern, title, command, fn in SECTIONS:
        names = _files(results, pattern)
        if not names:
            body += [f"### {title}", "",
                     f"No results file (`{ctx.rel(pattern)}`): run `{command}`.", ""]
            continue
        for name in names:
            head = f"### {title}" + (f" ({name})" if "*" in pattern else "")
            try:
                data = ctx.load(name)
                lines = (fn(ctx, data, name) if "*" in pattern else fn(ctx, data))
            except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
                # (AttributeError: a JSON null where an object was expected, "meta": null)
                lines = [f"Could not read {ctx.source(name)}: unexpected structure "
                         f"({type(exc).__name__}: {exc}); bench/readme_results.py needs updating."]
            body += [head, "", f"From {ctx.source(name)}."]
            body += [ln for i, ln in enumerate(lines) if ln or (i and lines[i - 1])]  # no empty meta
            body.append("")
    # goals only a lent GPU can answer: say they were not run rather than leave them out
    # (until a full GPU grid with ResNet-50 rows is there: e2e's goals come from that file)
    pending = e2e_gpu_goal_pending(_docs(ctx, "e2e-*.json"))
    if pending:
        ctx.goal("e2e (GPU)", ", ".join(E2E_GPU_GOALS), pending, None)
    if not _ran_on_gpu(ctx, "checkpoint_real-*.json", "device"):
        ctx.goal("checkpoint_real (GPU)", "rotor beats the best periodic at equal peak; pofo beats "
                 "rotor where transfers hide", "not run: no GPU results (no GPU lent)", None)
    glance = ["### Goals at a glance", "",
              "Each issue's goal next to what its benchmark recorded (details below).", ""]
    glance += table(["benchmark", "goal", "measured", "met"], ctx.goals) if ctx.goals else ["(none)"]
    lines = [f"<!-- generated by `{SELF}` from bench/results/*.json: edit the script, "
             "not this block -->", ""] + glance + [""] + body
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def splice(readme_text: str, block: str) -> str:
    """`readme_text` with everything between the markers replaced by `block`."""
    i, j = readme_text.find(BEGIN), readme_text.find(END)
    if i < 0 or j < 0 or j < i:
        raise SystemExit(f"README has no '{BEGIN}' ... '{END}' block")
    return readme_text[:i + len(BEGIN)] + "\n" + block + readme_text[j:]


def _sections(text: str) -> Dict[str, str]:
    """The generated block of `text` split by '### ' headings (for naming what is stale)."""
    i, j = text.find(BEGIN), text.find(END)
    inner = text[i + len(BEGIN):j] if 0 <= i < j else ""
    out: Dict[str, str] = {}
    key = "(preamble)"
    for line in inner.splitlines():
        if line.startswith("### "):
            key = line[4:]
        out[key] = out.get(key, "") + line + "\n"
    return out


def stale(readme_text: str, block: str) -> List[str]:
    """Headings whose generated text differs between the README and `block` (empty: up to date)."""
    want = splice(readme_text, block)
    if want == readme_text:
        return []
    have, new = _sections(readme_text), _sections(want)
    return sorted(k for k in set(have) | set(new) if have.get(k) != new.get(k)) or ["(block)"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="do not write: exit 1 if the README block is out of date")
    ap.add_argument("--results", default=RESULTS, metavar="DIR",
                    help="results folder (default bench/results)")
    ap.add_argument("--readme", default=README, metavar="FILE",
                    help="README to update (default README.md)")
    args = ap.parse_args(argv)
    # a typo in a path must not rewrite README's results with "missing" notes
    if not os.path.isdir(args.results):
        ap.error(f"--results {args.results!r}: no such directory")
    if not any(n.endswith(".json") for n in os.listdir(args.results)):
        ap.error(f"--results {args.results!r}: no results files (*.json) there")
    if not os.path.isfile(args.readme):
        ap.error(f"--readme {args.readme!r}: no such file")
    with open(args.readme) as f:
        text = f.read()
    block = render(args.results, os.path.dirname(os.path.abspath(args.readme)))
    diff = stale(text, block)
    if args.check:
        if diff:
            print(f"{args.readme}: the results block is out of date with {args.results} in: "
                  + "; ".join(diff) + f". Run `{SELF}` and commit README.md.", file=sys.stderr)
            return 1
        print(f"{args.readme}: results block up to date")
        return 0
    if diff:
        with open(args.readme, "w") as f:
            f.write(splice(text, block))
        print(f"updated {args.readme}: " + "; ".join(diff))
    else:
        print(f"{args.readme}: results block already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
