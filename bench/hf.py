"""Hugging Face models under a memory budget (issue 13, Benchmark): GPT-2, BERT (masked LM and
sequence classification, the fine-tuning case) and Llama (random weights), step time and
peak activation memory for

- ``plain``: no checkpointing;
- ``hf-ckpt``: the model's own ``gradient_checkpointing_enable()`` (every layer checkpointed,
  no budget; ``use_reentrant=False``, what transformers 5 does by default);
- ``rotor``, ``pofo``, ``mimose`` through ``scheduler.checkpoint(model, budget, planner=...)``
  at several budgets: fractions of plain's peak, HF checkpointing's own peak and 80% of it.

Goal (issue 13): at HF checkpointing's peak, rotor is faster; at HF checkpointing's step time,
rotor holds less memory; rotor reaches budgets below HF checkpointing's peak. Each is read on
measured figures: a rotor row counts "at HF's peak" when its measured peak is at most HF's;
"faster" when its plan runs fewer forwards than HF's and its median step is below HF's least
(a clear win, not timing noise), "at HF's step time" when its least step is at most HF's
median.

Peak memory: everything a step allocates above what was allocated before it (gradients
already allocated): on a GPU ``torch.cuda.max_memory_allocated``, on the CPU the same from
the allocator's events (``torch.profiler``, ``profile_memory=True``); measured in an untimed
step, every method alike. Rows through ``scheduler.checkpoint`` also record
``predicted_peak``, the peak their plan was checked at (the simulator's, on the runner's
chain), to read the measured ``peak`` against. Step time: the least of ``--steps`` steps after two untimed ones
(the first measures the chain and plans; interference only ever adds time, and a median of
five once read HF checkpointing's BERT step at 596 ms where it costs 350), on the CPU the
process's CPU time with one thread (``--threads``) so that a shared machine's load enters
the figures as little as it can.

Configs: on the CPU small ones (6 layers, hidden 128, 4 heads, vocabulary 512, sequence 256,
batch 4); on CUDA GPT-2-small-sized ones, so that the figures measure recomputation rather
than Python and kernel-launch overhead: 12 layers, hidden 768, 12 heads, sequence 1024,
batch 8, each model's own vocabulary (GPT-2 50257, BERT 30522, Llama 32000; BERT's and
bert-cls's FFN 3072, Llama's 2304 with 6 key-value heads). ``--quick`` keeps tiny ones on
either device (2 layers, hidden 64, sequence 32).

    python bench/hf.py [--quick] [--device cpu|cuda] [--models gpt2,bert,bert-cls,llama]
                       [--steps N] [--threads N] [--out DIR] [--resume] [--stop-at EPOCH]

Writes bench/results/hf-<device>.json and .png; the README section comes from
``bench/readme_results.py``. ``--quick`` (CI smoke, seconds) writes nothing unless ``--out``.
The file is written after every model: a model that fails (in its own process, or raising
here) is recorded with its ``error`` (and the process's ``returncode``), the other models'
rows are kept, and the exit status is 1. A method's row that raises is a row with status
``error`` (``oom`` when CUDA runs out of memory).
"""
from __future__ import annotations

import copy
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from common import (parse_args, positive_int, print_table, pyplot, run_meta, save_png,
                    say_nothing_written, torch_device, usage_error, write_json)

import scheduler  # noqa: E402  (common put the checkout on sys.path)

PLANNERS = ("rotor", "pofo", "mimose")
BANDWIDTH = 12e9
FRACTIONS = (0.25, 0.4, 0.6, 0.8)
QUICK_FRACTIONS = (0.4,)
MODELS = "gpt2,bert,bert-cls,llama"
CLASSES = 4  # bert-cls's labels
BELOW_HF = 0.8
# --stop-at: a model's process given this long and still running is recorded as timed out
# (kept), not left for --resume to start over in every later device call
MODEL_TIMEOUT_S = 300
TAIL_OUTPUTS = "watched"   # scheduler/runtime/tail_outputs.py
GOAL = ("at HF checkpointing's peak rotor is faster; at HF checkpointing's step time rotor "
        "holds less memory; rotor reaches budgets below HF checkpointing's peak")


