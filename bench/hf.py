"""Hugging Face models under a memory budget (issue 13, Benchmark): GPT-2, BERT and Llama from
small configs (random weights), step time and peak activation memory for

- ``plain``: no checkpointing;
- ``hf-ckpt``: the model's own ``gradient_checkpointing_enable()`` (every layer checkpointed,
  no budget; ``use_reentrant=True`` so the activation accounting below sees the recomputation);
- ``rotor``, ``pofo``, ``mimose`` through ``scheduler.checkpoint(model, budget, planner=...)``
  at several budgets: fractions of plain's peak, HF checkpointing's own peak and 80% of it.

Goal (issue 13): at HF checkpointing's peak, rotor is faster; at HF checkpointing's step time,
rotor holds less memory; rotor reaches budgets below HF checkpointing's peak.

Peak activation memory: on a GPU, ``torch.cuda.max_memory_allocated`` during a step above what
was allocated before it; on the CPU, the peak of the bytes autograd holds for backward
(distinct storages saved, parameters left out, recomputation in the backward included),
counted with saved-tensor hooks; for ``scheduler.checkpoint`` rows the runner's own accounting
(``track_memory``) where it reports a larger figure (its hooks take precedence over ours).

    python bench/hf.py [--quick] [--device cpu|cuda] [--models gpt2,bert,llama] [--steps N]

Writes bench/results/hf-<device>.json and .png; the README section comes from
``bench/readme_results.py``. ``--quick`` (CI smoke, seconds) writes nothing unless ``--out``.
"""
from __future__ import annotations

import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from common import RESULTS, parse_args, print_table, pyplot, run_meta, save_png, write_json

import scheduler  # noqa: E402  (common put the checkout on sys.path)

PLANNERS = ("rotor", "pofo", "mimose")
BANDWIDTH = 12e9
FRACTIONS = (0.25, 0.4, 0.6, 0.8)
QUICK_FRACTIONS = (0.4,)
BELOW_HF = 0.8
GOAL = ("at HF checkpointing's peak rotor is faster; at HF checkpointing's step time rotor "
        "holds less memory; rotor reaches budgets below HF checkpointing's peak")


# ------------------------------------------------------------------------------ models
def configs(quick: bool) -> Dict[str, Tuple[Callable[[], torch.nn.Module], Tuple[int, int]]]:
    """name -> (model factory, (batch, sequence length)), small configs, random weights."""
    import transformers as T
    layers, hidden, heads, seq = (2, 64, 4, 32) if quick else (6, 128, 4, 256)
    vocab = 512
    common = dict(attn_implementation="eager")
    return {
        "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq,
            **common)), (4, seq)),
        "bert": (lambda: T.BertForMaskedLM(T.BertConfig(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
            intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=seq,
            **common)), (4, seq)),
        "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
            num_key_value_heads=heads // 2, intermediate_size=3 * hidden, vocab_size=vocab,
            max_position_embeddings=seq, **common)), (4, seq)),
    }


# ------------------------------------------------------------------------------ measuring
class HeldBytes:
    """Peak bytes of the activations autograd holds for backward (CPU accounting): each saved
    tensor is packed into a holder whose release (graph freed, or used by backward) drops its
    storage's count; parameters are not activations."""

    def __init__(self, params: List[torch.nn.Parameter]):
        self.skip = {p.untyped_storage()._cdata for p in params}
        self.refs: Dict[int, List[int]] = {}  # storage -> [holders, bytes]
        self.live = 0
        self.peak = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    class _Holder:
        __slots__ = ("t", "key", "owner")

        def __init__(self, t: torch.Tensor, key: int, owner: "HeldBytes"):
            self.t, self.key, self.owner = t, key, owner

        def __del__(self) -> None:
            self.owner._release(self.key)

    def _pack(self, t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.skip or t.device.type == "meta":
            return t
        ref = self.refs.setdefault(key, [0, st.nbytes()])
        if ref[0] == 0:
            self.live += ref[1]
            self.peak = max(self.peak, self.live)
        ref[0] += 1
        return HeldBytes._Holder(t, key, self)

    @staticmethod
    def _unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, HeldBytes._Holder) else h

    def _release(self, key: int) -> None:
        ref = self.refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[key]

    def __enter__(self) -> "HeldBytes":
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)


def runner_peak(model: torch.nn.Module) -> int:
    """The largest ``last_peak_bytes`` a scheduler runner inside ``model`` reports (0: none)."""
    best = 0
    for m in model.modules():
        stats = getattr(m, "stats", None)
        if callable(stats) and hasattr(m, "last_stats"):
            try:
                best = max(best, int(stats().get("last_peak_bytes") or 0))
            except Exception:  # noqa: BLE001 - a module's own stats() of another kind
                pass
    return best


