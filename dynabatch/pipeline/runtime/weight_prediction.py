"""Weight versions for flush-free (asynchronous) 1F1B: optimizer-dependent weight prediction
(PipeOptim), weight stashing (PipeDream) and plain stale weights, one stage at a time.

Flush-free, a micro-batch's forward on stage ``s`` runs ``lag`` optimizer updates before its backward
there (`dynabatch.core.simulate.flushfree.update_lag`: 0 or 1 when a step has at least ``S - 1`` micro-batches
per rank). `WeightPredictor` wraps the stage's optimizer and offers three ways to handle that:

* ``mode="predict"``: before the forward, each parameter ``W`` is replaced *in place* by
  ``W_hat``, the weights after ``lag`` more updates under the optimizer's own rule and state;
  after the forward ``W`` is restored bit for bit (from a copy), so the backward, ``lag`` updates
  later, computes with the real weights, which ``W_hat`` predicted.
* ``mode="stash"``: the forward runs with the current weights; when an update is about to change
  weights that an in-flight micro-batch's backward still needs, one copy of that version is kept,
  and swapped in for that backward.
* ``mode="none"``: stale weights (forward on the old version, backward on the new one).

**The prediction.** ``predicted(s)`` runs ``s`` updates of the optimizer's exact rule on the
parameters (and scratch copies of its state; the optimizer's state is never modified), with the
future gradients taken from one of two sources:

* ``gradient="last"`` (default): each future raw gradient equals the last one the optimizer stepped
  with (recorded by a step pre-hook). Maximize, weight decay (coupled: ``g + wd * W`` re-evaluated
  at each predicted ``W``; decoupled: ``W *= 1 - lr * wd``), momentum, dampening, Nesterov, Adam's
  bias corrections and AMSGrad are applied exactly as the optimizer does, so with a constant
  gradient ``W_hat`` is what ``s`` real steps give, for every supported optimizer and option. Cost:
  one copy of the gradients, kept between steps (`extra_bytes`).
* ``gradient="implied"``: the future *effective* gradient (after maximize and coupled weight decay)
  is the one the optimizer state implies, with no extra memory: for Adam / AdamW the bias-corrected
  first moment ``m / (1 - beta1^t)`` (its own estimate of the gradient: with ``t`` equal gradients it
  is that gradient, and it stays fixed under further updates with it, so ``W_hat = W - s * lr *
  m_hat / (sqrt(v_hat) + eps)`` up to how ``v`` moves: PipeOptim's direction); for SGD with momentum
  the gradient for which the buffer is stationary, ``buf * (1 - momentum) / (1 - dampening)``, whose
  update direction is ``buf`` itself (PipeOptim's ``W - s * lr * v``). Exact for Adam/AdamW
  without coupled weight decay after equal gradients; for SGD with momentum once the buffer has
  converged (``momentum^t`` negligible). Plain SGD keeps no state and needs ``"last"``.

Why these and not ``W - s * lr * (current direction)`` alone: a momentum buffer is not the next
update (the next one is ``momentum * buf + (1 - dampening) * g``, which needs ``g``), weight decay
changes the effective gradient as ``W`` moves, and decoupled decay compounds; running the rule
itself makes the constant-gradient case exact instead of approximate. The last gradient is one
noisy sample; Adam's moment is its smoothed estimate, which is why ``"implied"`` stays available.

A parameter whose gradient was None at the last step (or before any step) is predicted unchanged:
the optimizer skipped it, and is assumed to keep skipping it. The learning rate is the group's
current one (a scheduler's future values are not anticipated).

**Autograd across an update.** The optimizer updates parameters in place, which bumps their
autograd version, so a backward after an update would fail ("modified by an inplace operation").
``forward(key, lag)`` therefore also installs saved-tensor hooks that keep, for every tensor the
forward saves that lives in a parameter's storage, an alias of that storage with its own version
counter: the backward then reads whatever that storage holds at backward time (the real current
weights, or the stashed version swapped in) and still accumulates into ``p.grad``.

Supported: exactly `torch.optim.SGD`, `torch.optim.Adam`, `torch.optim.AdamW` (subclasses and every
other optimizer raise `TypeError`); real floating parameters; dense gradients; ``optimizer.step()``
without a closure. Bytes are bytes, ``lag``/``s`` counts optimizer updates.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable

import torch

__all__ = ["MODES", "GRADIENT_SOURCES", "SUPPORTED_OPTIMIZERS", "WeightPredictor"]

#: Weight handling of a flush-free stage.
MODES = ("predict", "stash", "none")
#: Where ``predicted`` takes the future gradients from.
GRADIENT_SOURCES = ("last", "implied")
#: The optimizers whose update rule `WeightPredictor` reproduces (exact types).
SUPPORTED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)

#: Scratch tensors of one parameter's size that predicting one parameter holds at most (state
#: copies + temporaries), by optimizer kind and AMSGrad: what `extra_bytes` counts as workspace.
_WORKSPACE = {"sgd": 4, "adam": 6, "adam_amsgrad": 7}


from .update_rules import predict_adam, predict_sgd


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class WeightPredictor:
    """Weight versions of one pipeline stage's parameters under flush-free 1F1B (module doc).

    ``optimizer``: the stage's `torch.optim.SGD`, `Adam` or `AdamW` (hooks are registered on it;
    `close` removes them). ``mode``: ``"predict"``, ``"stash"`` or ``"none"``. ``gradient``: the
    future-gradient source of ``predict`` (``"last"`` or ``"implied"``).

    A runner calls, per micro-batch ``j`` of the stage::

        with wp.forward(j, lag):     # lag: updates before j's backward on this stage
            out = stage(x)
        ...                          # optimizer.step() may run here, lag times
        with wp.backward(j):
            out.backward(grad)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str = "predict", *, gradient: str = "last"):
        kind = type(optimizer)
        if kind not in SUPPORTED_OPTIMIZERS:
            raise TypeError(f"weight prediction reproduces the update rules of torch.optim.SGD, Adam and AdamW only; "
                            f"got {kind.__module__}.{kind.__qualname__}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if gradient not in GRADIENT_SOURCES:
            raise ValueError(f"gradient must be one of {GRADIENT_SOURCES}, got {gradient!r}")
        self.optimizer = optimizer
        self.mode = mode
        self.gradient = gradient
        self.kind = "sgd" if kind is torch.optim.SGD else "adam"
        seen, self.params, self._group_of = set(), [], {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if not p.is_floating_point():
                    raise ValueError(f"weight prediction needs real floating parameters, got a {p.dtype} parameter "
                                     f"of shape {tuple(p.shape)} in param group {gi}")
                self.params.append(p)
                self._group_of[id(p)] = group
            if self.kind == "sgd" and gradient == "implied" and mode == "predict" and group["momentum"] == 0:
                raise ValueError(f"param group {gi}: plain SGD (momentum 0) keeps no state to imply a gradient "
                                 f"from; use gradient='last'")
        #: Optimizer updates seen since construction (the current weight version).
        self.version = 0
        #: Most extra bytes held at once so far (see `held_bytes`).
        self.peak_bytes = 0
        self._last_grad: dict[int, torch.Tensor] = {}
        self._backup: list[torch.Tensor] | None = None
        self._stash: dict[int, list[torch.Tensor]] = {}
        self._inflight: dict[Hashable, int] = {}
        self._in_swap = False
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._after_step)]

    # -- optimizer hooks -------------------------------------------------------------------
    def _before_step(self, optimizer, args, kwargs):
        if self._in_swap:
            raise RuntimeError("optimizer.step() inside a WeightPredictor swap: the real weights are not in place")
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        if closure is not None:
            raise ValueError("WeightPredictor records the gradient before the step: optimizer.step(closure) is not "
                             "supported (compute the gradients, then call step())")
        if getattr(optimizer, "grad_scale", None) is not None:
            raise ValueError("WeightPredictor needs unscaled gradients: a GradScaler with a fused optimizer passes "
                             "scaled ones (use fused=False, or unscale_ before step)")
        if self.mode == "predict" and self.gradient == "last":
            for p in self.params:
                g = p.grad
                if g is None:
                    self._last_grad.pop(id(p), None)
                    continue
                if g.is_sparse:
                    raise ValueError(f"weight prediction needs dense gradients, got a sparse one for a parameter of "
                                     f"shape {tuple(p.shape)}")
                buf = self._last_grad.get(id(p))
                if buf is None or buf.shape != g.shape or buf.dtype != g.dtype or buf.device != g.device:
                    self._last_grad[id(p)] = g.detach().clone()
                else:
                    buf.copy_(g)
            self._note()
        if self.mode == "stash" and self.version not in self._stash and self.version in self._inflight.values():
            self._stash[self.version] = [p.detach().clone() for p in self.params]
            self._note()

    def _after_step(self, optimizer, args, kwargs):
        self.version += 1

    def close(self) -> None:
        """Remove the optimizer hooks and drop every copy held."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._last_grad.clear()
        self._stash.clear()
        self._inflight.clear()

    # -- memory ------------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        """Bytes of the managed parameters (one weight version)."""
        return sum(_bytes(p) for p in self.params)

    def held_bytes(self) -> int:
        """Extra bytes held right now: recorded gradients, the backup of ``W`` during a swap, stashed
        versions (the per-parameter prediction workspace is transient and not included)."""
        n = sum(_bytes(g) for g in self._last_grad.values())
        n += sum(_bytes(t) for t in self._backup) if self._backup is not None else 0
        n += sum(_bytes(t) for v in self._stash.values() for t in v)
        return n

    def _note(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def extra_bytes(self, versions: int = 1) -> dict:
        """What this mode costs beyond the weights, gradients and optimizer state (bytes).

        ``predict``: ``persistent`` = one gradient copy with ``gradient="last"`` (0 with
        ``"implied"``); ``swap`` = one copy of the weights (the backup of ``W``) while ``W_hat`` is in
        place, i.e. during a forward with ``lag > 0`` only (``lag == 0`` copies nothing); ``workspace``
        = at most ``k`` x the largest parameter's bytes, freed after each parameter (``k`` = 4 for SGD,
        6 for Adam, 7 with AMSGrad). ``stash``: ``persistent`` = ``versions`` x the weights (the old
        versions in-flight micro-batches still need: the largest update lag, 1 when steps have at
        least ``S - 1`` micro-batches per rank); ``swap`` = one copy of the weights (the current ``W``)
        during such a backward. ``none``: nothing. ``peak`` = ``persistent + swap + workspace``.
        """
        W = self.weight_bytes
        persistent = swap = work = 0
        if self.mode == "predict":
            if self.gradient == "last":
                persistent = sum(_bytes(p) for p in self.params if p.requires_grad)
            swap = W
            amsgrad = any(g.get("amsgrad", False) for g in self.optimizer.param_groups)
            k = _WORKSPACE["sgd" if self.kind == "sgd" else ("adam_amsgrad" if amsgrad else "adam")]
            work = k * max((_bytes(p) for p in self.params), default=0)
        elif self.mode == "stash":
            persistent = int(versions) * W
            swap = W
        return {"mode": self.mode, "weight_bytes": W, "persistent": persistent, "swap": swap, "workspace": work,
                "peak": persistent + swap + work}

    # -- prediction ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def predicted(self, s: int):
        """Swap every parameter to its predicted value after ``s`` more updates (module doc), in
        place; restore the exact bits of ``W`` on exit. ``s = 0`` changes and copies nothing."""
        if self.mode != "predict":
            raise ValueError(f"predicted() needs mode='predict', this predictor is in mode {self.mode!r}")
        s = int(s)
        if s < 0:
            raise ValueError(f"s (updates ahead) must be >= 0, got {s}")
        if self._in_swap:
            raise RuntimeError("predicted() is already in effect (nested swap)")
        if s == 0:
            yield self
            return
        self._in_swap = True
        self._backup = []
        try:
            with torch.no_grad():
                for p in self.params:
                    self._backup.append(p.detach().clone())
                self._note()
                for p in self.params:
                    self._predict_one(p, s)
            yield self
        finally:
            self._restore()

    def _restore(self) -> None:
        """Put the backed-up ``W`` back, bit for bit, and end the swap."""
        with torch.no_grad():
            for p, w in zip(self.params, self._backup):
                p.data.copy_(w)
        self._backup = None
        self._in_swap = False

    def _predict_one(self, p: torch.Tensor, s: int) -> None:
        """``p.data`` <- its value after ``s`` updates (``p.data`` is written without an autograd
        version bump; the optimizer state is only read)."""
        implied = self.gradient == "implied"
        if not implied and id(p) not in self._last_grad:
            return
        group, state = self._group_of[id(p)], self.optimizer.state.get(p, {})
        last = None if implied else self._last_grad[id(p)]
        if self.kind == "sgd":
            predict_sgd(p.data, group, state, last, s)
        else:
            predict_adam(p.data, group, state, last, s, adamw=type(self.optimizer) is torch.optim.AdamW)

    # -- the per-micro-batch interface of a runner -------------------------------------------------
    def saved_tensor_hooks(self, pack: Callable | None = None, unpack: Callable | None = None):
        """``torch.autograd.graph.saved_tensors_hooks`` that replace each saved tensor living in a
        parameter's storage by an alias with its own version counter (module doc), then apply the
        optional inner ``pack``/``unpack`` (e.g. `dynabatch.pipeline.measure.memory.SavedBytes`'s)."""
        ptrs = {p.untyped_storage().data_ptr() for p in self.params}

        def _pack(t):
            try:
                if t.untyped_storage().data_ptr() in ptrs:
                    t = t.data
            except (RuntimeError, NotImplementedError):  # tensors without storage
                pass
            return pack(t) if pack is not None else t

        def _unpack(x):
            return unpack(x) if unpack is not None else x

        return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)

    @contextlib.contextmanager
    def forward(self, key: Hashable, lag: int = 0, *, pack: Callable | None = None, unpack: Callable | None = None):
        """Run micro-batch ``key``'s forward inside: ``lag`` updates will happen before its backward.
        ``predict``: with the weights predicted ``lag`` updates ahead; ``stash``: remember the current
        version (copied only if an update comes before the backward); all modes: the saved-tensor hooks
        of `saved_tensor_hooks` (with ``pack``/``unpack`` inside)."""
        if key in self._inflight:
            raise ValueError(f"micro-batch {key!r} is already in flight on this stage")
        lag = int(lag)
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        with contextlib.ExitStack() as stack:
            if self.mode == "predict":
                stack.enter_context(self.predicted(lag))
            stack.enter_context(self.saved_tensor_hooks(pack, unpack))
            yield self
        self._inflight[key] = self.version

    @contextlib.contextmanager
    def backward(self, key: Hashable):
        """Run micro-batch ``key``'s backward inside. ``stash``: with the weight version its forward
        used swapped in (restored bit for bit on exit); other modes: the current weights."""
        if key not in self._inflight:
            raise KeyError(f"micro-batch {key!r} has no forward in flight on this stage")
        v = self._inflight.pop(key)
        if self.mode != "stash" or v == self.version:
            yield self
            return
        if v not in self._stash:
            raise RuntimeError(f"weight version {v} of micro-batch {key!r} was not stashed")
        if self._in_swap:
            raise RuntimeError("backward() inside another WeightPredictor swap")
        self._in_swap = True
        try:
            with torch.no_grad():
                self._backup = [p.detach().clone() for p in self.params]
                self._note()
                for p, w in zip(self.params, self._stash[v]):
                    p.data.copy_(w)
            yield self
        finally:
            self._restore()
            if v not in self._inflight.values():
                del self._stash[v]

    @property
    def in_flight(self) -> dict:
        """Micro-batch key -> the weight version (update count) its forward used."""
        return dict(self._inflight)

    @property
    def stashed_versions(self) -> list[int]:
        """Weight versions kept for in-flight backwards (stash mode)."""
        return sorted(self._stash)