# ------------------------------------------------------------------------------ models
def configs(quick: bool, device: str = "cpu"
            ) -> Dict[str, Tuple[Callable[[], torch.nn.Module], Tuple[int, int]]]:
    """name -> (model factory, (batch, sequence length)), random weights: small configs on
    the CPU, GPT-2-small-sized ones on CUDA (a small model there is launch-bound: its step
    time would be Python overhead, not recomputation), tiny ones with ``quick``.
    The language models' tails (LM head and loss over the vocabulary) hold more than a
    block's input; bert-cls's (pooler, classifier) holds almost nothing."""
    import transformers as T
    gpu = device == "cuda" and not quick
    layers, hidden, heads, seq = (2, 64, 4, 32) if quick else \
        (12, 768, 12, 1024) if gpu else (6, 128, 4, 256)
    batch = 8 if gpu else 4
    vocab = {"gpt2": 50257, "bert": 30522, "llama": 32000} if gpu else \
        {"gpt2": 512, "bert": 512, "llama": 512}
    # use_cache=False: every method trains without the KV cache (checkpointing turns it off;
    # plain training with it on would also hold the cache's copies of keys and values)
    common = dict(attn_implementation="eager", use_cache=False)
    return {
        "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab["gpt2"],
            n_positions=seq, **common)), (batch, seq)),
        "bert": (lambda: T.BertForMaskedLM(T.BertConfig(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
            intermediate_size=4 * hidden, vocab_size=vocab["bert"], max_position_embeddings=seq,
            **common)), (batch, seq)),
        "bert-cls": (lambda: T.BertForSequenceClassification(T.BertConfig(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
            intermediate_size=4 * hidden, vocab_size=vocab["bert"], max_position_embeddings=seq,
            num_labels=CLASSES, **common)), (batch, seq)),
        "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
            num_key_value_heads=heads // 2, intermediate_size=3 * hidden,
            vocab_size=vocab["llama"], max_position_embeddings=seq, **common)), (batch, seq)),
    }


# ------------------------------------------------------------------------------ measuring
def cpu_peak(step: Callable[[], Any]) -> int:
    """Peak bytes the CPU allocator holds during ``step()`` above what it held before (the CPU
    counterpart of ``torch.cuda.max_memory_allocated``): every allocation, activations,
    recomputation and temporaries included, whoever's saved-tensor hooks are active, from the
    allocation events of ``torch.profiler`` (``profile_memory=True``)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def labels_for(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A language model predicts its input; a classifier one class per sequence."""
    if getattr(model.config, "num_labels", None) and "SequenceClassification" in \
            type(model).__name__:
        return ids[:, 0] % model.config.num_labels
    return ids


