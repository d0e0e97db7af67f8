"""The swap runtime under memory pressure: keep the saved-tensor budget, and answer vmalloc's
pressure callback. Cheapest first: release swap-outs whose copies finished, then wait for the
oldest copies still running, then swap out (and wait for) the oldest resident saved tensors,
never those the running step uses (an autograd node holds every tensor it has read until it has
run: swapping one out would free nothing and copy it for nothing). A planned swap-in (a prefetch)
keeps the budget too, but evicts nothing: it completes pending swap-outs or is skipped."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..planners.swap_schedule import DEVICE, IN
from vmalloc import user_warning

from .swap_in_place import KeptInPlaceWarning
from .swap_stats import Residency
from .swap_transfers import SwapTransfers
from .swap_vars import Var


class Eviction:
    def __init__(self, transfers: SwapTransfers, residency: Residency,
                 counters: Dict[str, float], budget: Optional[int]):
        self.transfers = transfers
        self.residency = residency
        self.counters = counters
        self.budget = budget
        # the vars of the step running (SwapSequence keeps this list): never evicted
        self.in_use: List[Var] = []
        self.said_unmanaged = False  # (``KeptInPlaceWarning``: once)

    def make_room(self, incoming: int, keep: Optional[Var]) -> None:
        """Keep the budget: free resident bytes until ``incoming`` more fit."""
        budget = self.budget
        if budget is None or self.residency.bytes + incoming <= budget:
            return
        self.counters["budget_evictions"] += self.free_bytes(
            self.residency.bytes + incoming - budget, keep)[1]
        if self.residency.unmanaged and not self.said_unmanaged and \
                self.residency.bytes + incoming > budget:
            self.said_unmanaged = True
            user_warning.warn(
                f"scheduler.swap: {self.residency.unmanaged} bytes of saved tensors kept in "
                f"place (by iterations whose plan moved nothing) are still alive and cannot be "
                f"swapped out: the budget ({budget} bytes) is passed by up to them. They are "
                f"those of an iteration that outgrew its plan partway (a longer sequence with "
                f"the same start), or of a graph kept past its backward (retain_graph, an output "
                f"whose branch the backward did not run); that plan is not kept in place again",
                KeptInPlaceWarning)

    def room_for_prefetch(self, incoming: int) -> bool:
        """Whether a planned swap-in of ``incoming`` bytes fits the budget, after completing
        swap-outs still pending if it does not (the schedule frees those anyway). Resident
        saved tensors are not evicted for a prefetch: one that does not fit is skipped and its
        tensor comes back on demand at its use, where ``make_room`` evicts."""
        budget = self.budget
        if budget is None or self.residency.bytes + incoming <= budget:
            return True
        self.free_bytes(self.residency.bytes + incoming - budget, None, evict=False)
        return self.residency.bytes + incoming <= budget

    def free_bytes(self, needed: int, keep: Optional[Var], evict: bool = True,
                   device_memory: bool = False, device: Any = None) -> Tuple[int, int]:
        """Free ``needed`` resident bytes, never ``keep`` nor the running step's vars:
        ``(bytes freed, variables evicted)``. ``evict=False``: only by completing swap-outs.
        ``device_memory`` (vmalloc's pressure): only device memory counts. A var the program
        holds too (``Var.held_elsewhere``) frees none: its finished copy is still released (it
        costs nothing, and is re-attached at its use) but not counted, and it is neither waited
        for nor swapped out. (The saved-tensor budget counts such vars as resident like any
        other, so its evictions take them in their turn.) ``device``: only vars there count or
        are swapped out (what another device holds frees nothing on this one)."""
        in_use = self.in_use
        t = self.transfers

        def mine(vars_: Any) -> List[Var]:
            return list(vars_) if device is None else [v for v in vars_ if v.device == device]
        freed = evicted = 0
        for var in mine(t.pending):  # finished copies first: free of charge
            if freed >= needed:
                return freed, evicted
            if var is not keep and var not in in_use and (
                    var.out_event is None or var.out_event.query()):
                frees = not (device_memory and var.held_elsewhere())
                t.release(var, True)
                freed += var.nbytes if frees else 0
        for var in mine(t.pending):  # then wait for the oldest copies
            if freed >= needed:
                return freed, evicted
            if var is not keep and var not in in_use and not (
                    device_memory and var.held_elsewhere()):
                t.release(var, True)
                freed += var.nbytes
        if not evict:
            return freed, evicted
        for var in mine(self.residency.order):
            if freed >= needed:
                break
            if var is keep or var in in_use or var.state not in (DEVICE, IN):
                continue
            if device_memory and var.held_elsewhere():
                continue
            t.swap_out(var)
            if var.state != DEVICE and var.state != IN:
                t.release(var, True)
                freed += var.nbytes
                evicted += 1
        return freed, evicted

    def on_pressure(self, needed: int, device: Any = None) -> int:
        """vmalloc asks before failing a malloc: ``needed`` bytes are missing. Device bytes
        released: a saved tensor the program holds too frees nothing, so it is neither swapped
        out nor counted (counting it made vmalloc retry in vain and fail with "budget" where the
        callback had freed nothing: the program's batch is the oldest saved tensor)."""
        self.counters["pressure_calls"] += 1
        freed, _ = self.free_bytes(max(int(needed), 1), None, device_memory=True, device=device)
        self.counters["pressure_freed_bytes"] += freed
        return freed
