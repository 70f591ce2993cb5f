"""Shards of K models on one stage device and their spilling to host memory (bytes throughout).

A *shard* is one model's stage: its parameters, their gradients and the optimizer's state for them.
`ShardStore` keeps the K shards of one stage device within a memory budget: shards not needed are
copied to host memory (pinned on GPU) and brought back before their turn, bit for bit; the bytes it
holds on the device are *measured* from the tensors the models and optimizers hold (each storage
once), not only planned. `dynabatch.pipeline.runtime.residency.StepShards` turns one step's sequence of
shard uses into the windows that must be resident and the eviction / prefetch order, and `make_room`
evicts by `dynabatch.core.simulate.spill.pick_victims`: the policy the K-model simulator replays.
Used by `dynabatch.pipeline.runtime.multimodel`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch
from torch import nn

from ...core.simulate.spill import pick_victims

__all__ = ["ShardStore", "shard_bytes"]

# --------------------------------------------------------------------------- shards and spilling


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _predicted_state_bytes(optimizer, p: torch.Tensor, cpu_device: bool) -> int:
    """Bytes the optimizer's state for ``p`` will hold on the device once it exists: SGD momentum 1x,
    Adam/AdamW 2x (3x with amsgrad) plus the ``step`` scalar when it lives on the device (a CPU
    device, or ``capturable``/``fused``: otherwise torch keeps it in host memory); any other
    optimizer 2x (re-checked against the measured state every step)."""
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    size = _nbytes(p)
    if isinstance(optimizer, torch.optim.SGD):
        return size if group.get("momentum", 0) else 0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        mult = 3 if group.get("amsgrad", False) else 2
        step_dev = cpu_device or group.get("capturable", False) or group.get("fused", False)
        scalar = torch.empty((), dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                             else torch.float32).element_size()
        return mult * size + (scalar if step_dev else 0)
    return 2 * size


def shard_bytes(module: nn.Module, optimizer, device) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes a shard holds on ``device`` at most: the
    gradient of every trainable parameter, the optimizer state measured where it exists and
    predicted where it does not yet (`_predicted_state_bytes`)."""
    device = torch.device(device)
    cpu = device.type == "cpu"
    pb = gb = ob = 0
    for p in module.parameters():
        pb += _nbytes(p)
        if p.requires_grad:
            gb += _nbytes(p)
        state = optimizer.state.get(p) if optimizer is not None else None
        if state:
            ob += sum(_nbytes(t) for t in state.values()
                      if isinstance(t, torch.Tensor) and (cpu or t.device.type == device.type))
        elif optimizer is not None and p.requires_grad:
            ob += _predicted_state_bytes(optimizer, p, cpu)
    return pb, gb, ob