def measure(model: torch.nn.Module, ids: torch.Tensor, steps: int, device: str
            ) -> Dict[str, Any]:
    """Least (and median) step time over ``steps`` timed steps and the peak, measured in a separate
    untimed step; the timed steps come after two untimed ones (on the first, runners measure
    their chain and plan; the second runs the plan, measuring memory). On the CPU the clock
    is the process's CPU time (one thread: the work of the step, not the waits of a shared
    machine); on a GPU wall time after synchronising."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt_free = lambda: [setattr(p, "grad", None) for p in params]  # noqa: E731
    cuda = device == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    labels = labels_for(model, ids)

    def step(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach()

    model.train()
    step(0)  # warm-up (plans are made here)
    for p in params:  # gradients exist before: the peak is activations only
        p.grad = torch.zeros_like(p)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = cpu_peak(lambda: step(1))
    times = []
    for k in range(steps):
        opt_free()
        if cuda:
            torch.cuda.synchronize()
        t0 = clock()
        step(2 + k)
        if cuda:
            torch.cuda.synchronize()
        times.append(clock() - t0)
    opt_free()
    return {"status": "ok", "step_s": min(times), "step_s_median": statistics.median(times),
            "peak": int(peak)}


# ------------------------------------------------------------------------------ methods
def hf_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    kwargs = {"use_reentrant": False}  # transformers 5's default
    enable = getattr(model, "activation_checkpointing_enable", None)   # transformers >= 5.2x
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def checkpoint_missing() -> Optional[str]:
    return None if hasattr(scheduler, "checkpoint") else \
        "scheduler.checkpoint is not in this build yet (the ckpt runner): rows skipped"


def checkpointed(model: torch.nn.Module, budget: int, planner: Any) -> torch.nn.Module:
    # only pofo plans transfers: the others would warn that the bandwidth has no effect
    bandwidth = BANDWIDTH if planner == "pofo" else None
    return scheduler.checkpoint(model, budget, planner=planner, bandwidth=bandwidth)


def every_block(chain: Any, budget: Any) -> Any:
    """The plan of HF checkpointing (every block checkpointed), as a ``planner=`` callable:
    the runner with HF's own recomputation, and HF's peak on the runner's measured chain."""
    from scheduler.plan import checkpoint_plan
    L = len(chain) - 1
    plan = checkpoint_plan(L, range(L), planner="every-block")
    plan.predicted_peak = scheduler.simulate(chain, plan).peak_memory
    every_block.peaks.append(plan.predicted_peak)  # type: ignore[attr-defined]
    every_block.chain = chain  # type: ignore[attr-defined]
    return plan


every_block.peaks = []  # type: ignore[attr-defined]
every_block.chain = None  # type: ignore[attr-defined]


def plan_at(chain: Any, budget: int) -> Dict[str, Any]:
    """What rotor plans on the runner's measured chain at ``budget`` against HF's plan (every
    block checkpointed): forwards run and predicted time and peak of each. Rotor can only be
    faster than HF's plan by running fewer forwards, so this says whether a goal is reachable
    on this model at all, apart from the runtimes' own overheads."""
    from scheduler.planners import rotor
    from scheduler.plan import checkpoint_plan
    hf_plan = checkpoint_plan(chain.L, range(chain.L))
    hf_sim = scheduler.simulate(chain, hf_plan, memory=None)
    out: Dict[str, Any] = {"budget": budget, "every_block_forwards": sum(
        o.kind != "B" for o in hf_plan.ops), "every_block_predicted_s": hf_sim.makespan,
        "every_block_predicted_peak": hf_sim.peak_memory}
    try:
        p = rotor.solve(chain, budget)
    except scheduler.InfeasibleError as exc:
        return {**out, "rotor": "infeasible", "rotor_min_budget": exc.min_memory}
    return {**out, "rotor_forwards": sum(o.kind != "B" for o in p.ops),
            "rotor_predicted_s": p.predicted_time, "rotor_predicted_peak": p.predicted_peak}


def forwards_of(model: torch.nn.Module) -> int:
    """Forward ops (block runs, recomputations included, and the loss stage) of the plans the
    checkpointed model ran last: what sets its step time against HF's plan (2 L + 1)."""
    from scheduler.runtime.checkpoint import checkpointed as handle
    return sum(sum(op.kind != "B" for op in r.last_plan.ops) for r in handle(model).runners)


def predicted_peak_of(model: torch.nn.Module) -> int:
    """The peak the plans the checkpointed model ran last were checked at (the simulator's,
    summed over its block lists): what its measured ``peak`` should stay within."""
    from scheduler.runtime.checkpoint import checkpointed as handle
    return sum(int(r.last_plan.predicted_peak or 0) for r in handle(model).runners)


