"""Mimose's estimator (seed 004 section 4.3) and its chain-wide sibling: what a step will
hold, predicted from the input size alone. No torch here; the shuttling collector that feeds
it lives in ``scheduler.runtime.mimose_collector``, the planner that reads it in
:mod:`~scheduler.planners.mimose`.

- ``Estimator``: per block, an order-2 polynomial (numpy ``polyfit``) of the activation bytes
  (and output bytes, forward time) against the input size, fitted on about 10 samples
  (seed 004 section 4.3, Tables 3-4). ``predict(input_size)`` gives per-block bytes;
  ``chain_from_estimate`` turns an ``estimate`` into the ``Chain`` the simulator checks
  Mimose's plans on.
- ``ChainEstimator``: the same fits for every field of a whole ``Chain`` (fw, bw, x, xbar,
  delta, transients) per stage, learnt from chains measured on the first samples; predicts
  the chain of an input size never measured, for rotor or pofo (issue 13 item 4; the torch
  side is ``scheduler.runtime.input_aware.InputAwareChain``).
- ``PolyFit``: the fits both share.

The model's tail (final norm, LM head, loss: the chain's stage L) is learnt beside the blocks
when the runtime measures it (``scheduler.checkpoint``'s ``TailProbe`` on each collection
step): its saved bytes, transients and times (``TAIL_FIELDS``) get the same fits, and the
estimated chain's stage L carries them, so a plan's verified peak counts the logits and the
loss's saved log-softmax that are live at the end of the forward. Without a measurement
(``scheduler.wrap``, or a tail that could not be measured) the loss stage is free.

The blocks' transients (``BLOCK_TMP_FIELDS``: the chain's ``fw_tmp``, ``bw_tmp``,
``fck_tmp``), when the collector measured them (the profiler's per-stage measurement, on
each collection step), get the same fits and go into the estimated chain, so the verified
peak counts what a block's backward (and forward) holds beyond the stored values. Samples
with and without them are never mixed (``Estimator.observe`` raises).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..chain import FIELDS as CHAIN_FIELDS, Chain, add_outside
from ..units import float_or_none, shown

__all__ = ["DEFAULT_SAMPLES", "ORDER", "REACH", "BACKWARD_OVER_FORWARD", "TAIL_FIELDS", "OUTSIDE_FIELDS",
           "BLOCK_TMP_FIELDS", "Estimate", "PolyFit", "Estimator", "ChainEstimator",
           "chain_from_estimate"]

DEFAULT_SAMPLES = 10   # seed 004 Table 3: 10 samples for the order-2 fit
ORDER = 2
# how far beyond the largest size measured a fit is trusted: a block's backward transients are
# the largest of several terms, and at short lengths the quadratic one (attention's scores)
# hides below a linear one, so a fit learnt on lengths 8-44 predicted a fifth of BERT's
# bw_tmp at length 800 (steps at 1.2x their budget); a size further out is measured first
REACH = 1.5
BACKWARD_OVER_FORWARD = 2.0  # the collector times forwards only; backward ~ 2x forward
# the tail's numbers an Estimator learns (stage L of the chain; bytes, seconds)
TAIL_FIELDS = ("xbar", "fw_tmp", "bw_tmp", "fw", "bw")
# what a step holds outside the chain (bytes): during every op, and more during every
# backward op (the gradients of tail weights tied to the head's); see chain.add_outside
OUTSIDE_FIELDS = ("forward", "tied_grads")
# each block's transients (bytes; the chain fields of the same names, see chain.py), when
# the collector measured them (``scheduler.checkpoint`` and ``wrap``'s collection steps)
BLOCK_TMP_FIELDS = ("fw_tmp", "bw_tmp", "fck_tmp")


@dataclass
class Estimate:
    """Per-block predictions for one input size (bytes and seconds)."""
    input_bytes: float
    xbar: np.ndarray    # what each block's forward keeps for backward, output included
    out: np.ndarray     # each block's output bytes
    fw: np.ndarray      # each block's forward time
    tail: Optional[np.ndarray] = None   # the model's tail, TAIL_FIELDS (None: not measured)
    outside: Optional[np.ndarray] = None  # OUTSIDE_FIELDS (None: not measured)
    # each block's transients, BLOCK_TMP_FIELDS -> one entry per block (None: not measured)
    tmp: Optional[Dict[str, np.ndarray]] = None


class PolyFit:
    """Order-``order`` polynomial fits of a vector of non-negative values against one input
    size (numpy ``polyfit`` on sizes scaled to <= 1, one fit per vector entry), from the rows
    observed per distinct size. Shared by Mimose's ``Estimator`` and ``ChainEstimator``."""

    def __init__(self, width: int, samples: int = DEFAULT_SAMPLES, order: int = ORDER,
                 name: str = "Estimator"):
        if not isinstance(samples, int) or samples < order + 1:
            raise ValueError(f"{name}: samples must be an int >= {order + 1} (an order-{order}"
                             f" fit needs that many distinct sizes), got {samples!r}")
        self.width = width
        self.samples = samples
        self.order = order
        self.name = name
        self._rows: Dict[float, np.ndarray] = {}
        self._coef: Optional[np.ndarray] = None
        self._scale = 1.0

    def observe(self, input_size: float, row: np.ndarray) -> None:
        """Record the row of one input size (the latest measurement of a size wins)."""
        self._rows[size_arg(input_size, f"{self.name}.observe")] = row
        self._coef = None

    @property
    def sizes(self) -> List[float]:
        return sorted(self._rows)

    @property
    def ready(self) -> bool:
        """Enough distinct sizes seen to fit (``samples`` of them)."""
        return len(self._rows) >= self.samples

    def has(self, input_size: float) -> bool:
        return float(input_size) in self._rows

    def row(self, input_size: float) -> Optional[np.ndarray]:
        return self._rows.get(float(input_size))

    def fit(self) -> None:
        if len(self._rows) < self.order + 1:
            raise ValueError(f"{self.name}.fit: {len(self._rows)} distinct input sizes seen, an "
                             f"order-{self.order} fit needs {self.order + 1}")
        xs = np.array(self.sizes)
        self._scale = float(xs.max())  # fit on sizes scaled to <= 1: well conditioned
        ys = np.stack([self._rows[x] for x in self.sizes])
        order = min(self.order, len(xs) - 1)
        coef = np.polyfit(xs / self._scale, ys, order)          # (order+1, width)
        if order < self.order:
            coef = np.vstack([np.zeros((self.order - order, coef.shape[1])), coef])
        self._coef = coef

    def eval(self, input_size: float) -> np.ndarray:
        if self._coef is None:
            self.fit()
        u = float(input_size) / self._scale
        with np.errstate(over="ignore", invalid="ignore"):   # (said below, by name)
            values = u ** np.arange(self.order, -1, -1) @ self._coef
        if not np.isfinite(values).all():   # a size so far out that its powers overflow
            raise ValueError(f"{self.name}: the fit is not finite at input size {input_size!r}, "
                             f"far beyond the sizes observed ({min(self._rows):g} to "
                             f"{max(self._rows):g})")
        return np.maximum(values, 0.0)


