"""The byte-window swap runtime: saved tensors swapped on side streams, for any model.

This module is the context (hooks, lifetime, public functions); the jobs live beside it:
``swap_vars`` (vars, handles, deaths), ``swap_sequence`` (record and follow the sequence),
``swap_planning`` (planner choice), ``swap_transfers`` (copies, streams, host pool),
``swap_eviction`` (budget and pressure), ``swap_stats`` (residency and counters).

``with scheduler.swap(window="2GiB", budget=None, planner="window") as s:`` installs
``torch.autograd.graph.saved_tensors_hooks``. Every tensor autograd saves goes through ``_pack``
(forward) and ``_unpack`` (backward); those calls are the steps of the *variable sequence*
(seed 003, section 3). The first iteration records it; at the end of the backward the planner
turns it into a ``SwapSchedule`` (cached per sequence signature, the Mimose idea); later
iterations follow it step by step.

How things are kept correct whatever the schedule says (the schedule only decides *when*):

* A saved tensor's storage is one *variable*, however many ops saved it (views included).
  Parameters, views of parameters, other leaves that require grad, tensor subclasses and
  tensors below ``min_bytes`` are left alone (swapping them frees nothing or breaks them).
* Swap-out: a device-to-host copy into a pooled (pinned) host buffer on a dedicated side
  stream, after that stream waits for the compute stream; an event marks its completion.
  **Device memory is released only after that event completed, by keeping our reference to
  the device storage until then** (not ``record_stream``): the runtime then knows exactly when
  memory comes back, its resident figure is true, and nothing depends on the allocator
  honouring ``record_stream``. A variable freed by autograd while its copy is in flight has its
  storage parked until the event completes.
* Swap-in: a host-to-device copy on a second side stream into memory allocated while that
  stream is current, with an event. At the use, the reading stream waits on that event only if
  it has not completed yet, and the fresh memory is ``record_stream``-ed on it: autograd, not
  us, decides when it is freed, and the caching allocator must then know that stream used it.
  (Autograd runs a backward node on its forward op's stream: each stream that reads the copy
  waits and is recorded at its first read.)
* A use of a variable that is only on the host (an unexpected sequence, a pressure eviction)
  swaps it in on demand and waits: slower, never wrong. Gradients are bit-identical.
* On the CPU the same code runs with a separate host pool standing in for the device and
  synchronous copies, so CI runs the real logic.
* Interrupts (Ctrl-C) propagate: a handle's death runs no Python code (``swap_vars``), so a
  ``KeyboardInterrupt`` cannot land in a destructor and be lost; the bookkeeping of dead
  handles is done at the next hook, ``stats()`` or exit. An interrupted copy hands its host
  buffer back, and on exit every host buffer returns to the pool: a graph that outlives the
  context keeps only the host copies of its swapped-out tensors, owned by its handles.

Iteration boundaries need no help: the first unpack of a backward queues an engine callback
that runs when the backward finishes; a pack after the backward (or after every variable of
the iteration was freed, as when a graph is dropped without backward) also starts a new one, and
a recording of forward-only graphs that overlap (mostly dead, no backward, as long as the
longest plan known) is dropped for a new one (``SwapSequence.dead_recording``).
A live step that differs from the schedule's (a new input shape) switches to a cached schedule
whose sequence starts the same way, or else stops swapping ahead and records; at the end of that
iteration the new sequence gets its own schedule.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from vmalloc.sizes import SizeLike, format_size

from vmalloc import user_warning
from ..errors import InfeasibleError
from ..plan_cache import capacity_arg
from ..planners.swap_schedule import DEVICE, FREED, PACK, UNPACK, VariableSequence
from .options import parse_budget
from .swap_eviction import Eviction
from .swap_in_place import KeptInPlaceWarning
from .swap_args import device_arg, window_arg
from .swap_planning import PLANNERS, Entry, PlannerLike, PlanOverBudgetWarning, SwapPlanner
from .swap_sequence import SwapSequence
from .swap_stats import Residency, new_counters, stats_dict
from .swap_transfers import SwapTransfers
from .accounting import check_unchanged
from .not_compiled import eager_hook
from .swap_vars import DeathQueue, Handle, Var

NAME = "scheduler.swap"
_Tensor, _strided = torch.Tensor, torch.strided  # (read at every pack)

__all__ = ["SwapContext", "swap", "install_global", "uninstall_global", "global_context",
           "PLANNERS", "PlanOverBudgetWarning", "KeptInPlaceWarning"]


def _find_vmalloc_allocator(device: torch.device) -> Any:
    """vmalloc's registered allocator for ``device`` when vmalloc is enabled, else None. An
    enabled vmalloc whose allocator cannot be had raises: swapping on without the pressure
    callback would end in an out-of-memory error that does not say why."""
    try:
        import vmalloc
    except ImportError:  # vmalloc missing: no pressure callback
        return None
    if not vmalloc.is_enabled():
        return None
    from vmalloc.torch_allocator import device_allocator
    return device_allocator(device.index, True)


def node_identity(node: Any) -> Any:
    """Which autograd node is running, without owning it (its graph dies with it): the
    graph task, the node's sequence number and name (a node wrapper takes no weak ref)."""
    if node is None:
        return None
    return (torch._C._current_graph_task_id(), node._sequence_nr(), node.name())


