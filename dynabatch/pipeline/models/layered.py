"""The model interface the pipeline runs: `LayeredModel`, an ordered list of layers plus what the
runner needs to know about them (boundary shapes, the cost-model description, synthetic batches,
idle leading layers, parameters shared between layers).

Layer contract: ``layers[0](batch) -> state`` (the embedding reads the micro-batch dictionary),
``layers[i](state) -> state`` for the middle layers, ``layers[-1](state, batch) -> (loss_sum,
num_tokens)`` (the head returns the **sum** of token losses; the runner normalizes over the step).
A layer whose state carries values only its stage's later layers use (T5's relative bias) has a
``stage_output(state) -> state`` method giving what a stage ending with it sends (`PipelineStage`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from ...core.cost import ModelConfig
from .spec import MicroBatchShape, TensorSpec


@dataclass
class LayeredModel:
    """A model as an ordered list of layers plus what the runner needs to know about it.

    ``kind`` is ``decoder`` or ``encoder_decoder`` (as in `dynabatch.core.cost.ModelConfig`);
    ``boundary(shape, layer)`` gives the `TensorSpec`s of the state *after* layer ``layer`` for a
    micro-batch of that `MicroBatchShape`; ``config`` describes the model for the cost model
    (the whole model as one stage); ``random_batch(shape, generator)`` makes a synthetic micro-batch
    of exactly that shape (for profiling and tests). ``ties``: parameters shared between layers
    (`tied_parameters`).
    """

    name: str
    kind: str
    layers: list[nn.Module]
    boundary: Callable[[MicroBatchShape, int], tuple[TensorSpec, ...]]
    config: ModelConfig
    random_batch: Callable[..., dict] = field(repr=False, default=None)
    ties: dict[str, list[tuple[int, str]]] = field(default_factory=dict)

    def parameters(self):
        """All parameters of all layers, in layer order."""
        for layer in self.layers:
            yield from layer.parameters()

    def to(self, device) -> "LayeredModel":
        """Move every layer to ``device`` (in place); returns self."""
        for layer in self.layers:
            layer.to(device)
        return self

    def packed_attention(self) -> str:
        """How a packed micro-batch's row is attended (`dynabatch.CostModel.packed_attention`): the tiny
        models give SDPA the whole row and a block-diagonal mask, ``"dense"``."""
        return "dense"

    def idle_layers(self, shape: MicroBatchShape) -> int:
        """How many leading layers return without computing for a micro-batch of ``shape`` (0 here;
        vlm-tiny's vision layers for a micro-batch without image tiles). A runner with
        ``RunnerConfig(bypass_idle_stages=True)`` skips the stages that hold only such layers."""
        return 0

    def enter(self, batch: dict, layer: int):
        """The state at the input of layer ``layer`` for micro-batch ``batch``, whose layers before it
        are idle (`idle_layers`): they run here, returning without computing, so the stage that
        holds ``layer`` can start the micro-batch from its dictionary."""
        state = self.layers[0](batch)
        for m in self.layers[1:layer]:
            state = m(state)
        local = getattr(self.layers[layer - 1], "stage_output", None)  # as a stage ending there sends it
        return local(state) if local is not None else state

    def tied_parameters(self) -> dict[str, list[tuple[int, str]]]:
        """Parameters shared between layers (tied embeddings, a shared bias table): tie name -> the
        ``(global layer index, parameter path inside that layer, for layer.get_parameter(path))`` of
        every use. A pipeline keeps one copy per stage holding a use and sums their gradients before
        every update (`dynabatch.pipeline.runtime.tied`); empty: nothing is shared."""
        return {name: [(int(i), str(path)) for i, path in uses] for name, uses in self.ties.items()}
