"""The step tracker: torch's memory tracker (MemTracker, or FSDPMemTracker for FSDP2) watching one traced step,
with raybench's corrections, the memory at each place of the step (`place_of`), and every operator handed to the
step's costs (`step_costs`).

The corrections: DTensor's global-shape propagation runs are skipped (`fake_world.Propagation`, see
trace.py's docstring); storage a wrapper allocated where the tracker cannot see it (DDP's buckets) is counted
from the step's start (`count_from_start`); FSDP's unsharded gradients of a micro-batch that does not reduce
are gradients, not temporaries; frozen parameters get no gradient hook.

Imports torch's memory-tracker package, which loads slowly: the trace imports this module when it traces.
"""

from __future__ import annotations

import re
from functools import cache, wraps

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils.weak import WeakIdKeyDictionary

from raybench.rehearse.fake_world import Propagation
from raybench.rehearse.roofline import Roofline
from raybench.rehearse.step_costs import StepCosts
from raybench.rehearse.worlds import MemoryEvents
from raybench.spec.schema import GIB

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")

# Tracker reference types (torch's names) by the categories raybench reports.
CATEGORY_OF = {
    "sharded_param": "parameters", "unsharded_param": "parameters", "all_gather": "parameters",
    "parameter": "parameters", "buffer": "parameters",
    "sharded_grad": "gradients", "unsharded_grad": "gradients", "reduce_scatter": "gradients",
    "gradient": "gradients",
    "optstate": "optimizer_state",
    "activation": "activations", "inputs": "activations",
    "temp": "temporaries", "other": "temporaries",
}
_TOTAL = "Total"  # the snapshot's own sum

# Operators that neither allocate, compute nor read data: a tensor's device query (prim.device: the autograd engine
# and FSDP ask it thousands of times a step, 60% of the operators a step dispatches) and the profiler's range
# markers. Neither torch's memory tracker nor the step's costs have anything to count in them, so they skip both.
_NOTHING_TO_COUNT = {torch.ops.prim.device.default, torch.ops.profiler._record_function_enter_new.default,
                     torch.ops.profiler._record_function_exit._RecordFunction}

# A decoder block itself, not a module inside it, as torch's module tracker names it.
_BLOCK_ITSELF = re.compile(r"\.layers\.(\d+)(\._checkpoint_wrapped_module)?$")


@cache  # asked of every module running, at every operator: a model's few hundred names, searched once each
def _block_index(module_name: str) -> int | None:
    """The index of the decoder block `module_name` names itself (None: another module, or one inside a block)."""
    found = _BLOCK_ITSELF.search(module_name)
    return int(found.group(1)) if found else None


def place_of(part: int, backward: bool, block: int | None) -> str:
    """Where in the step an operator runs: the part (micro-batch, or the optimizer step), forward or backward,
    and the decoder block that runs it or ran last, by its index, or outside: before any block (forward's
    embedding, backward's head and loss) and in the optimizer step. depth.py names the blocks by what a shallow
    model keeps of the deep one (its ends) and what it does not (the middle)."""
    where = "outside" if block is None else str(block)
    return f"{part}:{'backward' if backward else 'forward'}:{where}"


