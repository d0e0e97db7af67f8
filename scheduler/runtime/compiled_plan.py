"""A Plan checked for the chain runtime and split into its forward and backward phases
(``CompiledPlan``), and the timing a memory-limited simulation adds to a plan with transfers
(``transfer_timing``): what ``chain_exec.ChainStep`` follows."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Set, Tuple

from ..errors import InvalidPlanError
from ..plan import FORWARD_KINDS, Plan
from ..units import format_bytes


@dataclass
class CompiledPlan:
    """A Plan checked for the runtime and split into its forward and backward phases."""

    plan: Plan
    L: int
    forward_ops: List[Tuple[int, str, int]]   # (index in plan.ops, kind, stage)
    backward_ops: List[Tuple[int, str, int]]
    recomputed: Set[int]                      # stages run more than once
    # offload op index -> the last op that still reads the offloaded value before it is
    # prefetched, after which its device memory goes (the simulator lets an op read an item
    # while its offload is in flight): a forward of its stage, or B of it, which autograd
    # runs after the op is reached (ChainStep releases at the next backward_reaches)
    release: Dict[int, int] = field(default_factory=dict)
    # compute op index -> offload ops whose copy must be complete before it starts (host wait)
    sync_before: Dict[int, List[int]] = field(default_factory=dict)
    # every block runs once keeping what it saves (F_all), and nothing moves: plain training
    keeps_everything: bool = False

    @classmethod
    def of(cls, plan: Plan, L: int) -> "CompiledPlan":
        """Check ``plan`` for a chain of ``L`` blocks plus the loss (whole-tensor transfers,
        stages in range, each stage run once in order before ``B L``) and split it at its
        first backward. Prefetches its memory-limited simulation started later move there
        (``transfer_timing``, with the host waits ``sync_before``), and each offload gets the
        last op that still reads its value (``release``), after which its device memory goes,
        as in the simulator. Raises ``InvalidPlanError`` naming the op."""
        ops = [(i, op.kind, op.stage) for i, op in enumerate(plan.ops)]
        if plan.transfer_chunk is not None and any(op.kind in ("offload", "prefetch")
                                                   for op in plan.ops):
            # its peak assumes an offload frees its item chunk by chunk; whole tensors here
            # are freed when their copy ends, so running it would break the plan's limit
            raise InvalidPlanError(
                f"plan streams its transfers in chunks of {format_bytes(plan.transfer_chunk)} "
                "(Plan.transfer_chunk); the chain runtime moves whole tensors: plan with "
                "transfer_chunk=None", None)
        timing = plan.meta.get("transfer_timing") or {}
        issue_after = {int(i): int(j) for i, j in timing.get("issue_after", [])}
        if issue_after:  # prefetches the simulator starts later (waiting for memory) move there
            moved = [op for op in ops if op[0] not in issue_after]
            for i, j in sorted(issue_after.items(), key=lambda p: (p[1], p[0])):
                k = next(n for n, op in enumerate(moved) if op[0] == j)
                while k + 1 < len(moved) and moved[k + 1][0] in issue_after and \
                        issue_after[moved[k + 1][0]] == j:
                    k += 1
                moved.insert(k + 1, next(op for op in ops if op[0] == i))
            ops = moved
        sync_before = {int(c): [int(o) for o in offs] for c, offs in timing.get("sync_before", [])}
        for i, kind, s in ops:
            if s > L:
                raise InvalidPlanError(f"op {i} ({kind} {s}): stage out of range for a chain of "
                                       f"{L} blocks plus the loss", i)
        first_b = next((k for k, (_, kind, _) in enumerate(ops) if kind == "B"), None)
        if first_b is None:
            raise InvalidPlanError("plan has no backward op", None)
        i_b, _, s_b = ops[first_b]
        if s_b != L:
            raise InvalidPlanError(f"op {i_b}: the first backward must be B {L} (the loss), "
                                   f"got B {s_b}", i_b)
        fwd, bwd = ops[:first_b], ops[first_b:]
        expect = 0
        for i, kind, s in fwd:
            if kind in FORWARD_KINDS:
                if s != expect:
                    raise InvalidPlanError(
                        f"op {i} ({kind} {s}): before the loss's backward each stage must run "
                        f"once, in order; expected a forward of stage {expect}", i)
                expect += 1
        if expect != L + 1:
            raise InvalidPlanError(f"the forward phase runs stages 0..{expect - 1}, "
                                   f"not 0..{L}", first_b)
        counts: Dict[int, int] = {}
        for _, kind, s in ops:
            if kind in FORWARD_KINDS:
                counts[s] = counts.get(s, 0) + 1
        recomputed = {s for s, c in counts.items() if c > 1 and s < L}
        release: Dict[int, int] = {}
        for k, (i, kind, s) in enumerate(ops):
            if kind != "offload":
                continue
            last = i
            for n in range(k + 1, len(ops)):
                j, kind2, s2 = ops[n]
                if s2 != s:
                    continue
                if kind2 in FORWARD_KINDS or kind2 == "B":  # (B s reads its input too)
                    last = j
                if kind2 in ("prefetch", "offload", "B"):
                    break
            release[i] = last
        # (its backward ops B L .. B 0 in order: the runtime checks the order only where the
        # step follows the plan's backward, which such a step leaves to autograd)
        keeps = not recomputed and all(kind == "F_all" for _, kind, s in fwd if s < L) and \
            [(kind, s) for _, kind, s in bwd] == [("B", s) for s in range(L, -1, -1)]
        return cls(plan, L, fwd, bwd, recomputed, release, sync_before, keeps)


def transfer_timing(sim: Any) -> Dict[str, List[Any]]:
    """What the runtime must add to follow a memory-limited simulation of a plan with
    transfers (``simulate(..., memory=budget)``, how pofo predicts its peak): prefetches the
    simulator starts only after a later compute op ended (it waited for memory) are issued
    after that op, and a compute op the simulator starts after an offload completed waits
    for that copy (so the memory it frees can really be reused)."""
    steps = sim.steps
    compute = [st for st in steps if st.kind not in ("offload", "prefetch")]
    issue_after, sync_before = [], []
    for st in steps:
        if st.kind != "prefetch":
            continue
        done = [c.index for c in compute if c.end <= st.start * (1 + 1e-12) + 1e-15]
        if done and max(done) > st.index:
            issue_after.append([st.index, max(done)])
    offloads = [st for st in steps if st.kind == "offload"]
    for c in compute:
        offs = [o.index for o in offloads if o.index < c.index and
                o.end <= c.start * (1 + 1e-12) + 1e-15]
        if offs:
            sync_before.append([c.index, offs])
    return {"issue_after": issue_after, "sync_before": sync_before}