def checkpoint_row(method: str, budget: Optional[int], planner: Any, make: Callable[[], Any],
                   ids: torch.Tensor, steps: int, device: str) -> Dict[str, Any]:
    row: Dict[str, Any] = {"method": method, "budget": budget}
    why = checkpoint_missing()
    if why:
        return {**row, "status": "skipped", "note": why}
    try:
        model = checkpointed(make(), budget or 1, planner)
        row.update(measure(model, ids, steps, device))
        row["forwards"] = forwards_of(model)
        row["predicted_peak"] = predicted_peak_of(model)
    except scheduler.InfeasibleError as exc:
        row.update(status="infeasible", note=str(exc)[:200],
                   min_budget=getattr(exc, "min_memory", None))
    except Exception as exc:  # noqa: BLE001 - one failed row must not end the model's run
        oom = isinstance(exc, torch.cuda.OutOfMemoryError)  # type: ignore[attr-defined]
        row.update(status="oom" if oom else "error", note=f"{type(exc).__name__}: {exc}"[:300])
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def bench_model(name: str, make: Callable[[], torch.nn.Module], shape: Tuple[int, int],
                device: str, steps: int, fractions: Tuple[float, ...],
                quick: bool = False) -> Dict[str, Any]:
    # built once (a GPT-2-sized model takes seconds on the host, and some 30 methods and
    # budgets each want a fresh one): each gets a copy, with the random state a build from
    # seed 0 leaves
    torch.manual_seed(0)
    template = make()
    built_rng = torch.get_rng_state()

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)              # every device's generator, as before a build
        torch.set_rng_state(built_rng)    # the host's, as after it
        return copy.deepcopy(template).to(device)

    ids = torch.randint(1, 512, shape, generator=torch.Generator().manual_seed(1)).to(device)
    rows: List[Dict[str, Any]] = []
    plain = {"method": "plain", "budget": None, **measure(fresh(), ids, steps, device)}
    hf = {"method": "hf-ckpt", "budget": None,
          **measure(hf_checkpointing(fresh()), ids, steps, device)}
    # the runner under HF's plan: the runner's cost at HF's recomputation, and HF's peak in
    # the units budgets are planned in (the measured chain: transient memory included)
    every_block.peaks.clear()  # type: ignore[attr-defined]
    every_block.chain = None  # type: ignore[attr-defined]
    same = checkpoint_row("every-block", None, every_block, fresh, ids, steps, device)
    hf_budget = sum(every_block.peaks[-1:]) or None  # type: ignore[attr-defined]
    same["budget"] = hf_budget
    rows += [plain, hf, same]
    # fractions of plain's peak, HF checkpointing's peak (measured, and on the chain), and
    # below it (the third goal)
    budgets = {int(plain["peak"] * f) for f in fractions}
    if not quick:  # (the CI smoke run keeps to two budgets)
        budgets |= {hf["peak"], int(hf["peak"] * BELOW_HF)}
    if hf_budget:  # + 2%: rotor's discretisation (500 slots) rounds sizes up
        budgets |= {int(hf_budget * 1.02)} if quick else \
            {hf_budget, int(hf_budget * 1.02), int(hf_budget * BELOW_HF)}
    for planner in PLANNERS:
        for budget in sorted(budgets):
            rows.append(checkpoint_row(planner, budget, planner, fresh, ids, steps, device))
    chain = every_block.chain  # type: ignore[attr-defined]
    return {"model": name, "batch": shape[0], "seq_len": shape[1],
            "params": sum(p.numel() for p in template.parameters()), "rows": rows,
            "hf_budget_on_chain": hf_budget, "goal": goal_check(rows, hf_budget),
            **({"rotor_at_hf_peak": plan_at(chain, hf["peak"])} if chain is not None and
               hf.get("status") == "ok" else {})}