def size_arg(input_size: Any, where: str) -> float:
    """An input size as a float: a positive finite number (the fits only know those; an
    infinite one fits NaNs and every later fit fails)."""
    size = float_or_none(input_size) if not isinstance(input_size, bool) and \
        isinstance(input_size, numbers.Real) else None   # (None past float's range too)
    if size is None or not 0 < size < math.inf:
        raise ValueError(f"{where}: input_size must be a positive number, got "
                         f"{shown(input_size)}")
    return size


def _check_measured(input_size: float, name: str, values: Sequence[Any], sizes: bool) -> None:
    """Each of ``values`` a finite number (and, where ``sizes``, >= 0: bytes and times), else
    a ``ValueError`` naming ``name`` and the entry: a NaN or inf would poison the fits and
    fail far away, when a chain is made from them."""
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError, OverflowError):
            f = math.nan
        if isinstance(v, bool) or not math.isfinite(f) or (sizes and f < 0):
            raise ValueError(f"Estimator.observe: measurements at input size {input_size!r} "
                             f"must be finite, and bytes and times >= 0; got {name}[{i}]="
                             f"{shown(v)} ({name}={shown(list(values), 80)})")


class _Fitted:
    """What both estimators answer straight from their ``PolyFit`` (``self._fit``)."""

    _fit: PolyFit

    @property
    def sizes(self) -> List[float]:
        return self._fit.sizes

    @property
    def ready(self) -> bool:
        """Enough distinct sizes seen to fit (``samples`` of them)."""
        return self._fit.ready

    def has(self, input_size: float) -> bool:
        return self._fit.has(input_size)

    def covers(self, input_size: float) -> bool:
        """Whether ``input_size`` is planned without measuring it: measured already, or the
        fit is ready and the size is at most ``REACH`` times the largest one measured."""
        return self.has(input_size) or \
            (self.ready and float(input_size) <= REACH * max(self._fit.sizes))


