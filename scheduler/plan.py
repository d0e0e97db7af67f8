"""One plan format that every planner emits (DESIGN.md "Plans").

``Plan.ops`` is a list of ``(kind, s)``: ``kind`` one of ``F_all``, ``F_ck``, ``F_none``,
``B``, ``offload``, ``prefetch``; ``s`` a stage index. ``offload s`` / ``prefetch s`` move
what is stored as the input of stage ``s``, whole, or in chunks of ``Plan.transfer_chunk``
bytes (streamed transfers; see scheduler.simulate).

:func:`checkpoint_plan` builds the plan ``torch.utils.checkpoint`` runs for a set of
checkpointed blocks (Mimose's plans, the runtimes' store-all and every-block plans).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Set, TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .chain import Chain

# The order matters: the C++ DPs emit ops as indices into this tuple (csrc/dp/rotor.hpp's
# RotorKind: 0 F_all, 1 F_ck, 2 F_none, 3 B; csrc/dp/pofo_dp.hpp's Op::kind: the same, then
# 4 offload, 5 prefetch), and the planners decode them with it.
KINDS = ("F_all", "F_ck", "F_none", "B", "offload", "prefetch")
FORWARD_KINDS = ("F_all", "F_ck", "F_none")
TRANSFER_KINDS = ("offload", "prefetch")


def _check_op(kind: Any, stage: Any, where: str) -> None:
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"{where}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
        raise ValueError(f"{where}: stage must be a non-negative int, got {stage!r}")


class _OpFields(NamedTuple):
    kind: str
    stage: int


class Op(_OpFields):
    """One step of a plan; checked when made (a bad kind is named, not found later)."""

    __slots__ = ()

    def __new__(cls, kind: str, stage: int) -> "Op":
        _check_op(kind, stage, "Op")
        return super().__new__(cls, kind, stage)

    def __str__(self) -> str:
        return f"{self.kind} {self.stage}"


def _op(item: Any, index: int) -> Op:
    if type(item) is Op:  # checked when made (planners hand over their ops as Op)
        return item
    try:
        kind, stage = item
    except (TypeError, ValueError):
        raise ValueError(f"Plan.ops[{index}]: expected (kind, stage), got {item!r}") from None
    _check_op(kind, stage, f"Plan.ops[{index}]")
    return Op._make((kind, stage))  # (checked: not again in Op.__new__)


def _chunk(value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value <= 0 or value == float("inf"):
        raise ValueError(f"Plan.transfer_chunk: expected None or a positive finite number "
                         f"of bytes, got {value!r}")
    return value


def _bandwidth(value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value <= 0:
        raise ValueError(f"Plan.bandwidth: expected None or a positive number of bytes per "
                         f"second, got {value!r}")
    return value


_OWN: Any = object()  # describe()'s default: the plan's own bandwidth


def _limit(value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value < 0 or value == float("inf"):
        raise ValueError(f"Plan.memory_limit: expected None or a non-negative finite number "
                         f"of bytes, got {value!r}")
    return value


@dataclass
class Plan:
    """A schedule: the ops in order, who made it, and what it should cost."""

    ops: List[Op]
    planner: str = ""
    predicted_time: Optional[float] = None
    predicted_peak: Optional[float] = None
    meta: Dict[str, Any] = field(default_factory=dict)
    # the memory limit (bytes) it was planned for: scheduler.simulate enforces it unless
    # told otherwise (memory=None), so predicted_peak and the simulated peak agree
    memory_limit: Optional[float] = None
    # the chain it was planned for, so str() can show running memory; not part of identity
    chain: Optional["Chain"] = field(default=None, repr=False, compare=False)
    # None: a transfer moves its item whole (seed 000 assumption D: an offload frees it when
    # the copy ends, a prefetch reserves all of it when the copy starts). A number of bytes:
    # streamed transfers, our own extension: the copy runs in chunks of at most this size,
    # an offload frees each chunk when it is copied, a prefetch reserves each chunk when its
    # copy starts (what page-level mappings allow; see scheduler.simulate)
    transfer_chunk: Optional[float] = None
    # the host<->device bandwidth (bytes/s) its transfers were planned at: scheduler.simulate
    # uses it unless told otherwise, as it does memory_limit (None: no transfers planned)
    bandwidth: Optional[float] = None

    def __post_init__(self) -> None:
        self.ops = [_op(item, i) for i, item in enumerate(self.ops)]
        self.memory_limit = _limit(self.memory_limit)
        self.transfer_chunk = _chunk(self.transfer_chunk)
        self.bandwidth = _bandwidth(self.bandwidth)

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self):
        return iter(self.ops)

    def count(self, kind: str) -> int:
        return sum(1 for op in self.ops if op.kind == kind)

    @property
    def has_transfers(self) -> bool:
        """Whether any op is an offload or a prefetch (the plan needs a transfer channel)."""
        return any(op.kind in TRANSFER_KINDS for op in self.ops)

    def describe(self, chain: Optional["Chain"] = None, bandwidth: Any = _OWN) -> str:
        """One line per op; with a chain, the memory in use after each op and its end time
        (simulated at ``bandwidth``, by default the plan's own)."""
        chain = chain if chain is not None else self.chain
        head = f"Plan[{self.planner or '?'}] {len(self.ops)} ops"
        if self.predicted_time is not None:
            head += f", predicted time {self.predicted_time:g}"
        if self.predicted_peak is not None:
            head += f", predicted peak {self.predicted_peak:g}"
        if self.memory_limit is not None:
            head += f", limit {self.memory_limit:g}"
        if self.transfer_chunk is not None:
            head += f", transfers streamed in chunks of {self.transfer_chunk:g}"
        if self.bandwidth is not None:
            head += f", bandwidth {self.bandwidth:g} B/s"
        lines = [head]
        steps = None
        if chain is not None:
            from .simulate import simulate  # local: plan.py stays importable on its own
            bw = self.bandwidth if bandwidth is _OWN else bandwidth
            steps = simulate(chain, self, bandwidth=bw).steps
        for i, op in enumerate(self.ops):
            line = f"{i:5d}  {op.kind:<8} {op.stage:4d}"
            if steps is not None:
                st = steps[i]
                line += f"   mem {st.memory_after:>12g}   peak {st.peak:>12g}   end {st.end:>10g}"
            lines.append(line)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    # ------------------------------------------------------------------------ JSON I/O
    def to_dict(self) -> Dict[str, Any]:
        d = {"planner": self.planner, "predicted_time": self.predicted_time,
             "predicted_peak": self.predicted_peak, "memory_limit": self.memory_limit,
             "meta": self.meta,
             "ops": [[op.kind, op.stage] for op in self.ops]}
        if self.transfer_chunk is not None:  # whole transfers: the format stays as it was
            d["transfer_chunk"] = self.transfer_chunk
        if self.bandwidth is not None:  # (likewise for plans without transfers)
            # instantaneous transfers as "inf": strict JSON has no Infinity
            d["bandwidth"] = "inf" if math.isinf(self.bandwidth) else self.bandwidth
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Plan":
        if not isinstance(d, dict):
            raise ValueError(f"Plan: expected a JSON object, got {type(d).__name__}")
        if "ops" not in d:
            raise ValueError(f"Plan: missing field 'ops' (got fields {sorted(d)})")
        ops = d["ops"]
        if not isinstance(ops, list):
            raise ValueError(f"Plan.ops: expected a list of [kind, stage], got {ops!r:.80}")
        planner = d.get("planner", "")
        if not isinstance(planner, str):
            raise ValueError(f"Plan.planner: expected a string, got {planner!r:.80}")
        bandwidth = d.get("bandwidth")
        if bandwidth == "inf":
            bandwidth = math.inf
        for name in ("predicted_time", "predicted_peak", "memory_limit", "transfer_chunk",
                     "bandwidth"):
            v = bandwidth if name == "bandwidth" else d.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or v != v or v < 0):  # (NaN, a negative time or size)
                raise ValueError(f"Plan.{name}: expected a number >= 0 or null, got {v!r:.80}")
        meta = d.get("meta") or {}
        if not isinstance(meta, dict):
            raise ValueError(f"Plan.meta: expected an object, got {meta!r:.80}")
        return cls(ops=[o if not isinstance(o, list) else tuple(o) for o in ops],
                   planner=planner, predicted_time=d.get("predicted_time"),
                   predicted_peak=d.get("predicted_peak"), meta=dict(meta),
                   memory_limit=d.get("memory_limit"),
                   transfer_chunk=d.get("transfer_chunk"), bandwidth=bandwidth)

    def to_json(self) -> str:
        """The plan as strict JSON: a number JSON cannot hold (inf, NaN) is an error naming
        where it is, not an ``Infinity`` other parsers refuse."""
        d = self.to_dict()
        try:
            return json.dumps(d, allow_nan=False)
        except ValueError:
            raise ValueError(f"Plan.to_json: {_non_finite(d, 'plan')} is not finite, and "
                             "strict JSON has no Infinity or NaN (store None there)") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"Plan.from_json: not JSON ({exc})") from None
        return cls.from_dict(d)


