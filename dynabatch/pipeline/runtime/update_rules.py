"""The update rules `dynabatch.pipeline.runtime.weight_prediction.WeightPredictor` predicts with: ``s``
more steps of `torch.optim.SGD` or `Adam`/`AdamW` on a weight tensor, from scratch copies of the
optimizer's state (never modified), with a constant future gradient: the last one stepped with, or
(``last=None``) the one the state implies (see `WeightPredictor`'s module doc)."""

from __future__ import annotations

import torch


def scalar(x) -> float:
    """A group setting (a float or a 0-d tensor) as a float."""
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def predict_sgd(w: torch.Tensor, group: dict, state: dict, last: torch.Tensor | None, s: int) -> None:
    """``w`` <- ``s`` SGD steps of param group ``group`` from ``state`` (in place)."""
    lr = scalar(group["lr"])
    wd = scalar(group["weight_decay"])
    maximize = bool(group.get("maximize", False))
    mu, damp, nesterov = scalar(group["momentum"]), scalar(group["dampening"]), bool(group["nesterov"])
    buf = state.get("momentum_buffer")
    buf = None if buf is None else buf.clone()
    if last is None:
        if buf is None:
            return
        g = buf * ((1.0 - mu) / (1.0 - damp)) if damp != 1.0 else torch.zeros_like(buf)
        wd, maximize = 0.0, False  # the buffer already holds the effective gradient
    else:
        g = last
    for _ in range(s):
        d = -g if maximize else g
        if wd != 0:
            d = d.add(w, alpha=wd)
        if mu != 0:
            if buf is None:
                buf = d.detach().clone()
            else:
                buf.mul_(mu).add_(d, alpha=1 - damp)
            d = d.add(buf, alpha=mu) if nesterov else buf
        w.add_(d, alpha=-lr)


def predict_adam(w: torch.Tensor, group: dict, state: dict, last: torch.Tensor | None, s: int, *,
                 adamw: bool) -> None:
    """``w`` <- ``s`` Adam (``adamw``: AdamW) steps of param group ``group`` from ``state`` (in place)."""
    lr = scalar(group["lr"])
    wd = scalar(group["weight_decay"])
    maximize = bool(group.get("maximize", False))
    beta1, beta2 = (scalar(b) for b in group["betas"])
    eps = scalar(group["eps"])
    amsgrad = bool(group.get("amsgrad", False))
    decoupled = bool(group.get("decoupled_weight_decay", adamw))
    if "step" in state:
        t = scalar(state["step"])
        m, v = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
        vmax = state["max_exp_avg_sq"].clone() if amsgrad else None
    else:
        t, m, v = 0.0, torch.zeros_like(w), torch.zeros_like(w)
        vmax = torch.zeros_like(w) if amsgrad else None
    if last is None:
        if t == 0:
            return
        g = m / (1.0 - beta1 ** t)
        maximize = False
        coupled = 0.0  # the moments already hold any coupled decay
    else:
        g = last
        coupled = 0.0 if decoupled else wd
    for _ in range(s):
        t += 1
        d = -g if maximize else g
        if wd != 0 and decoupled:
            w.mul_(1 - lr * wd)
        if coupled != 0:
            d = d.add(w, alpha=coupled)
        m.lerp_(d, 1 - beta1)
        v.mul_(beta2).addcmul_(d, d, value=1 - beta2)
        step_size = lr / (1 - beta1 ** t)
        bc2_sqrt = (1 - beta2 ** t) ** 0.5
        if amsgrad:
            torch.maximum(vmax, v, out=vmax)
            denom = (vmax.sqrt() / bc2_sqrt).add_(eps)
        else:
            denom = (v.sqrt() / bc2_sqrt).add_(eps)
        w.addcdiv_(m, denom, value=-step_size)
