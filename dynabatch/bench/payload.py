"""A bench configuration (a dataclass holding a `PlanOptions` and tuple fields) as the JSON-able dict
its worker processes receive, and back."""

from __future__ import annotations

from dataclasses import fields

from ..core.options import PlanOptions


def _kind(annotation) -> str:
    """``"PlanOptions"``, ``"tuple"`` or ``""`` for a field's annotation (a string here: the config
    modules use postponed annotations)."""
    name = str(getattr(annotation, "__name__", annotation)).split("[")[0]
    return name if name in ("PlanOptions", "tuple") else ""


def config_payload(cfg) -> dict:
    """Every field of the bench config ``cfg``: its `PlanOptions` as `PlanOptions.to_dict`, tuples as
    lists, the rest as they are. `config_from_payload` reads it back."""
    out = {}
    for f in fields(cfg):
        value, kind = getattr(cfg, f.name), _kind(f.type)
        out[f.name] = value.to_dict() if kind == "PlanOptions" else list(value) if kind == "tuple" else value
    return out


def config_from_payload(cls, payload: dict):
    """The ``cls`` instance of a `config_payload` dict; keys starting with ``_`` (the launcher's own
    additions) are left out."""
    kinds = {f.name: _kind(f.type) for f in fields(cls)}
    out = {}
    for name, value in payload.items():
        if name.startswith("_"):
            continue
        kind = kinds.get(name, "")  # an unknown name reaches cls, which refuses it
        out[name] = (PlanOptions.from_dict(value) if kind == "PlanOptions"
                     else tuple(value) if kind == "tuple" else value)
    return cls(**out)
