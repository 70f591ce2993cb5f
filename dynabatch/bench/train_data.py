"""``dynabatch bench train``'s data: the given files, the shared FLAN sample, or generated FLAN-like text
(image+text records for vlm-tiny), and the length index every method's `DataLoader` reads."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

SHARED_FLAN = ("../shared/data/text/niv2_sample.jsonl.gz", "../shared/data/text/flan_cot_sample.jsonl.gz")


def default_data(root: Path | None = None) -> tuple:
    """The shared FLAN sample when present (relative to the repository root), else ()."""
    root = root or Path(__file__).resolve().parents[2]
    paths = tuple(str((root / p).resolve()) for p in SHARED_FLAN)
    return paths if all(os.path.exists(p) for p in paths) else ()


def build_data(cfg, tmp: str, generated_samples: int = 2000):
    """Resolve the data of ``cfg`` (a `TrainBenchConfig`: given, shared FLAN sample, or generated) and
    build the length index once; returns ``cfg`` with ``data`` and ``index`` set."""
    import dynabatch
    from ..datagen import write_text_shards
    from .train_vlm import VLM_MODEL

    if cfg.model == VLM_MODEL:
        from .train_vlm import build_vlm_data, vision_policy

        data = tuple(cfg.data) or build_vlm_data(tmp, generated_samples, cfg.text_fraction, cfg.options.seed)
        index = os.path.join(tmp, "index.parquet")
        dynabatch.build_index(list(data), family="decoder", max_len=cfg.options.max_len, vision=vision_policy(),
                              path=index)
        return replace(cfg, data=data, index=index)
    data = tuple(cfg.data) or default_data()
    if not data:
        data = tuple(str(p) for p in write_text_shards(Path(tmp) / "data", generated_samples, seed=cfg.options.seed))
    family = "encoder_decoder" if cfg.model == "t5-tiny" else "decoder"
    index = os.path.join(tmp, "index.parquet")
    o = cfg.options
    dynabatch.build_index(list(data), family=family, max_len=o.max_len,
                          max_target_len=o.max_target_len if family == "encoder_decoder" else None, path=index)
    return replace(cfg, data=data, index=index)


__all__ = ["SHARED_FLAN", "default_data", "build_data"]
