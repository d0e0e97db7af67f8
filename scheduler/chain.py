"""The chain model shared by every planner (seeds 000, 001, 002; DESIGN.md "The chain model").

A chain has L stages plus the loss, indexed ``s = 0 .. L`` (stage ``L`` is the loss); every
field is a sequence of length ``L + 1``. Times are seconds, sizes bytes.

==========  ==========================================================================
``fw``      forward time of stage s (u_F)
``bw``      backward time of stage s (u_B)
``x``       size of the input activation of stage s (``x[0]`` is the network input)
``xbar``    size of all the forward of stage s keeps for its backward, output included
            (``xbar[s] >= x[s+1]`` on profiled chains; a smaller one is taken as given, not
            refused: the input of stage s+1 held as ``xbar[s]`` then counts ``xbar[s]``)
``delta``   size of the gradient w.r.t. ``x[s]`` (made by B s, consumed by B s-1)
``fw_tmp``  transient memory of the forward of stage s that keeps xbar[s] (F_all)
``bw_tmp``  transient memory of the backward of stage s
``fck_tmp`` transient memory of a forward of stage s that keeps nothing for the backward
            (F_ck, F_none); defaults to ``fw_tmp``. The two differ on real models: a saving
            forward's intermediates are in xbar, a no-grad one frees them as it goes, but its
            largest (attention scores, say) are transient on top of what is stored.
==========  ==========================================================================
"""
from __future__ import annotations

import json
import math
import os
import random as _random
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Sequence, Tuple, Union

Number = float  # ints stay ints: exact integer chains are how the DPs are tested

FIELDS: Tuple[str, ...] = ("fw", "bw", "x", "xbar", "delta", "fw_tmp", "bw_tmp", "fck_tmp")
OPTIONAL: Tuple[str, ...] = ("fw_tmp", "bw_tmp", "fck_tmp")  # may be left empty


def _plain(values: Tuple[Any, ...]) -> bool:
    """All plain ints and floats, finite and non-negative: the common case, checked in a few
    C-speed passes (a chain is made per new shape when plans are predicted); anything else
    takes the per-value path below, which names the bad value."""
    types = set(map(type, values))
    if not types <= {int, float}:
        return False
    if not values:
        return True
    try:  # a NaN or infinity makes the sum one; an overflow (an int past float's range,
        # 10**400) just takes the slow path, which names it
        return min(values) >= 0 and math.isfinite(
            sum(values) if float in types else float(max(values)))
    except OverflowError:
        return False


def float_or_none(value: Any) -> Optional[float]:
    """``float(value)``, or None past float's range (an int such as 10**400). (Here, the lowest
    module, for the chain's checks; ``units`` serves it to the rest.)"""
    try:
        return float(value)
    except OverflowError:
        return None


def _sized(values: Any) -> bool:
    """Has a length: a 0-d numpy array has ``__len__`` but ``len()`` refuses it."""
    try:
        len(values)
    except TypeError:
        return False
    return True