class SwapContext:
    """Swap saved tensors between device and host following a per-sequence schedule.

    ``window``: look-ahead in bytes for swap-ins (``"2GiB"``, ints, as ``vmalloc.parse_size``),
    >= 0 (0: no look-ahead, each saved tensor fetched for its next use only; ``VMALLOC_WINDOW=0``
    is refused instead, see ``swap_args.window_arg``); smaller than a saved tensor is allowed
    (no look-ahead past it; warned once).
    ``budget``: bytes of saved tensors allowed on the device at once, positive (None: no
    limit; 0 is refused rather than read as no limit).
    ``planner``: ``"window"`` (seed 003), ``"lms"`` (fixed distance), ``"greedy"`` /
    ``"dynprog"`` (the offload planners, on the chain measured from the sequence; need a budget),
    or a callable ``sequence -> SwapSchedule``.
    ``device``: which tensors to manage: ``"cuda"``, ``"cuda:N"``, ``N``, ``"cpu"`` or a
    ``torch.device`` (default: ``"cuda"`` if available, else ``"cpu"``, where a separate host
    pool stands in for the device). ``min_bytes``: smaller storages are left
    alone. ``cache_size``: schedules kept (one per sequence signature). ``allocator``: an object
    with ``set_pressure_callback`` (default: vmalloc's registered one when enabled).
    ``planner_options``: ``swapout_threshold``/``swapin_ahead`` (lms, default 1/1),
    ``bandwidth`` (bytes/s, ``12e9`` or ``"12GB/s"``, default
    ``bandwidth.default_bandwidth()``: measured on a GPU, 12e9 on the CPU; greedy/dynprog) and
    ``slots`` (dynprog); a key the planner does not read raises ``ValueError``.
    """

    def __init__(self, window: SizeLike = "2GiB", budget: Optional[SizeLike] = None,
                 planner: PlannerLike = "window", *, device: Any = None, min_bytes: int = 1024,
                 cache_size: int = 64, allocator: Any = None,
                 planner_options: Optional[Dict[str, Any]] = None):
        self.window = window_arg(window, NAME)
        self.budget = parse_budget(budget, NAME)
        self._planner = SwapPlanner(planner, self.window, self.budget, planner_options)
        self.planner_options = self._planner.options  # checked, the bandwidth parsed
        self.planner = planner
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes: expected a non-negative int, got {min_bytes!r}")
        capacity_arg(cache_size, "scheduler.swap")
        # checked now: at __enter__ a bad one would fail with a bare AttributeError
        if allocator is not None and not callable(getattr(allocator, "set_pressure_callback",
                                                          None)):
            raise TypeError("scheduler.swap: allocator must have a set_pressure_callback method "
                            f"(e.g. a vmalloc.Allocator), got {allocator!r}")
        self.min_bytes = min_bytes
        self.device = device_arg(device, NAME)
        self._cuda = self.device.type == "cuda"
        self._allocator = allocator
        self._lock = threading.RLock()
        self._hooks: Any = None
        self._pressure_targets: Dict[Any, Any] = {}   # device (or "given") -> allocator
        # devices whose vmalloc allocator was hooked: hooked again when the context is entered
        # again (iterations kept in place pack nothing that would hook them)
        self._hooked_devices: List[Any] = []
        self._exited = False
        self._counters = new_counters()
        self._residency = Residency()
        self._transfers = SwapTransfers(self._cuda, self._counters, self._residency)
        self._eviction = Eviction(self._transfers, self._residency, self._counters, self.budget)
        self._transfers.make_room = self._eviction.make_room
        self._seq = SwapSequence(self._planner, self._transfers, self._eviction,
                                 self._residency, self._counters, cache_size)
        self._deaths = DeathQueue()
        self._by_ptr: Dict[int, Var] = {}
        self._live: Dict[Var, None] = {}          # variables not freed yet, all iterations
        self._depth = 0                           # inside a hook: deaths wait for its end

    @property
    def last_entry(self) -> Optional[Entry]:
        """The plan the last iteration ended with."""
        return self._seq.last_entry

    @property
    def last_recorded(self) -> Optional[VariableSequence]:
        """The last sequence recorded (an iteration that did not follow a known plan)."""
        return self._seq.last_recorded

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "SwapContext":
        if self._hooks is not None:
            raise RuntimeError("this SwapContext is already active (it can be entered again "
                               "after it exits, not nested)")
        with self._lock:
            self._drain()  # graphs that outlived the last exit and died since
        self._exited = False
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        if self._allocator is not None:
            self._allocator.set_pressure_callback(self._on_pressure)
            self._pressure_targets["given"] = self._allocator
            self._seq.in_place.under_pressure()
        # vmalloc's allocators are hooked per device at the first tensor saved there
        # (_hook_pressure): resolving "cuda" here would start CUDA on the current device at
        # `import torch` under VMALLOC_WINDOW, before torchrun's ranks pick their GPUs. Those
        # hooked before the last exit are hooked again now
        for device in self._hooked_devices:
            self._hook_pressure(device)
        return self

    def __exit__(self, *exc: Any) -> None:
        # every step here is needed even after an interrupt: none may skip the others
        try:
            if self._hooks is not None:
                hooks, self._hooks = self._hooks, None
                hooks.__exit__(*exc)
        finally:
            try:
                for target in self._pressure_targets.values():
                    if target is not None:
                        target.set_pressure_callback(None)
                self._pressure_targets.clear()
            finally:
                with self._lock:
                    self._exited = True
                    self._depth = 0  # an interrupt may have left a hook half way
                    self._seq.end_step()
                    self._drain(sweep=True)
                    if not self._live:
                        self._transfers.shutdown()
                    else:  # a graph outlives the context: its memory goes as it dies
                        self._transfers.hand_over(self._live)
                        self._transfers.pool.reclaim()
                        self._transfers.pool.close()
                    self._seq.in_place.settle(force=True)  # (as resync: counts an interrupt
                    self._residency.resync()  # may have left half done)
                    self._transfers.pool.resync()

    # --------------------------------------------------------------------------- hooks
    def _manageable(self, t: torch.Tensor) -> bool:
        if type(t) is not _Tensor:  # parameters, subclasses
            return False
        if not (t.is_cuda if self._cuda else t.is_cpu):
            return False
        if t.layout is not _strided or t.is_conj() or t.is_neg() or t.is_quantized:
            return False
        if t.requires_grad and t.is_leaf:  # held by the user anyway
            return False
        base = t._base
        if base is None:  # (most saved tensors: Parameter's isinstance is Python code)
            return True
        if isinstance(base, torch.nn.Parameter):
            # a view of a weight (``F.linear`` saves ``weight.t()``), frozen ones too: the
            # module holds it, so moving it frees nothing and brings a second copy back
            return False
        return not (base.requires_grad and base.is_leaf)

    # The hooks run eagerly: a compiled forward would otherwise trace (and recompile) them
    # (``eager_hook``: without torch.compiler.disable's cost where nothing is compiled).
    # A tensor left where it is (parameters, small ones, an iteration kept in place) is packed
    # as ``(t.detach(), t._version)``: detached, or the tensor autograd saved as an output would
    # hold its own graph through the pack (a cycle only the garbage collector breaks); the
    # version for ``check_unchanged``; in an iteration kept in place, its ``InPlaceToken`` too.
    # A plain tuple: this is the path of every saved tensor of an iteration kept in place, where
    # a class's construction would be most of the cost.
    @eager_hook
    def _pack(self, t: torch.Tensor) -> Any:
        if not self._manageable(t):
            return t.detach(), t._version
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes or nbytes == 0:
            return t.detach(), t._version
        with self._lock:
            seq = self._seq
            if seq.backward_seen and not seq.callback_queued and (seq.events or seq.in_place.on):
                # the backward ended and no end callback said so (older torch): end it here,
                # its deaths counted first (as ``_on_backward_end`` does)
                self._drain()
                seq.end_iteration()
            if seq.in_place.on:
                token = seq.keep_in_place(storage.data_ptr(), nbytes)
                if token is not None:
                    kept = t.detach()
                    if seq.in_place.evictor is not None:  # (a pressure callback may ask)
                        seq.in_place.evictor.watch(kept)
                    return kept, t._version, token
            self._drain()
            self._depth += 1
            try:
                return self._pack_locked(t, storage, nbytes)
            finally:
                self._depth -= 1

    def _pack_locked(self, t: torch.Tensor, storage: Any, nbytes: int) -> Handle:
        seq = self._seq
        if seq.events:
            if seq.live_in_iter == 0:  # (every saved tensor of the iteration died)
                seq.end_iteration()
            elif seq.dead_recording():  # overlapping forward-only graphs: bounded
                seq.drop_iteration()
        ptr = storage.data_ptr()
        var = self._by_ptr.get(ptr)
        if var is not None and (var.state == FREED or var.it != seq.it
                                or var.storage_ref() is not storage):
            var = None
        created = var is None
        if created:
            if self.budget is not None and nbytes > self.budget:
                raise InfeasibleError(
                    f"budget={self.budget} bytes ({format_size(self.budget)}) is below what one "
                    f"step needs: a saved tensor of {nbytes} bytes ({format_size(nbytes)}, shape "
                    f"{tuple(t.shape)})", min_memory=nbytes)
            vid = len(seq.vars)
        else:
            vid = var.vid
        seq.step_begin(vid, PACK, nbytes, None if created else var)
        if created:
            var = Var(vid, seq.it, storage, nbytes, ptr, t.device)
            if self._cuda:
                var.stream = torch.cuda.current_stream(t.device)
                self._hook_pressure(t.device)
            seq.vars.append(var)
            self._by_ptr[ptr] = var
            self._live[var] = None
            seq.live_in_iter += 1
            self._residency.add(var)
        elif var.state != DEVICE or var.host is not None or var.storage is not storage:
            # the forward hands the tensor back, its bytes moved or copied meanwhile
            self._transfers.save_again(var, storage, t._version)
        handle = Handle(var, t, var.keeper(storage))
        var.handles.append(self._deaths.watch(handle))
        seq.step_end(var)
        return handle

    def _hook_pressure(self, device: torch.device) -> None:
        """Give vmalloc's allocator of ``device`` (when enabled) our pressure callback, once."""
        if self._allocator is None and device not in self._pressure_targets:
            target = _find_vmalloc_allocator(device)
            if target is not None:
                # (for this device only: what another device holds frees nothing here)
                target.set_pressure_callback(functools.partial(self._on_pressure, device=device))
                self._seq.in_place.under_pressure()
                if device not in self._hooked_devices:
                    self._hooked_devices.append(device)
            self._pressure_targets[device] = target

    @eager_hook
    def _unpack(self, handle: Any) -> torch.Tensor:
        if handle.__class__ is tuple:  # left where it is
            t, version = handle[0], handle[1]
            if t._version != version:
                check_unchanged(t, version, "swap runtime")
            in_place = self._seq.in_place
            if in_place.evictor is not None and len(handle) == 3:  # kept: may be evicted
                # the node reading it must hold a tensor of its own, so that its storage counts
                # as held: autograd hands the node our very tensor where it needs no gradient
                # (a dropout mask), and a pressure call during the node would evict it. Made
                # first: from then on no pressure call (another thread's) can take the storage
                d = t.detach()
                if in_place.evictor.on_host:
                    with self._lock:  # (evicted under pressure: brought back)
                        in_place.restore(t)
                t = d
            if (in_place.on or in_place.left_ref is not None) and not self._seq.callback_queued:
                self._in_place_backward(handle)
            return t
        with self._lock:
            self._drain()
            self._depth += 1
            try:
                seq = self._seq
                var = handle.var
                # else: a graph kept from an earlier iteration, or a saved tensor read outside
                # a backward (``grad_fn._saved_self``, as torchviz shows saved tensors)
                current = var.it == seq.it and torch._C._current_graph_task_id() != -1
                if current:
                    if not seq.callback_queued:
                        self._queue_end_callback()
                    seq.backward_seen = True
                    # the node reading: its unpacks are one step (it holds them all until it runs)
                    seq.step_begin(var.vid, UNPACK, var.nbytes, var,
                                   node_identity(torch._C._current_autograd_node()))
                self._transfers.ensure_resident(var, self.budget)
                view = handle.view
                if view is None:  # swapped since: a view of the bytes now on the device
                    dtype, shape, stride, offset = handle.meta
                    view = torch.empty((0,), dtype=dtype, device=var.device).set_(
                        var.storage, offset, shape, stride)
                    check_unchanged(view, view._version, "swap runtime",
                                    handle.changed_since_saved())
                    handle.view, handle.version = view, view._version
                elif handle.meta is None:  # never dropped: it shares the saved tensor's counter
                    if handle.modified or view._version != handle.version:
                        check_unchanged(view, handle.version, "swap runtime", handle.modified)
                else:  # (a re-attached view has a counter of its own: ask the source too)
                    check_unchanged(view, handle.version, "swap runtime",
                                    handle.changed_since_saved())
                if current:
                    seq.step_end()
                return view
            finally:
                self._depth -= 1

    def _in_place_backward(self, packed: Tuple[Any, ...]) -> None:
        """A backward reads ``packed``: if the running iteration kept it in place, that
        backward's end ends the iteration (a graph of an earlier one does not)."""
        if torch._C._current_graph_task_id() == -1:  # (read outside a backward)
            return
        with self._lock:
            seq = self._seq
            if not seq.callback_queued and seq.in_place.is_current(packed):
                self._queue_end_callback()
                seq.backward_seen = True

    def _queue_end_callback(self) -> None:
        engine = getattr(torch.autograd.Variable, "_execution_engine", None)
        queue = getattr(engine, "queue_callback", None)
        if queue is None:  # older torch: the next pack ends the iteration instead
            return
        self._seq.callback_queued = True
        queue(self._on_backward_end)

    def _on_backward_end(self) -> None:
        with self._lock:
            self._seq.callback_queued = False
            self._drain()
            self._seq.end_iteration()
            self._drain()

    def _on_pressure(self, needed: int, device: Optional[torch.device] = None) -> bool:
        """vmalloc asks before failing a malloc: ``needed`` bytes are missing (on ``device``,
        where vmalloc's allocator of one device asks: only what is there is released; None, an
        ``allocator=`` given: any). Policy (``swap_eviction``): release finished swap-outs, wait
        for the oldest in flight, swap out the oldest resident saved tensors. True if anything
        was released (the allocator retries once). Tensors kept in place by the running
        iteration come last (``swap_in_place_pressure``): the iteration leaves in place, and its
        plan is kept in place again only after twice as long a streak as before (at most
        ``IN_PLACE_AFTER_MAX``); any iteration that meets pressure does not count towards it."""
        with self._lock:
            self._drain()
            seq = self._seq
            seq.pressed = True
            freed = self._eviction.on_pressure(needed, device)
            ip = seq.in_place
            if freed < needed and ip.evictor is not None and ip.evictor.keeps_on(device):
                seq.leave_in_place(pressed=True)
                kept = ip.evict(needed - freed, device)
                self._counters["pressure_freed_bytes"] += kept
                self._counters["in_place_evicted_bytes"] += kept
                freed += kept
            return freed > 0

    # ------------------------------------------------------------------ freeing
    def _drain(self, sweep: bool = False) -> None:
        """Bookkeeping for handles that died since the last call (not inside a hook: a death
        during a step belongs after it). ``sweep``: also check every live var, in case an
        interrupt cut an earlier drain short."""
        if self._depth:
            return
        self._seq.in_place.settle()  # (tensors kept in place: their tokens' deaths)
        deaths = self._deaths
        while deaths:
            ref = deaths.pop()
            if ref is not None:
                self._maybe_free(ref.var)
        if sweep:
            for var in list(self._live):
                self._maybe_free(var)

    def _maybe_free(self, var: Var) -> None:
        # each step may run again after an interrupt cut an earlier call short (the exit's
        # sweep calls this for every live var): none counts twice
        if var.state != FREED:
            var.handles = [r for r in var.handles if r() is not None]
            if var.handles:
                return
            self._seq.freed(var)
            self._transfers.forget(var)
        if self._by_ptr.get(var.ptr) is var:
            del self._by_ptr[var.ptr]
        self._live.pop(var, None)
        if self._exited and not self._live:
            self._transfers.shutdown()

    # ------------------------------------------------------------------------ stats
    def stats(self) -> Dict[str, Any]:
        """Counters since the context was made; bytes unless a count or seconds."""
        with self._lock:
            self._drain()
            self._transfers.resolve_gpu_stalls(wait=True)
            settings = {"window": self.window, "budget": self.budget,
                        "planner": self._planner.name, "device": str(self.device)}
            seq = self._seq
            if seq.in_place.on:  # (its count, even if every tensor it kept died since)
                self._residency.add_peak(seq.in_place.bytes)
            return stats_dict(self._counters, self._residency, seq.cache, len(self._live),
                              settings, self._transfers.pool.stats(), seq.in_place.resident())