class Estimator(_Fitted):
    """Order-2 polynomial fits per block of activation bytes, output bytes and forward time
    (and, when measured, the block's transients) against the input size (number of elements
    of the input tensor, as in seed 004 3.1)."""

    def __init__(self, n_blocks: int, samples: int = DEFAULT_SAMPLES, order: int = ORDER):
        if not isinstance(n_blocks, int) or n_blocks < 1:
            raise ValueError(f"Estimator: n_blocks must be a positive int, got {n_blocks!r}")
        self.n = n_blocks
        # [in, xbar(n), out(n), fw(n), tail (TAIL_FIELDS), outside (OUTSIDE_FIELDS),
        #  fw_tmp(n), bw_tmp(n), fck_tmp(n) (BLOCK_TMP_FIELDS)]
        self._fit = PolyFit(1 + 3 * n_blocks + len(TAIL_FIELDS) + len(OUTSIDE_FIELDS) +
                            len(BLOCK_TMP_FIELDS) * n_blocks, samples, order)
        self.samples = samples
        self.order = order
        self.with_tmp: Optional[bool] = None  # whether the samples carry the transients

    def observe(self, input_size: float, input_bytes: float, xbar: Sequence[float],
                out: Sequence[float], fw: Sequence[float],
                tail: Optional[Sequence[float]] = None,
                outside: Optional[Sequence[float]] = None,
                tmp: Optional[Dict[str, Sequence[float]]] = None) -> None:
        """Record one measured input size (the latest measurement of a size wins).
        ``tail``: the model's tail measured on it, ``TAIL_FIELDS`` in order; ``outside``:
        what the step held outside the chain, ``OUTSIDE_FIELDS`` (None: zeros); ``tmp``:
        each block's transients, ``BLOCK_TMP_FIELDS`` -> one value per block (None: not
        measured, the estimated chain's are then zero). Samples with and without ``tmp``
        are never mixed (the fits would learn zeros): that raises ``ValueError``."""
        size_arg(input_size, "Estimator.observe")
        for name, v in (("xbar", xbar), ("out", out), ("fw", fw)):
            if len(v) != self.n:
                raise ValueError(f"Estimator.observe: {name} has {len(v)} entries, expected "
                                 f"one per block ({self.n})")
        for name, v, want in (("tail", tail, TAIL_FIELDS), ("outside", outside, OUTSIDE_FIELDS)):
            if v is not None and len(v) != len(want):
                raise ValueError(f"Estimator.observe: {name} has {len(v)} entries, expected "
                                 f"{len(want)} ({', '.join(want)})")
        # every value finite (sizes and times >= 0), the bad one named, before any fit sees it
        measured = [("input_bytes", [input_bytes], True), ("xbar", xbar, True),
                    ("out", out, True), ("fw", fw, True), ("tail", tail, False),
                    ("outside", outside, False)]
        if isinstance(tmp, dict):
            measured += [(f"tmp[{k!r}]", tmp[k], False) for k in BLOCK_TMP_FIELDS if k in tmp]
        for name, v, sizes in measured:
            if v is not None:
                _check_measured(input_size, name, v, sizes)
        extra = [np.zeros(len(want)) if v is None else np.asarray(v, float)
                 for v, want in ((tail, TAIL_FIELDS), (outside, OUTSIDE_FIELDS))]
        extra.append(self._tmp_row(input_size, tmp))
        row = np.concatenate([[float(input_bytes)], np.asarray(xbar, float),
                              np.asarray(out, float), np.asarray(fw, float)] + extra)
        self._fit.observe(input_size, row)
        self.with_tmp = tmp is not None

    def _tmp_row(self, input_size: float, tmp: Optional[Dict[str, Sequence[float]]]
                 ) -> np.ndarray:
        others = [x for x in self._fit.sizes if x != float(input_size)]
        if others and self.with_tmp is not None and self.with_tmp != (tmp is not None):
            raise ValueError(
                f"Estimator.observe: the {len(others)} sample(s) so far "
                f"{'carry' if self.with_tmp else 'do not carry'} the blocks' transients "
                f"({', '.join(BLOCK_TMP_FIELDS)}) and this one (size {input_size:g}) "
                f"{'does not' if self.with_tmp else 'does'}; the fits would mix measured "
                "transients with zeros")
        if tmp is None:
            return np.zeros(len(BLOCK_TMP_FIELDS) * self.n)
        if not isinstance(tmp, dict) or set(tmp) != set(BLOCK_TMP_FIELDS):
            raise ValueError(f"Estimator.observe: tmp must map exactly "
                             f"{', '.join(BLOCK_TMP_FIELDS)} to per-block values, got "
                             f"{tmp!r:.80}")
        for k in BLOCK_TMP_FIELDS:
            if len(tmp[k]) != self.n:
                raise ValueError(f"Estimator.observe: tmp[{k!r}] has {len(tmp[k])} entries, "
                                 f"expected one per block ({self.n})")
        return np.concatenate([np.asarray(tmp[k], float) for k in BLOCK_TMP_FIELDS])

    def fit(self) -> None:
        self._fit.fit()

    def _estimate(self, row: np.ndarray) -> Estimate:
        n, k = self.n, 1 + 3 * self.n + len(TAIL_FIELDS)
        j = k + len(OUTSIDE_FIELDS)
        tail = np.maximum(row[1 + 3 * n:k], 0.0)   # a fit may dip below 0 between samples
        outside = np.maximum(row[k:j], 0.0)
        tmp = None
        if self.with_tmp:
            tmp = {f: np.maximum(row[j + i * n:j + (i + 1) * n], 0.0)
                   for i, f in enumerate(BLOCK_TMP_FIELDS)}
        return Estimate(row[0], row[1:1 + n], row[1 + n:1 + 2 * n], row[1 + 2 * n:1 + 3 * n],
                        tail if tail.any() else None, outside if outside.any() else None, tmp)

    def predict(self, input_size: float) -> np.ndarray:
        """Per-block activation bytes (xbar) for ``input_size``."""
        return self._fit.eval(input_size)[1:1 + self.n]

    def estimate(self, input_size: float) -> Estimate:
        return self._estimate(self._fit.eval(input_size))

    def measured(self, input_size: float) -> Optional[Estimate]:
        row = self._fit.row(input_size)
        return None if row is None else self._estimate(row)

    def relative_error(self, input_size: float, actual_xbar: Sequence[float]) -> float:
        """|predicted - actual| / actual of the total activation bytes."""
        pred = float(self.predict(input_size).sum())
        act = float(np.sum(actual_xbar))
        return abs(pred - act) / act if act else abs(pred)