def goal_check(rows: List[Dict[str, Any]], hf_budget: Optional[int] = None) -> Dict[str, Any]:
    """The three goals on one model's rows, on measured peaks (None: not measurable, e.g.
    rotor rows skipped); with ``hf_budget`` (HF's plan's peak on the runner's chain) also
    whether rotor planned at that budget is faster than HF checkpointing."""
    hf = next(r for r in rows if r["method"] == "hf-ckpt")
    rotor = [r for r in rows if r["method"] == "rotor" and r.get("status") == "ok"]
    if not rotor:
        return {"faster_at_hf_peak": None, "less_memory_at_hf_time": None,
                "below_hf_peak": None}
    # Timing noise is a few percent here (the same plan has read 352 and 372 ms in two rows),
    # so "faster" needs a clear win: a plan that runs fewer forwards than HF's (when rows
    # say) and rotor's median step below HF's least; "as fast" is lenient: rotor's least
    # step at most HF's median.
    med = lambda r: r.get("step_s_median", r["step_s"])  # noqa: E731
    hf_fwd = next((r.get("forwards") for r in rows if r["method"] == "every-block"), None)
    at_peak = [r for r in rotor if r["peak"] <= hf["peak"] and
               (hf_fwd is None or r.get("forwards") is None or r["forwards"] < hf_fwd)]
    as_fast = [r for r in rotor if r["step_s"] <= med(hf)]
    out = {
        "faster_at_hf_peak": bool(at_peak) and
        min(med(r) for r in at_peak) < hf["step_s"],
        "less_memory_at_hf_time": bool(as_fast) and min(r["peak"] for r in as_fast) < hf["peak"],
        "below_hf_peak": min(r["peak"] for r in rotor) < hf["peak"],
    }
    if hf_budget:
        same = sorted((r for r in rotor if hf_budget <= r["budget"] <= hf_budget * 1.02 and
                       (hf_fwd is None or r.get("forwards") is None or r["forwards"] < hf_fwd)),
                      key=lambda r: r["budget"])  # the smallest such budget rotor accepts
        out["faster_at_hf_budget_on_chain"] = bool(same) and med(same[0]) < hf["step_s"]
    return out


