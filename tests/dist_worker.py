"""One rank of the multi-process tests (issue 15), run by ``torchrun`` (``python -m
torch.distributed.run``) on localhost with gloo. One launch runs many cases and appends one
JSON line per case to ``OUT/rank<R>.jsonl`` as it goes (a hang or crash still leaves the
cases before it); ``tests/test_distributed.py`` starts the launches and reads the lines.

A case is (model, runtime, parallel): the runtime is looked up in ``RUNTIMES`` (name ->
how it wraps the model and runs a step), the parallel wrapper in ``PARALLEL``; Hugging Face's
Llama runs plain training and ``scheduler.checkpoint`` only (``HF_RUNTIMES``). For each step
the case records a SHA-256 of every parameter's gradient on this rank (after the
reduction), so the test compares a runtime against the plain run of the same model and
parallel setup, per rank and per step, bit for bit, across launches.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_worker.py \\
        OUT [--runtimes plain,swap,...] [--models cnn,transformer,llama] [--parallel ddp,...]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import sys
import traceback
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

import scheduler
from scheduler.planners import mimose as M
from scheduler.runtime.checkpoint import checkpointed
from scheduler.runtime.distributed import shutdown
from wrap_models import ListNet as Net  # the model people write: a block list and its loop

STEPS = 3                    # the last one has the first one's shape: a planned step
BANDWIDTH = 12e9
SEQ_LENS = [12, 16]          # the transformer's sequence length per step (same on all ranks)


# ------------------------------------------------------------------------------ models
class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


class Pool(nn.Module):
    """Mean over ``dims`` (the image's pixels, the sequence's tokens), then a linear head."""

    def __init__(self, c: int, n: int, dims: tuple):
        super().__init__()
        self.fc = nn.Linear(c, n)
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=self.dims))


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int, max_len: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos[: ids.shape[1]]


class HFLlama(nn.Module):
    """Hugging Face's Llama from a small config with its defaults (the KV cache on, so the
    runner turns it off), attention dropout on: the logits out."""

    block_path = "lm.model.layers"   # what scheduler.checkpoint's blocks= names

    def __init__(self):
        super().__init__()
        import transformers
        cfg = transformers.LlamaConfig(
            num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=50, max_position_embeddings=64,
            attention_dropout=0.1)
        self.lm = transformers.LlamaForCausalLM(cfg)

    @property
    def blocks(self) -> nn.ModuleList:  # for FSDP2 per block
        return self.lm.model.layers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits


HF_MODELS = ("llama",)
HF_RUNTIMES = ("plain", "checkpoint-rotor", "checkpoint-pofo", "checkpoint-periodic",
               "checkpoint-mimose", "checkpoint-rotor-on-wrapper", "checkpoint-mimose-on-wrapper",
               "checkpoint-rotor-input-aware")


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """The loss every case trains on (the models' outputs squared, averaged)."""
    return out.float().pow(2).mean()


def build(model: str) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    if model == "cnn":  # skips and BatchNorm
        return Net([nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
                    ResBlock(8), ResBlock(8), ResBlock(8), Pool(8, 5, (2, 3))])
    if model == "transformer":  # 4 layers with dropout
        layers = [nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
                  for _ in range(4)]
        return Net([Embed(50, 32), *layers, Pool(32, 5, (1,))])
    if model == "llama":
        return HFLlama()
    raise ValueError(f"dist_worker: unknown model {model!r}")


def batch(model: str, rank: int, step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    if model == "cnn":
        return torch.randn(4, 3, 12, 12, generator=g)
    return torch.randint(1, 50, (4, SEQ_LENS[step % len(SEQ_LENS)]), generator=g)


def budget_for(model: str) -> int:
    """Half-way between every-block-checkpointed and nothing-checkpointed at the largest
    input: a budget under which every planner must recompute (bytes: equal on every rank)."""
    net = build(model)
    x = batch(model, 0, SEQ_LENS.index(max(SEQ_LENS)))
    if model in HF_MODELS:  # its blocks take the model's masks and rotary tables: profiled
        scheduler.checkpoint(net, 1 << 40, blocks=HFLlama.block_path,
                             measure_options={"repeat": 1})
        for _ in range(2):  # the profiling step, then a plan with the measured chain
            loss_of(net(x)).backward()
        chain = checkpointed(net).runners[0].last_plan.chain
    else:
        chain = scheduler.profile.measure_chain(list(net.blocks), x, loss="sum", repeat=1,
                                                 input_grad=x.is_floating_point())
    full = scheduler.simulate(chain, M.plan_from_checkpoints(chain.L, [])).peak_memory
    floor = scheduler.simulate(chain, M.plan_from_checkpoints(chain.L, range(chain.L))).peak_memory
    return int((full + floor) / 2)


# ------------------------------------------------------------------------------ runtimes
class Runtime:
    """How a runtime changes the model (``prepare``; ``after``: once the parallel wrapper
    wrapped it, given the wrapper, the model and the budget) and wraps a step (``context``)."""

    def __init__(self, prepare: Callable[[Net, int], nn.Module],
                 context: Callable[[], Any] = nullcontext,
                 after: Optional[Callable[[nn.Module, Net, int], None]] = None):
        self.prepare, self.context, self.after = prepare, context, after


def _read_by(planner: str, **options: Any) -> Dict[str, Any]:
    """``options`` less those ``planner`` does not read (the runtimes refuse those), plus the
    bandwidth for pofo: samples is Mimose's, on_chain sees the chains the others plan on."""
    keep = {"samples": planner == "mimose", "on_chain": planner != "mimose"}
    out = {k: v for k, v in options.items() if keep[k]}
    return dict(out, bandwidth=BANDWIDTH) if planner == "pofo" else out


def _wrap(planner: str) -> Callable[[Net, int], nn.Module]:
    def prepare(net: Net, budget: int) -> nn.Module:
        return scheduler.wrap(list(net.blocks), budget, planner=planner,
                              **_read_by(planner, samples=3))
    return prepare


def _input_aware(net: Net, budget: int) -> nn.Module:
    from scheduler.runtime.input_aware import InputAwareChain
    blocks = list(net.blocks)
    return scheduler.wrap(blocks, budget, planner="rotor",
                          chain=InputAwareChain(blocks, samples=3, measure_options={"repeat": 1}))


CHAINS: List[Any] = []   # the chains a checkpoint runtime planned on in the current case


def _checkpoint(planner: str) -> Callable[[Net, int], nn.Module]:
    def prepare(net: Net, budget: int) -> nn.Module:
        # blocks= names the list: the CNN's blocks are of different classes (no auto-detection)
        return scheduler.checkpoint(net, budget, planner=planner,
                                    blocks=getattr(net, "block_path", "blocks"),
                                    **_read_by(planner, on_chain=lambda c: CHAINS.append(c) or c))
    return prepare


SOURCES: List[Any] = []  # the InputAwareChain of the current case, if any


def _checkpoint_input_aware(net: Net, budget: int) -> nn.Module:
    """scheduler.checkpoint with chain=InputAwareChain: the runner measures each size still to
    learn on a profiling step (the model's keyword arguments; FSDP's forward-only measurement)
    and teaches it to the source."""
    from scheduler.runtime.input_aware import InputAwareChain
    path = getattr(net, "block_path", "blocks")
    SOURCES.append(InputAwareChain(net.get_submodule(path), samples=3))
    return scheduler.checkpoint(net, budget, planner="rotor", blocks=path, chain=SOURCES[-1],
                                on_chain=lambda c: CHAINS.append(c) or c)


def _checkpoint_wrapped(planner: str) -> Callable[[nn.Module, Net, int], None]:
    """scheduler.checkpoint called on the parallel wrapper (DDP, the FSDP1 root), after it
    wrapped the model: HF's blocks found through the wrapper (FSDP1 units in their list or
    not), the others' list given as the object. (Mimose's collection steps measured the
    model's tail there, whose replayed backward ran the FSDP1 root's hooks: it resharded the
    root before the real backward.)"""
    def after(wrapped: nn.Module, net: Net, budget: int) -> None:
        blocks = None if isinstance(net, HFLlama) else [net.blocks]
        scheduler.checkpoint(wrapped, budget, planner=planner, blocks=blocks,
                             **_read_by(planner, on_chain=lambda c: CHAINS.append(c) or c))
    return after


RUNTIMES: Dict[str, Runtime] = {
    "plain": Runtime(lambda net, budget: net),
    # the global byte window (VMALLOC_WINDOW) is "plain" run in a launch with the variable set
    "window": Runtime(lambda net, budget: net),
    "swap": Runtime(lambda net, budget: net,
                    lambda: scheduler.swap(window="64KiB", device="cpu", min_bytes=0)),
    **{f"wrap-{p}": Runtime(_wrap(p)) for p in ("rotor", "pofo", "mimose")},
    "wrap-rotor-input-aware": Runtime(_input_aware),
    **{f"checkpoint-{p}": Runtime(_checkpoint(p))
       for p in ("rotor", "pofo", "periodic", "mimose")},
    **{f"checkpoint-{p}-on-wrapper": Runtime(lambda net, budget: net,
                                             after=_checkpoint_wrapped(p))
       for p in ("rotor", "mimose")},
    "checkpoint-rotor-input-aware": Runtime(_checkpoint_input_aware),
}


# ------------------------------------------------------------------------------ parallel
def _ddp(**options: Any) -> Callable[[nn.Module], nn.Module]:
    def apply(m: nn.Module) -> nn.Module:
        return nn.parallel.DistributedDataParallel(m, **options)
    return apply


def _fsdp(per_block: bool, bf16: bool = False) -> Callable[[nn.Module], nn.Module]:
    """FSDP2 (``fully_shard``): each block and the root, or the root alone; ``bf16``: its
    mixed-precision policy (bfloat16 weights and inputs in the forward and backward, float32
    gradient reduction), as accelerate's FSDP2 sets it for ``mixed_precision="bf16"``."""
    def apply(m: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if bf16 else MixedPrecisionPolicy()
        if per_block:
            for b in m.blocks:
                fully_shard(b, mp_policy=mp)
        fully_shard(m, mp_policy=mp)
        return m
    return apply


def _fsdp1(per_block: bool, use_orig_params: bool,
           bf16: bool = False) -> Callable[[nn.Module], nn.Module]:
    """FSDP1 (the ``FullyShardedDataParallel`` wrapper; accelerate's default FSDP, and
    transformers 4's Trainer's): each block its own unit (the transformer-layer wrap policy)
    or the whole model one unit; flat parameters (``use_orig_params=False``) or the original
    ones; ``bf16``: its mixed precision, bfloat16 weights in the blocks' forward and backward,
    as trained on GPUs."""
    def apply(m: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
        blocks = {id(b) for b in m.blocks}
        policy = functools.partial(lambda_auto_wrap_policy,
                                   lambda_fn=lambda mod: id(mod) in blocks) if per_block else None
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                            buffer_dtype=torch.float32) if bf16 else None
        return FSDP(m, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                    use_orig_params=use_orig_params, mixed_precision=mp)
    return apply


PARALLEL: Dict[str, Callable[[nn.Module], nn.Module]] = {
    "ddp": _ddp(),
    "ddp-unused": _ddp(find_unused_parameters=True),
    "ddp-bucket-view": _ddp(gradient_as_bucket_view=True),
    "ddp-static": _ddp(static_graph=True),
    "ddp-no-sync": _ddp(),              # two micro-batches, the first under no_sync()
    "fsdp-block": _fsdp(per_block=True),
    "fsdp-whole": _fsdp(per_block=False),
    "fsdp-block-bf16": _fsdp(per_block=True, bf16=True),
    "fsdp1-block": _fsdp1(per_block=True, use_orig_params=False),
    "fsdp1-block-orig": _fsdp1(per_block=True, use_orig_params=True),
    "fsdp1-whole": _fsdp1(per_block=False, use_orig_params=False),
    "fsdp1-whole-orig": _fsdp1(per_block=False, use_orig_params=True),
    "fsdp1-block-bf16": _fsdp1(per_block=True, use_orig_params=False, bf16=True),
}
# setups a model does not run in, even in plain training: FSDP2's mixed precision casts the
# BatchNorm weights to bfloat16 beside float32 running statistics, which batch_norm refuses
# (FSDP1 keeps BatchNorm in float32 by default)
NOT_RUN: Dict[Tuple[str, str], str] = {
    ("cnn", "fsdp-block-bf16"): "BatchNorm under FSDP2's bfloat16 policy fails without vmalloc"}
# budget_for's budget is for float32 activations: bfloat16 ones need less to recompute
BUDGET_SCALE: Dict[str, float] = {"fsdp1-block-bf16": 0.65, "fsdp-block-bf16": 0.65}


def grad_digest(model: nn.Module) -> Dict[str, Any]:
    h = hashlib.sha256()
    missing = []
    for name, p in model.named_parameters():
        g = p.grad
        if g is None and p.numel() == 0:  # FSDP1 use_orig_params: no shard on this rank
            continue
        if g is None:
            missing.append(name)
            h.update(b"None")
            continue
        if hasattr(g, "to_local"):  # FSDP2: this rank's shard
            g = g.to_local()
        h.update(g.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return {"sha": h.hexdigest(), "missing": missing}


def run_case(model: str, runtime: str, parallel: str, budget: int, rank: int) -> Dict[str, Any]:
    rt = RUNTIMES[runtime]
    CHAINS.clear()
    SOURCES.clear()
    net = build(model)
    wrapped = PARALLEL[parallel](rt.prepare(net, budget))
    if rt.after is not None:
        rt.after(wrapped, net, budget)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    steps = []
    micro = 2 if parallel == "ddp-no-sync" else 1
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        losses = []
        for k in range(micro):
            torch.manual_seed(1000 * step + 10 * k + rank)  # dropout: per rank, step, micro
            sync = wrapped.no_sync() if k < micro - 1 else nullcontext()
            with sync, rt.context():
                out = wrapped(batch(model, rank, step, k))
                loss = loss_of(out)
                loss.backward()
            losses.append(loss.item())
        steps.append({"losses": losses, **grad_digest(wrapped)})
        opt.step()
    rec: Dict[str, Any] = {"status": "ok", "steps": steps}
    inner = getattr(wrapped, "module", wrapped)
    plan = getattr(inner, "last_plan", None)
    if plan is not None:
        rec["plan"] = hashlib.sha256(repr(plan.ops).encode()).hexdigest()
        chain = plan.chain
        rec["agreed_over_ranks"] = None if chain is None else chain.meta.get("agreed_over_ranks")
    if SOURCES:
        rec["input_aware"] = SOURCES[-1].stats()
    if CHAINS:   # what the step held beside the chain, as the last planned-on chain counts it
        rec["outside"] = CHAINS[-1].meta.get("outside")
    # what the last step (a planned one) did: scheduler.checkpoint's runners, or the chain's
    done = checkpointed(inner) or checkpointed(wrapped)
    last = [r.last_stats for r in done.runners] if done is not None else \
        [getattr(inner, "last_stats", None)]
    if all(st is not None for st in last):
        rec["recomputed"] = sum(st.recomputed_forwards for st in last)
        rec["offloaded"] = sum(st.offloaded for st in last)
        plans = [r.last_plan for r in done.runners] if done is not None else [plan]
        rec["last_planners"] = [p.planner for p in plans]  # "profile": a profiling step
        if done is not None:
            rec["chains_measured"] = sum(r.stats()["chains_measured"] for r in done.runners)
    # what Mimose learnt, to say why the ranks' plans differ where they must not
    learners = [r.mimose for r in done.runners] if done is not None else \
        [getattr(inner, "mimose", None)]
    samples = [{str(size): m.estimator.measured(size).xbar.tolist()
                for size in m.estimator.sizes} for m in learners if m is not None]
    if samples:
        rec["mimose_xbar"] = samples
    return rec


# ------------------------------------------------------------------------------ agreement
def agreement_checks(rank: int) -> Dict[str, Any]:
    """agree_chain itself: ranks with different chains get one chain, the element-wise max;
    ranks planning for different inputs raise on every rank."""
    from scheduler.runtime.distributed import agree_chain
    mine = scheduler.Chain.random(5, seed=rank)
    got = agree_chain(mine, key="same")
    all_chains = [None] * dist.get_world_size()
    dist.all_gather_object(all_chains, mine.to_dict())
    want = {f: [max(c[f][s] for c in all_chains) for s in range(len(mine))]
            for f in ("fw", "bw", "x", "xbar", "delta", "fw_tmp", "bw_tmp")}
    out: Dict[str, Any] = {"agreed": got.to_dict(), "is_max": all(
        list(getattr(got, f)) == want[f] for f in want)}
    # rank k holds its inputs on cuda:k: the same signature for the agreement
    out["device_index_ignored"] = agree_chain(mine, key=(((4, 3), f"cuda:{rank}"),)).L == 5
    try:
        agree_chain(mine, key=f"rank{rank}")
        out["mismatch"] = "no error"
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--models", default="cnn,transformer,llama")
    ap.add_argument("--runtimes", default="plain")
    ap.add_argument("--parallel", default=",".join(PARALLEL))
    ap.add_argument("--agreement", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # generous: on a loaded 2-core CI machine one rank can lag the other by many seconds
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=240))
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rank{rank}.jsonl")
    with open(path, "w") as f:
        def emit(rec: Dict[str, Any]) -> None:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        emit({"case": "process", "rank": rank, "world_size": dist.get_world_size(),
              "pid": os.getpid(), "window": os.environ.get("VMALLOC_WINDOW")})
        if args.agreement:
            emit({"case": "agreement", **agreement_checks(rank)})
        for model in args.models.split(","):
            budget = budget_for(model)
            for runtime in args.runtimes.split(","):
                if model in HF_MODELS and runtime not in HF_RUNTIMES:
                    continue
                for parallel in args.parallel.split(","):
                    if (model, parallel) in NOT_RUN:
                        continue
                    try:
                        rec = run_case(model, runtime, parallel,
                                       int(budget * BUDGET_SCALE.get(parallel, 1.0)), rank)
                    except Exception as exc:  # noqa: BLE001 - recorded, the test decides
                        rec = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                               "trace": traceback.format_exc(limit=4)}
                    # both ranks leave every case together, failed or not: a barrier on the
                    # failed rank alone would pair with the other's next collective
                    failed = torch.tensor([int(rec["status"] != "ok")])
                    dist.all_reduce(failed)
                    if failed.item() and rec["status"] == "ok":
                        rec["other_rank_failed"] = True
                    emit({"case": f"{model}/{runtime}/{parallel}", **rec})
        # not dist.destroy_process_group(): a rank could abort at exit (see shutdown)
        shutdown()
        emit({"case": "exit"})  # the test asserts every rank got here and then exited 0


if __name__ == "__main__":
    sys.exit(main())