class ShardStore:
    """The K shards of one stage device and where each lives (device or host); bytes throughout.

    ``modules[k]``/``optimizers[k]``: shard ``k``'s parameters and their optimizer; ``names[k]`` names
    it in errors; ``budget_bytes``: the most shard bytes resident on ``device`` at once (None: no
    limit, nothing is ever spilled). `spill` copies a shard's parameters, gradients and optimizer
    state to host memory (pinned on GPU) and leaves empty placeholders in the model; `load` copies
    them back (``non_blocking`` on a side CUDA stream, waited for by `ready`). `resident_bytes`
    *measures* what the models and optimizers hold on the device (``moved_bytes``/``copy_s``: the
    bytes spills and loads copied and the seconds spent in them); `observe` records its peak and
    raises if it ever exceeds the budget."""

    def __init__(self, modules: Sequence[nn.Module], optimizers: Sequence, device, budget_bytes: float | None = None,
                 names: Sequence[str] | None = None):
        if len(modules) != len(optimizers):
            raise ValueError(f"{len(modules)} shards but {len(optimizers)} optimizers")
        self.modules = list(modules)
        self._params = [list(m.parameters()) for m in self.modules]  # walked after every byte change
        self.optimizers = list(optimizers)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.names = list(names) if names is not None else [f"shard {k}" for k in range(len(modules))]
        self.budget = None if budget_bytes is None else float(budget_bytes)
        K = len(self.modules)
        self.resident = [True] * K
        self._sizes: list[tuple[int, int, int]] = [(0, 0, 0)] * K
        self.host: list[dict | None] = [None] * K
        self._events: dict[int, object] = {}
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.peak_bytes = 0
        self.spills = self.loads = self.prefetches = 0
        self.moved_bytes = 0  # shard bytes copied by spills and loads
        self.copy_s = 0.0  # seconds spent issuing them (on CPU the copies themselves)
        self.check_budget()
        if self.budget is not None and self.accounted_bytes() > self.budget:  # start within the budget
            for k in reversed(range(K)):
                if self.accounted_bytes() <= self.budget:
                    break
                self.spill(k)
        self.observe()

    # -- bytes ---------------------------------------------------------------------------------
    def sizes(self, k: int) -> tuple[int, int, int]:
        """Shard ``k``'s (parameter, gradient, optimizer-state) bytes when resident (`shard_bytes`;
        for a spilled shard the figure taken when it was spilled: its placeholders are empty)."""
        if self.resident[k]:
            self._sizes[k] = shard_bytes(self.modules[k], self.optimizers[k], self.device)
        return self._sizes[k]

    def full_bytes(self, k: int) -> int:
        """Shard ``k``'s bytes when resident with gradients and optimizer state."""
        return sum(self.sizes(k))

    def check_budget(self) -> None:
        """Raise ValueError when a shard alone exceeds the budget (it could never run)."""
        if self.budget is None:
            return
        for k in range(len(self.modules)):
            pb, gb, ob = self.sizes(k)
            if pb + gb + ob > self.budget:
                raise ValueError(f"{self.names[k]} needs {pb + gb + ob} bytes on {self.device} (parameters {pb} + "
                                 f"gradients {gb} + optimizer state {ob}) but the device memory budget is "
                                 f"{int(self.budget)} bytes: no order can run it; raise memory_budget_bytes to at "
                                 f"least {pb + gb + ob}")

    def accounted_bytes(self) -> int:
        """Sum of `full_bytes` over the resident shards (what the residency plan charges; >= measured)."""
        return sum(self.full_bytes(k) for k in range(len(self.modules)) if self.resident[k])

    def _tensors(self, k: int):
        for p in self._params[k]:
            yield p.data
            if p.grad is not None:
                yield p.grad
            for t in (self.optimizers[k].state.get(p) or {}).values():
                if isinstance(t, torch.Tensor):
                    yield t

    def resident_bytes(self) -> int:
        """Measured bytes of every shard tensor (parameters, gradients, optimizer state) held on this
        device by the models and optimizers, each storage once (empty placeholders count 0)."""
        seen, total = set(), 0
        for k in range(len(self.modules)):
            for t in self._tensors(k):
                if t.device.type != self.device.type or t.numel() == 0:
                    continue
                st = t.untyped_storage()
                key = st.data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += st.nbytes()
        return total

    def observe(self) -> int:
        """Measure `resident_bytes`, keep the peak, and raise RuntimeError if it passed the budget."""
        b = self.resident_bytes()
        self.peak_bytes = max(self.peak_bytes, b)
        if self.budget is not None and b > self.budget:
            raise RuntimeError(f"internal error: {b} shard bytes resident on {self.device}, over the budget of "
                               f"{int(self.budget)} bytes (resident: "
                               f"{[self.names[k] for k in range(len(self.modules)) if self.resident[k]]})")
        return b

    # -- moves ---------------------------------------------------------------------------------
    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != self.device.type:  # already in host memory (e.g. Adam's CPU step count)
            return t
        if self.cuda:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            return h
        return t.clone()

    def spill(self, k: int) -> None:
        """Move shard ``k`` to host memory (parameters, gradients, optimizer state), bit for bit."""
        if not self.resident[k]:
            return
        t0 = time.perf_counter()
        self.ready(k)
        self.sizes(k)  # its figure while spilled
        opt = self.optimizers[k]
        saved = {"params": [], "grads": [], "state": []}
        for p in self.modules[k].parameters():
            saved["params"].append(self._host_copy(p.data))
            saved["grads"].append(None if p.grad is None else self._host_copy(p.grad))
            state = opt.state.get(p) or {}
            saved["state"].append({n: (self._host_copy(t) if isinstance(t, torch.Tensor) else t)
                                   for n, t in state.items()})
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the host copies are complete
        for p, st in zip(self.modules[k].parameters(), saved["state"]):
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.grad = None
            state = opt.state.get(p)
            if state:
                for n, t in list(state.items()):
                    if isinstance(t, torch.Tensor) and t.device.type == self.device.type:
                        state[n] = torch.empty(0, dtype=t.dtype, device=t.device)
        self.host[k] = saved
        self.resident[k] = False
        self.spills += 1
        self.moved_bytes += self.full_bytes(k)
        self.copy_s += time.perf_counter() - t0

    def load(self, k: int, *, prefetch: bool = False) -> None:
        """Bring shard ``k`` back to the device (on GPU asynchronously on a side stream; `ready`
        waits). ``prefetch`` only counts it as a load ahead of its turn."""
        if self.resident[k]:
            return
        t0 = time.perf_counter()
        saved, opt = self.host[k], self.optimizers[k]
        ctx = torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext()
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

        def back(h):
            if not isinstance(h, torch.Tensor) or h.device.type == self.device.type:
                return h
            return h.to(self.device, non_blocking=True) if self.cuda else h.clone()

        with ctx:
            for p, hp, hg, hs in zip(self.modules[k].parameters(), saved["params"], saved["grads"], saved["state"]):
                p.data = back(hp) if self.cuda else hp.clone()
                p.grad = None if hg is None else (back(hg) if self.cuda else hg.clone())
                if hs:
                    state = opt.state[p]
                    for n, h in hs.items():
                        state[n] = back(h) if self.cuda or not isinstance(h, torch.Tensor) else h.clone()
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self._stream)
            self._events[k] = ev
        self.host[k] = None
        self.resident[k] = True
        self.loads += 1
        self.moved_bytes += self.full_bytes(k)
        self.copy_s += time.perf_counter() - t0
        self.prefetches += int(prefetch)

    def ready(self, k: int) -> None:
        """Make the compute stream wait for shard ``k``'s load (GPU; nothing to do on CPU)."""
        ev = self._events.pop(k, None)
        if ev is None:
            return
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(ev)
        for t in self._tensors(k):  # the side stream allocated them; the compute stream uses them
            if t.device.type == "cuda" and t.numel():
                t.record_stream(cur)

    def make_room(self, need: int, keep: set, next_use: dict[int, float]) -> bool:
        """Spill resident shards not in ``keep`` (furthest ``next_use`` first, never-used-again first)
        until ``need`` more bytes fit the budget; False (nothing spilled) when they cannot."""
        if self.budget is None:
            return True
        victims = pick_victims([k for k in range(len(self.modules)) if self.resident[k] and k not in keep],
                               self.full_bytes, self.budget - self.accounted_bytes(), need, next_use)
        for k in victims or ():
            self.spill(k)
        return victims is not None