# ------------------------------------------------------------------------------ output
def plot(results: Dict[str, Any], out: str, name: str) -> Optional[str]:
    plt = pyplot()
    if plt is None:
        return None
    models = results["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for method in ("plain", "hf-ckpt", "every-block", *PLANNERS):
            pts = sorted((r["peak"] / 2**20, r["step_s"] * 1e3) for r in m["rows"]
                         if r["method"] == method and r.get("status") == "ok")
            if pts:
                ax.plot(*zip(*pts), "o-" if len(pts) > 1 else "s", label=method)
        ax.set(title=f"{m['model']} (batch {m['batch']}, seq {m['seq_len']})",
               xlabel="peak activation memory (MiB)", ylabel="step time (ms)")
        if ax.get_legend_handles_labels()[0]:   # (a model that failed has no points)
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = save_png(fig, name, out)
    plt.close(fig)
    return path


def argv_of(args: Any) -> List[str]:
    return ["--device", args.device, "--threads", str(args.threads)] + \
        (["--steps", str(args.steps)] if args.steps else [])


def in_subprocess(name: str, argv: List[str], shape: Tuple[int, int],
                  timeout: Optional[float] = None) -> Optional[Dict[str, Any]]:
    """One model's rows from a fresh process: every model starts from the same allocator
    and interpreter state, and one model's leftovers (allocator caches, a leak) cannot
    change the next model's figures or exhaust the machine. A process that fails gives
    :func:`failed_model`'s entry with its exit status (what it recorded itself, if anything),
    so the other models go on; one still running after ``timeout`` seconds (``--stop-at``) is
    killed and gives None (not run: ``--resume`` runs it)."""
    import json
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = subprocess.run([sys.executable, __file__, "--models", name, "--out", tmp,
                                   *argv], stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr or b""
            sys.stderr.write(err.decode(errors="replace") if isinstance(err, bytes) else err)
            return None
        sys.stderr.write(proc.stderr)   # (stdout went straight through: the model's table)
        try:
            with open(next(os.path.join(tmp, f) for f in os.listdir(tmp)
                           if f.endswith(".json"))) as f:
                model = json.load(f)["models"][0]
        except (StopIteration, OSError, ValueError, IndexError, KeyError):
            model = None
    if proc.returncode == 0 and model is not None:
        return model
    tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
    if model is None or "error" not in model:
        model = failed_model(name, shape, f"the model's process failed: {tail[0]}"[:300])
    model["returncode"] = proc.returncode
    return model


def timed_out_model(name: str, shape: Tuple[int, int], seconds: float) -> Dict[str, Any]:
    """A model whose process was still running after ``seconds`` (``--stop-at``): recorded
    without an error, so ``--resume`` keeps it."""
    return {"model": name, "batch": shape[0], "seq_len": shape[1], "rows": [],
            "status": "timeout", "note": f"still running after {seconds:.0f} s (--stop-at): "
            "longer than a device call allows; run it alone (--models)"}


def failed_model(name: str, shape: Tuple[int, int], error: str) -> Dict[str, Any]:
    """A model whose run failed before it had rows to give: recorded with its error."""
    return {"model": name, "batch": shape[0], "seq_len": shape[1], "rows": [],
            "status": "error", "error": error}


def main(argv: Optional[List[str]] = None) -> None:
    def extra(p: Any) -> None:
        p.add_argument("--device", type=torch_device("cpu", "cuda", index=False),
                       default="cuda" if torch.cuda.is_available() else "cpu",
                       help="cpu or cuda (default cuda when there is one)")
        p.add_argument("--models", default=MODELS,
                       help=f"comma-separated subset of {MODELS} (default all)")
        p.add_argument("--steps", type=positive_int, default=None, metavar="N",
                       help="timed steps per method (default 7; 1 with --quick)")
        p.add_argument("--threads", type=positive_int, default=1, metavar="N",
                       help="CPU intra-op threads (default 1: steadier on a shared machine)")
        p.add_argument("--resume", action="store_true",
                       help="keep the models the results file already has without an error "
                            "(same device and settings) and run the others: a run cut off at a "
                            "time limit goes on where it stopped")
        p.add_argument("--stop-at", type=float, default=None, metavar="EPOCH",
                       help="start no model once fewer than max(60 s, the longest model so "
                            "far) are left before EPOCH (seconds since the epoch), and stop a "
                            "model's process still running then; the models not run are left "
                            "for --resume and the file's meta says incomplete (one stopped "
                            f"after {MODEL_TIMEOUT_S} s or more is recorded as timed out)")
    args = parse_args(__doc__.split("\n")[0], argv, extra)
    unknown = [n for n in args.models.split(",") if n not in MODELS.split(",")]
    if unknown:   # before any model runs
        usage_error(f"--models {args.models!r}: unknown model {', '.join(map(repr, unknown))} "
                    f"(known: {MODELS})", "hf.py")
    quick, device = args.quick, args.device
    if device == "cpu":
        torch.set_num_threads(args.threads)
    steps = args.steps or (1 if quick else 7)
    fractions = QUICK_FRACTIONS if quick else FRACTIONS
    zoo = configs(quick, device)
    command = "python bench/hf.py" + (" --quick" if quick else "") + \
        (f" --models {args.models}" if args.models != MODELS else "")
    results: Dict[str, Any] = {"meta": {**run_meta(command, device), "bench": "hf",
                                        "quick": quick, "steps": steps, "goal": GOAL,
                                        "checkpoint_available": checkpoint_missing() is None,
                                        # how plans count the model's outputs: watched at the
                                        # profiling step's backward (a file from before
                                        # counted them through the tail's backward only)
                                        "tail_outputs": TAIL_OUTPUTS,
                                        "budget_fractions_of_plain_peak": list(fractions)},
                               "models": []}
    write = args.out is not None   # None: --quick without --out (common.output_dir)
    name = f"hf-{results['meta']['device_tag']}"
    failed = []
    done = resumed(os.path.join(args.out, name + ".json"), results["meta"]) \
        if args.resume and write else {}
    not_run: List[str] = []
    longest = 0.0
    for model_name in args.models.split(","):
        make, shape = zoo[model_name]
        if model_name in done:
            print(f"{model_name}: kept from the results file (--resume)\n")
            results["models"].append(done[model_name])
            continue
        left = None if args.stop_at is None else args.stop_at - time.time()
        if left is not None and left < max(60.0, longest):
            print(f"{model_name}: not started, {max(left, 0):.0f} s left before --stop-at "
                  "(--resume runs it)\n")
            not_run.append(model_name)
            continue
        t0 = time.time()
        if len(args.models.split(",")) > 1 and not quick:
            # each model in a fresh process, which prints its own table
            got = in_subprocess(model_name, argv_of(args), shape, left)
            if got is None and left is not None and left < MODEL_TIMEOUT_S:
                print(f"{model_name}: stopped at --stop-at (--resume runs it again)\n")
                not_run.append(model_name)
                continue
            # one that had MODEL_TIMEOUT_S and did not finish never will in a device call:
            # recorded, kept by --resume (a later call would start it over for nothing)
            m = got if got is not None else timed_out_model(model_name, shape, left or 0.0)
        else:
            try:
                m = bench_model(model_name, make, shape, device, steps, fractions, quick)
            except Exception as exc:  # noqa: BLE001 - recorded; the exit status says so
                import traceback
                traceback.print_exc()
                m = failed_model(model_name, shape, f"{type(exc).__name__}: {exc}"[:300])
            else:
                print_model(m)
        longest = max(longest, time.time() - t0)
        results["models"].append(m)
        if "error" in m:
            failed.append(model_name)
            print(f"{model_name}: failed ({m['error']})\n")
        if write:   # after every model: a later failure loses nothing
            write_json(name, results, args.out)
    if not_run:   # scripts/gpu-check then goes on in a later call (--resume)
        results["meta"].update({"incomplete": True, "not_run": len(not_run),
                                "left_out": not_run})
        if write:
            write_json(name, results, args.out)
    if not results["meta"]["checkpoint_available"]:
        print(checkpoint_missing())
    if write:
        print(f"wrote {os.path.join(args.out, name + '.json')}")
        plot(results, args.out, name)
    else:
        say_nothing_written()
    if failed:
        raise SystemExit(f"hf.py: {', '.join(failed)} failed (recorded with the error"
                         + (" in the results file)" if write else ")"))


def resumed(path: str, meta: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The models of an earlier run's results file to keep (``--resume``): those without an
    error (of the model or of a row), when that run measured the same way (device, quick,
    timed steps, ``tail_outputs``); else none."""
    import json
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return {}
    same = all(old.get("meta", {}).get(k) == meta.get(k)
               for k in ("device_tag", "quick", "steps", "tail_outputs"))
    def whole(m: Dict[str, Any]) -> bool:   # no error of its own or in a row
        return "error" not in m and all(r.get("status") != "error" for r in m.get("rows", []))
    return {m["model"]: m for m in old.get("models", []) if same and whole(m)} \
        if isinstance(old, dict) else {}


def print_model(m: Dict[str, Any]) -> None:
    print_table([{"method": r["method"],
                  "budget MiB": None if r["budget"] is None else r["budget"] / 2**20,
                  "status": r.get("status"),
                  "step ms": r["step_s"] * 1e3 if "step_s" in r else None,
                  "peak MiB": r["peak"] / 2**20 if "peak" in r else None,
                  "forwards": r.get("forwards")}
                 for r in m["rows"]], title=f"{m['model']}: batch {m['batch']}, seq {m['seq_len']}")
    print(f"goal ({GOAL}): {m['goal']}\n")

if __name__ == "__main__":
    main()