def _non_finite(value: Any, where: str) -> str:
    """The path of the first non-finite float in a JSON-like ``value`` (``plan.meta.x``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} = {value!r}"
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, (list, tuple)) else ()
    for k, v in items:
        got = _non_finite(v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}")
        if got:
            return got
    return ""


def checkpointed_blocks(L: int, checkpointed: Iterable[int], where: str) -> Set[int]:
    """The set of checkpointed blocks of a chain of ``L`` blocks, each checked in 0..L-1."""
    ck = set(checkpointed)
    bad = [s for s in ck if not (isinstance(s, int) and 0 <= s < L)]
    if bad:
        raise ValueError(f"{where}: checkpointed blocks {bad} not in 0..{L - 1}")
    return ck


def checkpoint_plan(L: int, checkpointed: Iterable[int], planner: str = "mimose") -> Plan:
    """The plan ``torch.utils.checkpoint`` runs on a chain of ``L`` blocks and the loss
    (stage ``L``): checkpointed blocks ``F_ck`` in the forward, ``F_all`` right before their
    ``B``; the other blocks ``F_all``. No checkpointed block: the store-all plan."""
    if isinstance(L, bool) or not isinstance(L, int) or L < 0:  # (the ops below are made
        raise ValueError(f"checkpoint_plan: L must be a non-negative int, got {L!r}")  # from it)
    ck = checkpointed_blocks(L, checkpointed, "checkpoint_plan")
    op = Op._make  # (Mimose plans one per new input size: twice as fast unchecked)
    ops: List[Op] = [op(("F_ck" if s in ck else "F_all", s)) for s in range(L)]
    ops += [op(("F_all", L)), op(("B", L))]
    for s in range(L - 1, -1, -1):
        if s in ck:
            ops.append(op(("F_all", s)))
        ops.append(op(("B", s)))
    return Plan(ops=ops, planner=planner, meta={"checkpointed": sorted(ck)})