def _as_tuple(name: str, values: Sequence[Any]) -> Tuple[Number, ...]:
    if isinstance(values, (str, bytes)) or not _sized(values):
        raise ValueError(f"Chain.{name}: expected a sequence of numbers, got {values!r}")
    fast = tuple(values)
    if _plain(fast):
        return fast
    out = []
    for s, given in enumerate(values):
        v = given
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            item = getattr(v, "item", None)  # numpy scalars and the like
            v = item() if callable(item) else None
            # (what .item() gives must be a number too: numpy's strings and bools are not)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"Chain.{name}[{s}]: expected a number, got {given!r}")
        # (an int is finite however large: math.isfinite would overflow converting it)
        if (isinstance(v, float) and not math.isfinite(v)) or v < 0:
            raise ValueError(f"Chain.{name}[{s}]: must be finite and non-negative, got {v!r}")
        if isinstance(v, int) and float_or_none(v) is None:  # the planners sum them as floats
            raise ValueError(f"Chain.{name}[{s}]: an int of {v.bit_length()} bits is too "
                             f"large for a float (at most about 1.8e308)")
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class Chain:
    """Per-stage times and sizes of a sequential network (the planners' common input)."""

    fw: Tuple[Number, ...]
    bw: Tuple[Number, ...]
    x: Tuple[Number, ...]
    xbar: Tuple[Number, ...]
    delta: Tuple[Number, ...]
    fw_tmp: Tuple[Number, ...] = ()
    bw_tmp: Tuple[Number, ...] = ()
    name: str = ""
    meta: Dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    fck_tmp: Tuple[Number, ...] = ()  # last: positional construction keeps its old meaning

    def __post_init__(self) -> None:
        for name in FIELDS:
            raw = getattr(self, name)
            if isinstance(raw, (str, bytes, dict)) or not _sized(raw):
                raise ValueError(f"Chain.{name}: expected a sequence of numbers, got {raw!r:.80}")
        if not isinstance(self.name, str):
            raise ValueError(f"Chain.name: expected a string, got {self.name!r:.80}")
        n = len(self.fw)
        if n < 1:
            raise ValueError(f"Chain.fw: need at least the loss stage (length >= 1), got {self.fw!r}")
        for name in FIELDS:
            raw = getattr(self, name)
            if name == "fck_tmp" and len(raw) == 0:
                raw = self.fw_tmp  # one transient for every forward (resolved just before)
            elif name in OPTIONAL and len(raw) == 0:
                raw = (0,) * n  # no transient memory given
            values = _as_tuple(name, raw)
            if len(values) != n:
                raise ValueError(
                    f"Chain.{name}: length {len(values)} but fw has length {n} "
                    f"(every field has one entry per stage s = 0..L, the loss included)")
            object.__setattr__(self, name, values)

    # ----------------------------------------------------------------------------- shape
    @property
    def L(self) -> int:
        """Number of stages before the loss."""
        return len(self.fw) - 1

    def __len__(self) -> int:
        return len(self.fw)

    @property
    def is_integer(self) -> bool:
        """All sizes are integers (what exact-slot DPs and exact tests need)."""
        # per distinct type, not per value (checked for every plan rotor makes)
        return all(issubclass(t, int) for f in FIELDS[2:] for t in set(map(type, getattr(self, f))))

    def total_compute(self) -> Number:
        """Forward plus backward time, each stage once: no schedule is faster."""
        return sum(self.fw) + sum(self.bw)

    # ------------------------------------------------------------------------ JSON I/O
    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {f: list(getattr(self, f)) for f in FIELDS}
        if self.fck_tmp == self.fw_tmp:
            del d["fck_tmp"]  # the default: files written before the field read the same
        d["name"] = self.name
        if self.meta:
            d["meta"] = self.meta
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Chain":
        if not isinstance(d, dict):
            raise ValueError(f"Chain: expected a JSON object, got {type(d).__name__}")
        if not isinstance(d.get("meta", {}), dict):
            raise ValueError(f"Chain.meta: expected an object, got {d['meta']!r:.80}")
        unknown = set(d) - set(FIELDS) - {"name", "meta"}
        if unknown:
            raise ValueError(f"Chain: unknown field(s) {sorted(unknown)}")
        missing = [f for f in ("fw", "bw", "x", "xbar", "delta") if f not in d]
        if missing:
            raise ValueError(f"Chain: missing field(s) {missing}")
        return cls(**{k: d[k] for k in d if k != "meta"}, meta=dict(d.get("meta", {})))

    def to_json(self, path: Optional[Union[str, "os.PathLike[str]"]] = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: Union[str, "os.PathLike[str]"]) -> "Chain":
        is_path = isinstance(text_or_path, os.PathLike)  # a pathlib.Path is always a path
        if is_path:
            text_or_path = os.fsdecode(os.fspath(text_or_path))
        if not isinstance(text_or_path, str):
            raise ValueError(f"Chain.from_json: expected JSON text or a path, got "
                             f"{type(text_or_path).__name__}")
        text, source = text_or_path, "text"
        # a string is a path when it names a file ('[run1]chain.json'), else JSON text when it
        # starts like JSON, else a path to report as unreadable
        if is_path or os.path.isfile(text_or_path) or \
                not text_or_path.lstrip().startswith(("{", "[")):
            source = text_or_path
            try:
                with open(text_or_path) as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"Chain.from_json: cannot read {text_or_path!r} "
                                 f"({exc.strerror if isinstance(exc, OSError) else exc})") from None
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"Chain.from_json: {source if source != 'text' else 'the text'} is "
                             f"not JSON ({exc})") from None
        return cls.from_dict(d)

    # ------------------------------------------------------------------------ helpers
    @classmethod
    def random(cls, L: int, seed: int = 0, max_size: int = 10, max_time: int = 10,
               tmp: bool = True, split_tmp: bool = False) -> "Chain":
        """A random chain of integer times and sizes (for tests and benchmarks); with
        ``split_tmp`` the no-grad forwards' transient ``fck_tmp`` is drawn on its own (else it
        is ``fw_tmp``; drawn last, so a seed gives the same other fields either way)."""
        if not isinstance(L, int) or L < 0:
            raise ValueError(f"Chain.random: L must be a non-negative int, got {L!r}")
        rng = _random.Random(seed)
        n = L + 1

        def ints(lo: int, hi: int) -> Tuple[int, ...]:
            return tuple(rng.randint(lo, hi) for _ in range(n))

        x = ints(1, max_size)
        # what a forward keeps includes its output, so xbar[s] >= x[s+1]
        xbar = tuple(max(rng.randint(1, 2 * max_size), x[s + 1] if s < L else 0)
                     for s in range(n))
        fw, bw = ints(1, max_time), ints(1, 2 * max_time)
        fw_tmp = ints(0, max_size // 2) if tmp else (0,) * n
        bw_tmp = ints(0, max_size // 2) if tmp else (0,) * n
        fck_tmp = ints(0, max_size) if split_tmp else ()
        return cls(fw=fw, bw=bw, x=x, xbar=xbar, delta=x, fw_tmp=fw_tmp, bw_tmp=bw_tmp,
                   fck_tmp=fck_tmp, name=f"random-L{L}-seed{seed}")

    def replace(self, **changes: Any) -> "Chain":
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if "fw_tmp" in changes and "fck_tmp" not in changes and self.fck_tmp == self.fw_tmp:
            d["fck_tmp"] = ()  # it was the default: it follows fw_tmp
        d.update(changes)
        return Chain(**d)


def add_outside(chain: Chain, forward: int, backward_extra: int = 0) -> Chain:
    """``chain`` with ``forward`` bytes held outside it during every op, and
    ``backward_extra`` more during every backward op (tied weights' gradients), added to the
    transients; ``meta["outside"]`` says how much in all (added to what was there). Memory a
    training step holds beside the chain's items (masks passed to every block, what the
    model's head saved, the gradients of tied weights): the chain has no item for it, and
    some op always runs, so every op's transient carries it."""
    L = chain.L
    cols = {}
    for k, extra in (("fw_tmp", forward), ("fck_tmp", forward),
                     ("bw_tmp", forward + backward_extra)):
        col = list(getattr(chain, k)) or [0] * (L + 1)  # a chain without tmp columns
        cols[k] = [v + extra for v in col]
    was = chain.meta.get("outside", {})
    fwd = was.get("forward", 0) + forward
    tied = was.get("tied_grads", 0) + backward_extra
    meta = dict(chain.meta, outside={"forward": fwd, "backward": fwd + tied, "tied_grads": tied,
                                     "added_to": ["fw_tmp", "fck_tmp", "bw_tmp"]})
    return chain.replace(meta=meta, **cols)