class ChainEstimator(_Fitted):
    """A whole ``Chain`` predicted for an input size never measured (issue 13 item 4).

    Learns, per stage, every chain field (forward and backward time, x, xbar, delta, forward
    and backward transients) against the input size with the same order-2 fits as Mimose's
    ``Estimator``, from the chains measured on the first ``samples`` distinct sizes; after
    that, ``predict(size)`` is a few numpy operations, so a new shape is planned by rotor or
    pofo on the prediction instead of profiling again. Sizes are rounded up to whole bytes
    (integer chains, as measured), and ``xbar[s] >= x[s+1]`` is kept (a forward keeps its
    output)."""

    def __init__(self, L: int, samples: int = DEFAULT_SAMPLES, order: int = ORDER):
        if not isinstance(L, int) or L < 1:
            raise ValueError(f"ChainEstimator: L (stages before the loss) must be a positive "
                             f"int, got {L!r}")
        self.L = L
        self._fit = PolyFit(len(CHAIN_FIELDS) * (L + 1), samples, order, "ChainEstimator")
        self._chains: Dict[float, Chain] = {}

    def observe(self, input_size: float, chain: Chain) -> None:
        """Record the chain measured on one input size."""
        if not isinstance(chain, Chain) or chain.L != self.L:
            raise ValueError(f"ChainEstimator.observe: expected a Chain of {self.L} stages, got "
                             f"{chain!r:.80}")
        self._fit.observe(input_size, np.array(
            [v for f in CHAIN_FIELDS for v in getattr(chain, f)], dtype=float))
        self._chains[float(input_size)] = chain

    def measured(self, input_size: float) -> Optional[Chain]:
        return self._chains.get(float(input_size))

    def predict(self, input_size: float, name: str = "") -> Chain:
        """The chain for ``input_size``: the measured one when this size was measured, else
        the fits' prediction."""
        hit = self._chains.get(float(input_size))
        if hit is not None:
            return hit
        row = self._fit.eval(input_size).reshape(len(CHAIN_FIELDS), self.L + 1)
        sizes = np.ceil(row[2:]).astype(np.int64)            # CHAIN_FIELDS[2:]: x, xbar, ...; bytes
        sizes[1, :-1] = np.maximum(sizes[1, :-1], sizes[0, 1:])  # xbar[s] >= x[s+1]
        fields = {"fw": row[0].tolist(), "bw": row[1].tolist()}
        fields.update({f: sizes[k].tolist() for k, f in enumerate(CHAIN_FIELDS[2:])})
        return Chain(**fields, name=name or f"predicted-size{input_size:g}",
                     meta={"source": "ChainEstimator", "input_size": float(input_size),
                           "samples": len(self._chains)})

    def relative_error(self, input_size: float, actual: Chain) -> Dict[str, float]:
        """Per field, |predicted - actual| / actual of the field's total over the stages."""
        pred = self.predict(input_size) if not self.has(input_size) else None
        if pred is None:  # a measured size: predict it from the fit all the same
            row = self._fit.eval(input_size).reshape(len(CHAIN_FIELDS), self.L + 1)
            got = {f: float(row[k].sum()) for k, f in enumerate(CHAIN_FIELDS)}
        else:
            got = {f: float(sum(getattr(pred, f))) for f in CHAIN_FIELDS}
        out = {}
        for f in CHAIN_FIELDS:
            act = float(sum(getattr(actual, f)))
            out[f] = abs(got[f] - act) / act if act else abs(got[f])
        return out