def swap(window: SizeLike = "2GiB", budget: Optional[SizeLike] = None,
         planner: PlannerLike = "window", **options: Any) -> SwapContext:
    """``with scheduler.swap(window="2GiB", budget=None, planner="window") as s:`` swaps saved
    tensors for every autograd graph built inside. Keyword options as ``SwapContext``."""
    return SwapContext(window, budget, planner, **options)


# the context ``install_global`` made, per thread (saved-tensor hooks are per thread): not
# whatever SwapContext is on top of the hooks, which may be a user's ``with scheduler.swap()``
_installed = threading.local()


def _top_hooks_owner() -> Any:
    """The object whose saved-tensor hooks are on top of this thread's stack, if any."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return getattr(top[0], "__self__", None) if top else None


def global_context() -> Optional[SwapContext]:
    """The context ``install_global`` put on this thread's saved-tensor hooks, if it is still
    installed (a user's ``with scheduler.swap()`` opened since does not count)."""
    ctx = getattr(_installed, "ctx", None)
    if ctx is not None and ctx._hooks is None:  # exited some other way: not installed
        _installed.ctx = ctx = None
    return ctx


def install_global(window: SizeLike, budget: Optional[SizeLike] = None) -> SwapContext:
    """Turn swapping on for every autograd graph of this thread (the ``VMALLOC_WINDOW``
    autoload). Its ``stats()`` go into the vmalloc report under ``"swap"``. Installing again
    with the same window and budget returns the installed context."""
    existing = global_context()
    where = "scheduler.runtime.swap.install_global"
    w, b = window_arg(window, where), parse_budget(budget, where)
    if existing is not None:
        if (existing.window, existing.budget) == (w, b):
            return existing
        raise RuntimeError(f"swapping is already on (window={existing.window}, budget="
                           f"{existing.budget}); call uninstall_global() first")
    if isinstance(_top_hooks_owner(), SwapContext):
        # installed on top of it, the global context's hooks would be the ones its exit pops
        raise RuntimeError(f"{where}: swapping is already on (a `with scheduler.swap()` of this "
                           f"thread is open); install the global context before or after it")
    ctx = SwapContext(w, b)
    ctx.__enter__()
    _installed.ctx = ctx
    try:  # the swap stats as a "swap" section of the vmalloc report (``add_section``)
        from vmalloc.pluggable.live_report import add_section
        add_section("swap", ctx.stats)
    except Exception as exc:  # noqa: BLE001 - the report is optional; swapping is not
        user_warning.warn(f"VMALLOC_WINDOW: swapping is on, but the report will have no 'swap' "
                          f"section: {type(exc).__name__}: {exc}", RuntimeWarning)
    return ctx


def uninstall_global() -> Optional[SwapContext]:
    """Undo ``install_global`` (the context keeps working for graphs already built). The
    report's ``"swap"`` section keeps the figures of the run so far (``distributed.shutdown``
    calls this before the exit report is written), frozen: the report holds no reference to
    the context and what it keeps. Saved-tensor hooks are a stack: a context opened after
    ``install_global`` and still open (a ``with scheduler.swap()``, any ``saved_tensors_hooks``)
    raises ``RuntimeError``, and nothing changes."""
    ctx = global_context()
    if ctx is not None:
        if _top_hooks_owner() is not ctx:
            raise RuntimeError(
                "scheduler.runtime.swap.uninstall_global: the global swap context "
                "(install_global, VMALLOC_WINDOW) is not the innermost of this thread's "
                "saved-tensor hooks: a context opened after it (a `with scheduler.swap()`, a "
                "saved_tensors_hooks) is still open; call it after that context exits")
        _installed.ctx = None
        ctx.__exit__(None, None, None)
        try:
            from vmalloc.pluggable.live_report import add_section, remove_section
        except Exception:  # noqa: BLE001 - the report is optional
            return ctx
        try:
            final = dict(ctx.stats())
            add_section("swap", lambda: dict(final))
        except Exception:  # noqa: BLE001 - no figures to keep: no live section either
            remove_section("swap")
    return ctx