def measure(model: torch.nn.Module, ids: torch.Tensor, steps: int, device: str
            ) -> Dict[str, Any]:
    """Median step time over ``steps`` timed steps (after one warm-up) and the peak."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt_free = lambda: [setattr(p, "grad", None) for p in params]  # noqa: E731
    cuda = device == "cuda"

    def step(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        loss = model(input_ids=ids, labels=ids).loss
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
        with HeldBytes(params) as held:
            step(1)
        peak = max(held.peak, runner_peak(model))
    times = []
    for k in range(steps):
        opt_free()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(2 + k)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    opt_free()
    return {"status": "ok", "step_s": statistics.median(times), "peak": int(peak)}


# ------------------------------------------------------------------------------ methods
def hf_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    kwargs = {"use_reentrant": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the alias is deprecated in v5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def checkpoint_missing() -> Optional[str]:
    return None if hasattr(scheduler, "checkpoint") else \
        "scheduler.checkpoint is not in this build yet (the ckpt runner): rows skipped"


def checkpointed(model: torch.nn.Module, budget: int, planner: str) -> torch.nn.Module:
    return scheduler.checkpoint(model, budget, planner=planner, bandwidth=BANDWIDTH,
                                track_memory=True)


def bench_model(name: str, make: Callable[[], torch.nn.Module], shape: Tuple[int, int],
                device: str, steps: int, fractions: Tuple[float, ...]) -> Dict[str, Any]:
    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return make().to(device)

    ids = torch.randint(1, 512, shape, generator=torch.Generator().manual_seed(1)).to(device)
    rows: List[Dict[str, Any]] = []
    plain = {"method": "plain", "budget": None, **measure(fresh(), ids, steps, device)}
    hf = {"method": "hf-ckpt", "budget": None,
          **measure(hf_checkpointing(fresh()), ids, steps, device)}
    rows += [plain, hf]
    # fractions of plain's peak, HF checkpointing's peak, and below it (the third goal)
    budgets = sorted({int(plain["peak"] * f) for f in fractions} |
                     {hf["peak"], int(hf["peak"] * BELOW_HF)})
    why = checkpoint_missing()
    for planner in PLANNERS:
        for budget in budgets:
            row: Dict[str, Any] = {"method": planner, "budget": budget}
            if why:
                row.update(status="skipped", note=why)
            else:
                try:
                    row.update(measure(checkpointed(fresh(), budget, planner), ids, steps, device))
                except scheduler.InfeasibleError as exc:
                    row.update(status="infeasible", note=str(exc)[:200],
                               min_budget=getattr(exc, "min_memory", None))
            rows.append(row)
    return {"model": name, "batch": shape[0], "seq_len": shape[1],
            "params": sum(p.numel() for p in fresh().parameters()), "rows": rows,
            "goal": goal_check(rows)}


def goal_check(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The three goals on one model's rows (None: not measurable, e.g. rotor rows skipped)."""
    hf = next(r for r in rows if r["method"] == "hf-ckpt")
    rotor = [r for r in rows if r["method"] == "rotor" and r.get("status") == "ok"]
    if not rotor:
        return {"faster_at_hf_peak": None, "less_memory_at_hf_time": None,
                "below_hf_peak": None}
    at_peak = [r for r in rotor if r["budget"] <= hf["peak"]]
    as_fast = [r for r in rotor if r["step_s"] <= hf["step_s"]]
    return {
        "faster_at_hf_peak": bool(at_peak) and
        min(r["step_s"] for r in at_peak) < hf["step_s"],
        "less_memory_at_hf_time": bool(as_fast) and min(r["peak"] for r in as_fast) < hf["peak"],
        "below_hf_peak": min(r["budget"] for r in rotor) < hf["peak"],
    }


# ------------------------------------------------------------------------------ output
def plot(results: Dict[str, Any], out: str, name: str) -> Optional[str]:
    plt = pyplot()
    if plt is None:
        return None
    models = results["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for method in ("plain", "hf-ckpt", *PLANNERS):
            pts = sorted((r["peak"] / 2**20, r["step_s"] * 1e3) for r in m["rows"]
                         if r["method"] == method and r.get("status") == "ok")
            if pts:
                ax.plot(*zip(*pts), "o-" if len(pts) > 1 else "s", label=method)
        ax.set(title=f"{m['model']} (batch {m['batch']}, seq {m['seq_len']})",
               xlabel="peak activation memory (MiB)", ylabel="step time (ms)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = save_png(fig, name, out)
    plt.close(fig)
    return path


def main(argv: Optional[List[str]] = None) -> None:
    def extra(p: Any) -> None:
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--models", default="gpt2,bert,llama")
        p.add_argument("--steps", type=int, default=None)
        p.add_argument("--threads", type=int, default=1,
                       help="CPU intra-op threads (default 1: steadier on a shared machine)")
    args = parse_args(__doc__.split("\n")[0], argv, extra)
    quick, device = args.quick, args.device
    if device == "cpu":
        torch.set_num_threads(args.threads)
    steps = args.steps or (1 if quick else 5)
    fractions = QUICK_FRACTIONS if quick else FRACTIONS
    zoo = configs(quick)
    command = "python bench/hf.py" + (" --quick" if quick else "") + \
        (f" --models {args.models}" if args.models != "gpt2,bert,llama" else "")
    results: Dict[str, Any] = {"meta": {**run_meta(command, device), "bench": "hf",
                                        "quick": quick, "steps": steps, "goal": GOAL,
                                        "checkpoint_available": checkpoint_missing() is None,
                                        "budget_fractions_of_plain_peak": list(fractions)},
                               "models": []}
    for name in args.models.split(","):
        if name not in zoo:
            raise SystemExit(f"--models: unknown model {name!r} (known: {', '.join(zoo)})")
        make, shape = zoo[name]
        m = bench_model(name, make, shape, device, steps, fractions)
        results["models"].append(m)
        print_table([{"method": r["method"],
                      "budget MiB": None if r["budget"] is None else r["budget"] / 2**20,
                      "status": r.get("status"),
                      "step ms": r["step_s"] * 1e3 if "step_s" in r else None,
                      "peak MiB": r["peak"] / 2**20 if "peak" in r else None}
                     for r in m["rows"]], title=f"{name}: batch {m['batch']}, seq {m['seq_len']}")
        print(f"goal ({GOAL}): {m['goal']}\n")
    if not results["meta"]["checkpoint_available"]:
        print(checkpoint_missing())
    if quick and args.out == RESULTS:
        return  # CI smoke: no results written over the real ones
    name = f"hf-{results['meta']['device_tag']}"
    print(f"wrote {write_json(name, results, args.out)}")
    plot(results, args.out, name)


if __name__ == "__main__":
    main()