def chain_from_estimate(est: Estimate, name: str = "mimose-estimate") -> Chain:
    """A Chain (integer bytes) from per-block estimates; the blocks' transients are
    ``est.tmp`` (zero when not measured); the loss stage is the estimated tail
    (``est.tail``), or free when it was not measured; what the step holds outside the chain
    (``est.outside``) is in every op's transient (``chain.add_outside``)."""
    n = len(est.xbar)
    out = [int(np.ceil(v)) for v in est.out]
    x = [int(np.ceil(est.input_bytes))] + out            # x[s+1] = output of block s
    xbar = [max(int(np.ceil(v)), out[s]) for s, v in enumerate(est.xbar)] + [0]
    fw = [float(v) for v in est.fw] + [0.0]
    bw = [BACKWARD_OVER_FORWARD * v for v in fw]
    tmp: Dict[str, List[int]] = {}
    if est.tail is not None or est.tmp is not None:
        t = dict(zip(TAIL_FIELDS, (float(v) for v in est.tail))) if est.tail is not None \
            else {}
        if est.tail is not None:
            xbar[n], fw[n], bw[n] = int(np.ceil(t["xbar"])), t["fw"], t["bw"]
        t["fck_tmp"] = t.get("fw_tmp", 0.0)  # the loss runs as F_all (as runtime.tail says)
        blocks = est.tmp or {}
        tmp = {k: [int(np.ceil(v)) for v in blocks.get(k, np.zeros(n))] +
               [int(np.ceil(t.get(k, 0.0)))] for k in BLOCK_TMP_FIELDS}
    chain = Chain(fw=fw, bw=bw, x=x, xbar=xbar, delta=list(x), name=name, **tmp,
                  meta={"source": "mimose estimator", "blocks": n,
                        "tail": "estimated" if est.tail is not None else "not measured",
                        "transients": "estimated" if est.tmp is not None else
                        "not measured"})
    if est.outside is None:
        return chain
    forward, tied = (int(np.ceil(v)) for v in est.outside)
    return add_outside(chain, forward, tied)
