"""The format of fragmentation reports: building, rendering (text) and saving/loading (JSON)
them, for the live report (``vmalloc.report()``), the exit report (``VMALLOC_REPORT``) and
trace replays (``vmalloc replay``, ``vmalloc demo``).

Internal fragmentation follows seed 003 section 4. A request of ``m_r`` bytes gets
``m_a = k * m_c`` bytes of mapped memory, ``k = ceil(m_r / m_c)``, so

* Eq. (1): ``IF = m_a - m_r < m_c`` per allocation, and
* Eq. (2): ``IF_max < N_max * m_c`` over a run, ``N_max`` the most variables live at once.

(The converted text prints Eq. (2) as "IFm ax < Nmax mc"; reconstructed as above from the
sentence around it.) For the whole allocator, IF is ``mapped - requested`` (the stats key
``internal_fragmentation``). The GMLake-style figure ``1 - peak requested / peak physical`` is
reported beside it so vmalloc and PyTorch's caching allocator compare on one scale.

A report is a plain dict (the JSON form); :func:`to_text` renders it, :func:`side_by_side`
renders several allocators' rows on one trace. This module builds, renders and files reports
from figures it is given; the live report of the running process (``vmalloc.report()``, its
sections such as ``"swap"`` from the swap runtime, contract 3, and the exit report) is
:mod:`vmalloc.pluggable.live_report`, and which process writes which report
:mod:`vmalloc.report_process`. (The module is not ``vmalloc.report``: that name is the
function ``vmalloc.report()``, DESIGN.md's API.)
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from .atomic_file import write_atomic
from .sizes import format_size

REPORT_VERSION = 1


# ---------------------------------------------------------------------------------------------
# building blocks


def histogram(sizes: Iterable[int]) -> List[Dict[str, int]]:
    """Allocation sizes in power-of-two bins ``[lo, 2*lo)`` (the first bin is ``[0, 512)``)."""
    bins: Dict[int, List[int]] = {}
    for s in sizes:
        lo = 0 if s < 512 else 1 << (int(s).bit_length() - 1)
        b = bins.setdefault(lo, [0, 0])
        b[0] += 1
        b[1] += int(s)
    return [{"lo": lo, "hi": 512 if lo == 0 else 2 * lo, "count": c, "bytes": n}
            for lo, (c, n) in sorted(bins.items())]


def eq1_internal_fragmentation(requested: int, chunk_size: int) -> int:
    """Seed 003 Eq. (1) for one request: ``ceil(m_r/m_c)*m_c - m_r`` (always < m_c)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: must be > 0, got {chunk_size}")
    return -(-requested // chunk_size) * chunk_size - requested


def eq2_bound(n_max: int, chunk_size: int) -> int:
    """Seed 003 Eq. (2): ``IF_max < N_max * m_c``."""
    return n_max * chunk_size


def _pair(stats: Mapping[str, Any], key: str) -> Dict[str, int]:
    return {"current": int(stats.get(f"{key}_current", 0)), "peak": int(stats.get(f"{key}_peak", 0))}


def _cache_hits(stats: Mapping[str, Any]) -> Optional[int]:
    """Mallocs served with no driver map (from a cached range, a slab's free block, the head of
    a larger cached range): every malloc but those that mapped chunks (``num_remaps``: a fresh
    range, or a new slab for a small block), so that it divides by ``num_malloc``. (The stats'
    ``num_cache_hits`` counts range acquisitions only, not the small mallocs a slab serves.)
    ``None`` for figures that do not say (PyTorch's own allocator's stats)."""
    if "num_remaps" not in stats:
        return None
    return max(0, int(stats.get("num_malloc", 0)) - int(stats["num_remaps"]))


def build(stats: Mapping[str, Any], *, source: str, device: Optional[int] = None,
          sizes: Optional[Sequence[int]] = None, if_peak: Optional[int] = None,
          n_max: Optional[int] = None, min_budget: Optional[int] = None,
          timeline: Optional[Mapping[str, Sequence[float]]] = None,
          sections: Optional[Mapping[str, Mapping[str, Any]]] = None,
          title: Optional[str] = None) -> Dict[str, Any]:
    """A report dict from an allocator's ``stats()`` and what else is known.

    ``source`` is ``"vmalloc"``, ``"torch-native"`` or an allocator name of a replay; ``sizes``
    the requested sizes of the allocations seen (histogram); ``if_peak`` / ``n_max`` the peak
    internal fragmentation and the most live allocations, when the history was tracked.
    """
    chunk = int(stats.get("chunk_size", 0) or 0)
    req = _pair(stats, "requested")
    phys = _pair(stats, "physical")
    frag: Dict[str, Any] = {
        "internal_current": int(stats.get("mapped_current", 0)) - req["current"],
        "ratio_physical_requested": (phys["peak"] / req["peak"]) if req["peak"] else None,
        "gmlake": (1 - req["peak"] / phys["peak"]) if phys["peak"] else None,
    }
    if if_peak is not None:
        frag["internal_peak"] = int(if_peak)
    if n_max is not None:
        frag["n_max"] = int(n_max)
        if chunk:
            frag["bound_eq2"] = eq2_bound(n_max, chunk)
            if if_peak is not None:
                frag["bound_holds"] = bool(if_peak < frag["bound_eq2"] or n_max == 0)
    rep: Dict[str, Any] = {
        "version": REPORT_VERSION,
        "title": title or source,
        "source": source,
        "device": device,
        "chunk_size": chunk,
        "budget": int(stats.get("budget", 0) or 0),
        "memory": {"requested": req, "mapped": _pair(stats, "mapped"), "physical": phys},
        "fragmentation": frag,
        "cache": {"num_malloc": int(stats.get("num_malloc", 0)),
                  "num_free": int(stats.get("num_free", 0)),
                  "hits": _cache_hits(stats),
                  "cached_bytes": int(stats.get("cached_bytes", 0)),
                  "num_oom": int(stats.get("num_oom", 0))},
        "driver": {"num_map": int(stats.get("num_map", 0)),
                   "num_unmap": int(stats.get("num_unmap", 0)),
                   "seconds": float(stats.get("driver_seconds", 0.0))},
    }
    if "allocated_current" in stats:   # PyTorch's rounded block bytes, for the native rows
        rep["memory"]["allocated"] = _pair(stats, "allocated")
    if min_budget is not None:
        rep["min_budget"] = int(min_budget)
    if sizes is not None:
        rep["histogram"] = histogram(sizes)
    if timeline is not None:
        rep["timeline"] = {k: list(v) for k, v in timeline.items()}
    if sections:
        rep.update({name: dict(sec) for name, sec in sections.items()})
    return rep


def from_torch_stats(ts: Mapping[str, Any]) -> Dict[str, Any]:
    """PyTorch's ``torch.cuda.memory_stats()`` in vmalloc's stats keys, so reports line up.

    requested = ``requested_bytes`` (what tensors asked for), mapped = physical =
    ``reserved_bytes`` (cudaMalloc'd segments), allocated = ``allocated_bytes`` (rounded
    blocks), map/unmap = ``num_device_alloc`` / ``num_device_free`` (cudaMalloc / cudaFree).
    """
    def g(k: str) -> int:
        return int(ts.get(k, 0) or 0)
    return {
        "requested_current": g("requested_bytes.all.current"), "requested_peak": g("requested_bytes.all.peak"),
        "mapped_current": g("reserved_bytes.all.current"), "mapped_peak": g("reserved_bytes.all.peak"),
        "physical_current": g("reserved_bytes.all.current"), "physical_peak": g("reserved_bytes.all.peak"),
        "allocated_current": g("allocated_bytes.all.current"), "allocated_peak": g("allocated_bytes.all.peak"),
        "num_malloc": g("allocation.all.allocated"), "num_free": g("allocation.all.freed"),
        "num_map": g("num_device_alloc"), "num_unmap": g("num_device_free"),
        "num_oom": g("num_ooms"), "chunk_size": 0,
        "cached_bytes": g("reserved_bytes.all.current") - g("allocated_bytes.all.current"),
    }


# ---------------------------------------------------------------------------------------------
# rendering


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _who(rep: Mapping[str, Any]) -> str:
    """The report's ``"process"`` key in one line (rank, local rank, pid, host, device)."""
    p = rep.get("process") or {}
    parts = []
    if p.get("rank") is not None:
        ws = p.get("world_size")
        parts.append(f"rank {p['rank']}" + (f"/{ws}" if ws is not None else ""))
    if p.get("local_rank") is not None:
        parts.append(f"local rank {p['local_rank']}")
    if p.get("pid") is not None:
        parts.append(f"pid {p['pid']}")
    if p.get("host"):
        parts.append(f"host {p['host']}")
    dev = p.get("device")
    parts.append("device " + (f"cuda:{dev}" if dev is not None else "none"))
    return ", ".join(parts)


def to_text(rep: Mapping[str, Any]) -> str:
    """Human-readable form of one report (or of a saved comparison)."""
    if "comparison" in rep:
        return "\n\n".join(side_by_side_from_json(c) for c in rep["comparison"])
    out: List[str] = []
    head = f"vmalloc report: {rep.get('title', rep.get('source'))}"
    extras = []
    if rep.get("device") is not None:
        extras.append(f"device {rep['device']}")
    if rep.get("chunk_size"):
        extras.append(f"chunk {format_size(rep['chunk_size'])}")
    if rep.get("budget"):
        extras.append(f"budget {format_size(rep['budget'])}")
    out.append(head + (f" ({', '.join(extras)})" if extras else ""))
    if rep.get("process"):
        out.append(f"  process: {_who(rep)}")
    mem = rep["memory"]
    out.append(f"  {'':<22}{'current':>14}{'peak':>14}")
    for row in ("requested", "allocated", "mapped", "physical"):
        if row in mem:
            out.append(f"  {row:<22}{format_size(mem[row]['current']):>14}"
                       f"{format_size(mem[row]['peak']):>14}")
    fr = rep["fragmentation"]
    ratio = fr.get("ratio_physical_requested")
    out.append(f"  physical/requested at peak: {'n/a' if ratio is None else f'{ratio:.3f}'}"
               f"   fragmentation 1 - requested/physical: {_pct(fr.get('gmlake'))}")
    line = f"  internal fragmentation (seed 003 Eq. 1, mapped - requested): current " \
           f"{format_size(fr['internal_current'])}"
    if "internal_peak" in fr:
        line += f", peak {format_size(fr['internal_peak'])}"
    out.append(line)
    if "bound_eq2" in fr:
        holds = {True: "holds", False: "VIOLATED"}.get(fr.get("bound_holds"), "")
        out.append(f"  bound (Eq. 2): N_max x m_c = {fr['n_max']} x {format_size(rep['chunk_size'])}"
                   f" = {format_size(fr['bound_eq2'])} {holds}".rstrip())
    if "min_budget" in rep:
        out.append(f"  smallest budget that runs: {format_size(rep['min_budget'])}")
    c = rep["cache"]
    hits = ""   # none for PyTorch's own allocator: its stats do not say
    if c.get("hits") is not None:
        rate = f" ({100 * c['hits'] / c['num_malloc']:.1f}%)" if c["num_malloc"] else ""
        hits = f" {c['hits']} cache hits{rate},"
    out.append(f"  cache: {c['num_malloc']} mallocs, {c['num_free']} frees,{hits}"
               f" {format_size(c['cached_bytes'])} cached, {c['num_oom']} OOM")
    d = rep["driver"]
    out.append(f"  driver: {d['num_map']} map, {d['num_unmap']} unmap, {d['seconds']:.4f} s in driver calls")
    if rep.get("histogram"):
        out.append("  allocation sizes:")
        for b in rep["histogram"]:
            rng = f"[{format_size(b['lo'])}, {format_size(b['hi'])})"
            out.append(f"    {rng:<28}{b['count']:>9}  {format_size(b['bytes']):>12}")
    for name, sec in rep.items():
        if name in _CORE_KEYS or not isinstance(sec, Mapping):
            continue
        out.append(f"  {name}:")
        for k, v in sec.items():
            shown = format_size(v) if isinstance(v, int) and k.endswith("bytes") else v
            out.append(f"    {k}: {shown}")
    return "\n".join(out)


_CORE_KEYS = {"version", "title", "source", "device", "chunk_size", "budget", "memory",
              "fragmentation", "cache", "driver", "histogram", "timeline", "min_budget",
              "process"}
# names add_section refuses: the report's own keys, the history section the recording adds and
# the key that marks a saved replay comparison
RESERVED_SECTION_NAMES = frozenset(_CORE_KEYS | {"history", "comparison"})


def comparison_json(trace_name: str, rows: Sequence[Any], meta: Optional[Mapping[str, Any]] = None
                    ) -> Dict[str, Any]:
    """A replay comparison (rows of :func:`vmalloc.replay.compare`) as JSON."""
    return {"trace": trace_name, "meta": dict(meta or {}),
            "rows": [r.to_json() if hasattr(r, "to_json") else dict(r) for r in rows]}


def side_by_side_from_json(cmp: Mapping[str, Any]) -> str:
    rows = cmp["rows"]
    head = (f"{'allocator':<26}{'peak requested':>16}{'peak physical':>16}{'phys/req':>10}"
            f"{'frag':>8}{'smallest budget':>17}{'budget/req':>12}{'IF peak':>12}{'Eq.2 bound':>13}")
    out = [f"trace {cmp['trace']}" + (f"  ({cmp['meta'].get('derived_from', '')})"
                                        if cmp.get("meta", {}).get("derived_from") else ""),
           "(peak physical: no budget, the cache grows; smallest budget: the least cap that "
           "replays, bisection for vmalloc, a scan for the caching model)",
           head, "-" * len(head)]
    for r in rows:
        mb = (format_size(r["min_budget"]) if r.get("min_budget") is not None
              else ("n/a" if r["ok"] else "OOM"))
        bound = format_size(r["if_bound"]) if r.get("if_bound") else "-"
        ifp = format_size(r["if_peak"]) if r.get("chunk_size") else "-"
        ratio = r.get("ratio")   # None: an empty trace
        # (a ratio of 10000 or more keeps its column: no decimals, a space before it)
        shown = "-" if ratio is None else f" {ratio:.0f}" if ratio >= 1000 else f"{ratio:.3f}"
        out.append(f"{r['allocator']:<26}{format_size(r['requested_peak']):>16}"
                   f"{format_size(r['physical_peak']):>16}{shown:>10}"
                   f"{_pct(r['fragmentation']):>8}{mb:>17}"
                   f"{(format(r['budget_ratio'], '.3f') if r.get('budget_ratio') else '-'):>12}"
                   f"{ifp:>12}{bound:>13}")
    return "\n".join(out)


def side_by_side(trace_name: str, rows: Sequence[Any], meta: Optional[Mapping[str, Any]] = None) -> str:
    """The replay table: one row per allocator on one trace."""
    return side_by_side_from_json(comparison_json(trace_name, rows, meta))


# ---------------------------------------------------------------------------------------------
# files


def save(rep: Mapping[str, Any], path: str) -> None:
    """Write a report: JSON when the name ends in ``.json``, else text; a PNG beside it,
    ``path + ".png"``, when matplotlib is installed and the report has a timeline (without one,
    a line on stderr says why there is no PNG).

    The whole text is made first and written whole or not at all (:func:`write_atomic`), so a
    report that cannot be rendered or written leaves the file as it was. A section that is not
    JSON (a set, an object, NaN or an infinity) is written as ``{"error": ...}`` and named in
    one line on stderr; the rest of the report is kept."""
    if path.endswith(".json"):
        try:
            text = json.dumps(rep, indent=1, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError):   # a section is not JSON: find it, keep the rest
            text = json.dumps(json_ready(rep), indent=1, sort_keys=True, allow_nan=False)
    else:
        text = to_text(rep) + "\n"
    write_atomic(path, text)
    if rep.get("timeline"):
        # the full name + .png: frag.txt and frag.json (or a report named x.png) keep apart
        try:
            plot_timeline(rep, path + ".png")
        except Exception as exc:  # noqa: BLE001 - the report itself is written: say, go on
            print(f"vmalloc: wrote {path} but not {path}.png: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
    elif importlib.util.find_spec("matplotlib") is not None:   # a PNG was to be expected
        print(f"vmalloc: no {path}.png: the report has no memory timeline (an exit report has "
              "one only when vmalloc allocated: VMALLOC=1, from its allocation history)",
              file=sys.stderr)


def json_ready(rep: Mapping[str, Any]) -> Dict[str, Any]:
    """``rep`` as a dict ``json.dumps`` takes and writes as standard JSON: itself when it does,
    else with each top-level entry that is not JSON (a section holding a set, an object, NaN or
    an infinity, which ``json.dumps`` would write as ``NaN``/``Infinity``, tokens JSON has not
    and strict readers refuse) replaced by ``{"error": ...}`` and named in one line on stderr
    (:func:`_json_sections`)."""
    try:
        json.dumps(rep, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return _json_sections(rep)
    return dict(rep)


def _json_sections(rep: Mapping[str, Any]) -> Dict[str, Any]:
    """``rep`` with each top-level entry that ``json.dumps`` refuses replaced by an error (said
    on stderr), so one added section cannot cost the whole report."""
    out: Dict[str, Any] = {}
    for name, value in rep.items():
        try:
            json.dumps(value, sort_keys=True, allow_nan=False)
            out[name] = value
        except (TypeError, ValueError) as exc:   # not JSON; mixed key types; a cycle; NaN
            why = f"{type(exc).__name__}: {exc}"
            if "Out of range float" in str(exc):   # (Python before 3.12 does not name it)
                why += " (a NaN or an infinity, which JSON has not)"
            print(f"vmalloc: report section {name!r} is not JSON ({why}); written as an error",
                  file=sys.stderr)
            out[name] = {"error": f"not JSON: {why}"}
    return out


def load(path: str) -> Dict[str, Any]:
    """Read a report saved as JSON; a clear error otherwise (:func:`loads`)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such report file") from None
    return loads(raw, path)


def loads(raw: bytes, path: str) -> Dict[str, Any]:
    """The report in ``raw``, the bytes read from ``path`` (named in every error): the one
    parser of :func:`load` and of ``vmalloc report``, which reads the file once, bounded and
    gunzipped (a pipe cannot be read twice)."""
    if not raw.strip():
        raise ValueError(f"{path}: is empty")
    try:
        rep = json.loads(raw)
    except UnicodeDecodeError:   # (a ValueError too: before JSONDecodeError's own message)
        raise ValueError(f"{path}: not a JSON report (not text)") from None
    except json.JSONDecodeError as exc:   # (the file first, as the trace readers say it)
        raise ValueError(f"{path}: not a JSON report ({exc})") from None
    if not isinstance(rep, dict) or not ({"memory", "comparison"} & rep.keys()):
        raise ValueError(f"{path}: JSON but not a vmalloc report "
                         "(expected 'memory' or 'comparison')")
    return rep


def plot_timeline(rep: Mapping[str, Any], path: str) -> Optional[str]:
    """Memory over time (requested / mapped / physical) as a PNG; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tl = rep["timeline"]
    x = tl.get("event") or list(range(len(tl["requested"])))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for key in ("physical", "mapped", "requested"):
        if key in tl:
            ax.plot(x, [v / (1 << 20) for v in tl[key]], label=key, lw=1)
    peak = rep.get("memory", {}).get("physical", {}).get("peak")
    if "physical" not in tl and peak:   # an exit report's timeline: the requested bytes only
        ax.axhline(peak / (1 << 20), ls="--", lw=1, color="gray", label="physical peak")
    ax.set_xlabel("event")
    ax.set_ylabel("MiB")
    ax.set_title(str(rep.get("title", "memory over time")))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_replay_timelines(ax: Any, timelines: Mapping[str, Mapping[str, Any]],
                          unit: int = 1 << 20, unit_name: str = "MiB") -> None:
    """On a matplotlib axis: a replayed trace's requested bytes (one black line: the same for
    every allocator) and each allocator's physical bytes over the trace's events."""
    for i, (name, tl) in enumerate(timelines.items()):
        if i == 0:
            ax.plot(tl["event"], [v / unit for v in tl["requested"]], "k-", lw=1.2,
                    label="requested")
        ax.plot(tl["event"], [v / unit for v in tl["physical"]], lw=1,
                label=f"physical (no cap): {name}")
    ax.set_xlabel("event")
    ax.set_ylabel(unit_name)
    ax.legend(fontsize=7)