def categories(snapshot: dict) -> dict[str, float]:
    """Sum a tracker snapshot's reference types (over devices) into CATEGORIES, in GiB."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for device_snapshot in snapshot.values():
        for reftype, nbytes in device_snapshot.items():
            value = str(getattr(reftype, "value", reftype))
            if value != _TOTAL:  # an unknown reference type (a torch upgrade) fails here, loudly
                totals[CATEGORY_OF[value.lower().replace(" ", "_")]] += nbytes / GIB
    return totals


def tracker_for(model: nn.Module, optimizer, fsdp: bool, roofline: Roofline) -> StepTracker:
    """The step tracker of a model: FSDP2's tracker follows the model and optimizer from the start; the plain one
    is given them by `track_external`."""
    if fsdp:
        return FsdpStepTracker(roofline, model, optimizer)
    return StepTracker(roofline)


class _NoHook:
    """The hook handle of a parameter that got no hook."""

    def remove(self) -> None:
        pass


class StepTracker(MemTracker):
    """torch's tracker, plus: skip DTensor's global-shape propagation runs, keep each place's peak, and hand
    every operator this rank runs to the step's costs (collectives and roofline)."""

    def __init__(self, roofline: Roofline, *tracked):
        super().__init__(*tracked)  # FSDPMemTracker takes the model and optimizer; MemTracker nothing
        self.place_peaks: dict[str, tuple[int, dict]] = {}  # place_of: (bytes in use, snapshot) at its highest
        self.backward_entry: dict[tuple[int, int], int] = {}  # (part, block): bytes in use as its backward began
        self.last_total = 0
        self.last_block: dict[tuple[int, bool], int] = {}  # (part, backward): the block that ran last
        self.propagation = Propagation()
        self.costs = StepCosts(roofline)
        self.accumulating_grads = False
        self.stand_ins: list[torch.Tensor] = []
        self.held_elsewhere = WeakIdKeyDictionary()  # storages the stand-ins count
        self.op_reads_held_elsewhere = False
        self.events: MemoryEvents | None = None  # the memory after every operator, where `record_events` asked
        self._category_index: dict = {}  # reference type -> its category's position in CATEGORIES
        self.ledger = None  # shards.ShardLedger, where the trace builds the step at a second FSDP2 group size

    def record_events(self) -> None:
        """Record the memory by category after every operator (worlds.py shares a step across world sizes)."""
        self.events = MemoryEvents(CATEGORIES)

    def __enter__(self):
        entered = super().__enter__()
        if self.events is not None and not self.events.initial_bytes:
            self.events.initial_bytes = tuple(self._category_bytes(self._peak_mem_snap))
        if self.ledger is not None:
            self.ledger.entered_tracker()
        return entered

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if self.ledger is not None:
            self.ledger.changed(u_type, winfo, old_mem_consumed, old_reftype)

    def _category_bytes(self, snapshot: dict) -> list[int]:
        """A tracker snapshot's bytes by CATEGORIES (one device), marking the record lost where that is not what
        the tracker counts (several devices, or a total not the sum of its parts)."""
        found = [0] * len(CATEGORIES)
        if len(snapshot) > 1:
            self.events.lost = "the step's memory sits on several devices"
        for dev_snap in snapshot.values():
            for reftype, nbytes in dev_snap.items():
                if reftype == _TOTAL:
                    continue
                index = self._category_index.get(reftype)
                if index is None:
                    name = CATEGORY_OF[str(getattr(reftype, "value", reftype)).lower().replace(" ", "_")]
                    index = self._category_index[reftype] = CATEGORIES.index(name)
                found[index] += nbytes
        if snapshot and sum(found) != sum(dev_snap[_TOTAL] for dev_snap in snapshot.values()):
            self.events.lost = "the tracker's total is not the sum of its parts"
        return found

    def next_part(self) -> None:
        """Count what follows as the step's next part (the next micro-batch, or the optimizer step)."""
        self.costs.next_part()
        if self.ledger is not None:
            self.ledger.other.next_part()

    def next_micro_batch(self) -> None:
        """Before a micro-batch's forward, except the first: torch's trackers take a second forward of the root
        module for a second step and refuse it; a micro-batch is not one, so clear the per-module statistics of
        the last micro-batch as torch's message advises (`reset_mod_stats`). The step's peak, and every tensor
        tracked, are the tracker's own and carry on."""
        self.reset_mod_stats()

    def count_from_start(self, stand_ins: list[torch.Tensor]) -> None:
        """Count `stand_ins` as gradients from the step's start, for storage a wrapper allocated before the step
        where the tracker cannot see it (DDP's gradient buckets, inside its C++ reducer): torch's tracker would
        first see that storage when the step uses it, and count it only from there.

        That storage is not counted again. Once stand-ins are given, a storage an operator takes as input before
        the tracker saw it is theirs (everything the step creates, the tracker sees created; the model and
        optimizer are tracked from the start), and so is what an operator on it returns that the tracker has not
        seen: a view of it or, under a fake mode, the fake twin of that real storage."""
        self.stand_ins = stand_ins
        for t in stand_ins:
            self._update_and_maybe_create_winfos(t, _MemRefType.GRAD)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.propagation.depth or func in _NOTHING_TO_COUNT:  # propagation: DTensor's global-shape run
            return func(*args, **(kwargs or {}))
        index = len(self.costs.parts) - 1  # the part the operator starts in
        part = self.costs.parts[index]
        self.op_reads_held_elsewhere = bool(self.stand_ins) and self._reads_held_elsewhere(args, kwargs)
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.op_reads_held_elsewhere = False
        if out is NotImplemented:  # DTensor desugars first; its local ops come back through here
            return out
        cost = self.costs.count(part, func, args, kwargs or {}, out, self._mod_tracker.is_bw,
                                self._mod_tracker.parents)
        if self.ledger is not None:
            self.ledger.operator(index, func, args, kwargs or {}, out, self._mod_tracker.is_bw,
                                 self._mod_tracker.parents, cost)
        return out

    def _reads_held_elsewhere(self, args, kwargs) -> bool:
        """Whether the operator reads storage the stand-ins count, marking as theirs any input the tracker has
        not seen."""
        held = False
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                for st in get_untyped_storages(t):
                    if st not in self._WINFO:
                        self.held_elsewhere[st] = True
                    held = held or st in self.held_elsewhere
        return held

    def _track(self, reftype, t: torch.Tensor) -> None:
        if self.accumulating_grads:
            reftype = self._ref_class.UNSHARDED_GRAD
        for st in get_untyped_storages(t):
            if self.op_reads_held_elsewhere and st not in self._WINFO:
                self.held_elsewhere[st] = True
            if st in self.held_elsewhere:
                return
        super()._track(reftype, t)

    def _update_peak_stats(self, peak_state) -> None:
        # The step's peak, and each place's (`place_of`): torch's tracker keeps every module's own peak instead,
        # walking all the model's modules after every operator (quadratic in depth: 40% of a 72B trace).
        self._update_step_peak()
        total = sum(dev_snap[_TOTAL] for dev_snap in self._curr_mem_snap.values())
        part, backward = len(self.costs.parts) - 1, self._mod_tracker.is_bw
        block = self._block_running(part, backward)
        self.last_total = total
        place = place_of(part, backward, block)
        self._update_place_peak(place, total)
        if self.events is not None:
            self.events.record(place, self._category_bytes(self._curr_mem_snap))

    def _update_step_peak(self) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL]:
                self._peak_mem[dev] = dev_snap[_TOTAL]
                self._peak_mem_snap[dev] = dict(dev_snap)

    def _block_running(self, part: int, backward: bool) -> int | None:
        """The decoder block running, or the one that ran last in this part and pass (None: none yet). Records
        the memory in use as each block's backward begins (`backward_entry_gib`)."""
        # Backward leaves torch's module tracker with stale entries of the blocks above (it runs top-down): the
        # lowest block entered is the one running.
        block = min((i for name in self._mod_tracker.parents if (i := _block_index(name)) is not None), default=None)
        if block is None:  # between blocks, or past the last (the head in forward, the embedding in backward)
            return self.last_block.get((part, backward))
        self.last_block[part, backward] = block
        if backward and (part, block) not in self.backward_entry:
            self.backward_entry[part, block] = self.last_total
            if self.events is not None:  # the operator before this one left that memory (-1: none did)
                self.events.backward_entry[part, block] = self.events.count - 1
        return block

    def _update_place_peak(self, place: str, total: int) -> None:
        if total > self.place_peaks.get(place, (-1, None))[0]:
            self.place_peaks[place] = (total, {dev: dict(snap) for dev, snap in self._curr_mem_snap.items()})

    def place_gib(self) -> dict[str, dict[str, float]]:
        return {place: categories(snapshot) for place, (_, snapshot) in self.place_peaks.items()}

    def backward_entry_gib(self) -> dict[tuple[int, int], float]:
        """The memory in use as each block's backward began, by (part, block): depth.py checks from it that
        backward does not grow memory across the middle blocks."""
        return {key: total / GIB for key, total in self.backward_entry.items()}

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
        # torch's MemTracker hooks every parameter's gradient and fails on frozen ones (LoRA's base weights,
        # which have none): a handle that removes nothing marks those as hooked already.
        for param in module.parameters():
            if not param.requires_grad:
                self._param_to_grad_hook_handles.setdefault(param, (_NoHook(), _NoHook()))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def category_gib(self) -> dict[str, float]:
        return categories(self.get_tracker_snapshot("peak"))


class FsdpStepTracker(StepTracker, FSDPMemTracker):
    """The step tracker on FSDPMemTracker, which follows FSDP2's parameter groups (sharded and unsharded)."""

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig_post_backward):
        # A micro-batch that does not reduce (set_requires_gradient_sync(False)) leaves each gradient unsharded
        # and, under a mixed-precision policy, casts it to the reduce dtype in FSDP's post-backward: torch's
        # tracker would count that cast as a temporary of backward, where it is the gradient the next
        # micro-batches accumulate into and the last one reduces.
        @wraps(orig_post_backward)
        def post_backward(*args, **kwargs):
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            self.accumulating_grads = group is not None and not group.reduce_grads
            try:
                return orig_post_backward(*args, **kwargs)
            finally:
                self.accumulating_grads = False

        return super()._fsdp_param_group_post_backward(fsdp_mod, post_backward)
