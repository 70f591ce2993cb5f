"""`load_stage`: one pipeline rank's part of a Hugging Face ``save_pretrained`` folder, and its checkpoint.

The model is built on the meta device and cut into stages (equal layer counts unless ``bounds`` are
given); only this rank's layers are read from the folder's safetensors. `HFStage.save` has every
stage write its part (`save_stage`), then merges the parts (`merge_stages`) into a
``save_pretrained`` folder with the source's tokenizer beside it, so ``from_pretrained`` loads the
trained model (and ``AutoTokenizer`` its tokenizer) as it loaded the source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ...runtime.setup_guard import setup_call, setup_phase
from ..contract import check_bounds
from ..partition import LayerCosts, uniform_partition
from .build import from_hf
from .checkpoint import merge_stages, save_stage
from .common import HFLayeredModel
from .weights import WeightSource, materialize

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class HFStage:
    """What one rank holds: ``model`` (an `HFLayeredModel` with only ``layers`` materialized),
    ``bounds`` (layer offsets of every stage: the cut to give `PipelineRunner.from_model`), this
    rank's ``stage``, the ``source`` folder and the pipeline context ``ctx`` (`init_pipeline`'s)."""

    model: HFLayeredModel
    bounds: tuple[int, ...]
    stage: int
    source: Path
    ctx: object = field(repr=False)

    @property
    def layers(self) -> range:
        """The global indices of this stage's layers."""
        return range(self.bounds[self.stage], self.bounds[self.stage + 1])

    def save(self, out: str | Path) -> Path:
        """Checkpoint the trained model into the ``save_pretrained`` folder ``out`` (collective: every rank
        calls it). Each stage of replica 0 writes its part to ``out/stages``; rank 0 then merges the
        parts into ``out`` (checking every part is there and the tied copies agree) and copies the source's
        tokenizer there; the parts stay (``from_hf(out, layers=...)`` reads the merged folder as well).
        Returns ``out``."""
        out = Path(out)
        parts = out / "stages"
        with setup_phase(self.ctx, f"saving stage {self.stage} to {parts}"):
            if self.ctx.replica == 0:
                save_stage(self.model, self.layers, parts, self.stage, len(self.bounds) - 1)
            _barrier(self.ctx, f"for every stage's part in {parts}")
            if self.ctx.rank == 0:
                merge_stages(parts, out)
                if any((self.source / f).is_file() for f in TOKENIZER_FILES):
                    from transformers import AutoTokenizer

                    AutoTokenizer.from_pretrained(str(self.source)).save_pretrained(str(out))
            _barrier(self.ctx, f"for rank 0's merge into {out}")
        return out


def _barrier(ctx, text: str) -> None:
    """A barrier of every rank, under the failure monitor: a rank whose save failed (a full disk, a
    refused non-finite tensor) stops the others with its error instead of leaving them in the barrier."""
    import torch.distributed as dist

    setup_call(ctx, lambda: dist.barrier(), f"in the barrier {text}", range(ctx.world_size))


def load_stage(folder: str | Path, ctx, *, bounds: Sequence[int] | None = None,
               dtype: torch.dtype | None = None) -> HFStage:
    """This rank's stage of the ``save_pretrained`` folder ``folder``: the model built on the meta device,
    only the layers of stage ``ctx.stage`` read from its safetensors onto ``ctx.device`` (in ``dtype``;
    default the stored one's conversion to torch's default dtype). ``bounds``: the cut (layer offsets,
    ``ctx.num_stages + 1`` of them; default equal layer counts, the first stages one more). Under the
    failure monitor (`dynabatch.pipeline.runtime.setup_guard`): an error here (a damaged shard) stops every
    rank with it."""
    folder = Path(folder)
    with setup_phase(ctx, f"loading stage {ctx.stage}'s weights from {folder}"):  # an error here stops every rank
        model = from_hf(folder, layers=range(0), dtype=dtype)  # the skeleton: nothing read yet
        n = len(model.layers)
        if bounds is None:
            unit = np.ones((n, 1))
            bounds = uniform_partition(LayerCosts(unit, unit), ctx.num_stages).bounds
        bounds = check_bounds(bounds, n)
        if len(bounds) != ctx.num_stages + 1:
            raise ValueError(f"{model.name} from {folder}: bounds {list(bounds)} give {len(bounds) - 1} stages, the "
                             f"pipeline has {ctx.num_stages}")
        mine = range(bounds[ctx.stage], bounds[ctx.stage + 1])
        materialize(model, mine, model.weights, device=ctx.device, dtype=dtype)
    return HFStage(model, bounds, ctx.stage, folder, ctx)
