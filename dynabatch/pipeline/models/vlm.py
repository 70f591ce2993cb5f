"""``vlm-tiny``: a tiny vision-language model (ViT -> projector -> GPT) as a layer list the runner splits.

Layers, vision first: ``[patch embedding, ViT block x vision_layers, projector, token embedding +
merge, GPT block x layers, head]``. It takes the `DataLoader`'s padded vision micro-batches as they
come (``input_ids``/``attention_mask``/``labels`` [rows, text length], ``image_tiles`` [rows] tiles
per sample, ``pixel_values`` [tiles, 3, S, S] with ``load_pixels=True``), in either of two layouts:

* prepend (the default: the tokenizer inserts no image placeholders, the ids are text only): row
  ``i`` of the language model's sequence is ``image_tiles[i] * tile_tokens`` vision tokens (the
  sample's tiles in order), then the row's real text tokens, then padding, to the length
  `merged_length` gives (``max(text length, max_i(vision_i + text_i))``: a text-only micro-batch keeps
  its text length);
* placeholders (LLaVA-style, the model built with ``image_token_id`` and the `DataLoader` with the
  same ``image_token_id=``): where ``input_ids`` hold ``image_token_id`` the projected tile features
  are scattered in, in order (the k-th placeholder of the micro-batch, row by row, takes the k-th
  vision token; each row must hold exactly ``image_tiles[i] * tile_tokens`` of them, else a
  ValueError). The ids already are the merged sequence: `merged_length` is their length. The labels'
  placeholder positions are ignored in the loss. A micro-batch without any placeholder is prepended.

Either way the merged length is the plan's main length (the cost model counts text + vision tokens,
each once), so the micro-batch's `MicroBatchShape` is ``(rows, merged length, tiles)``: use
`vlm_batch_shapes` (or the model's ``batch_shapes``) to build the runner's shapes from a step's dicts.
With the placeholder run at the start of each row both layouts give the same sequence, loss and
gradients.

Boundary state (every shape follows from ``rows`` R, ``input_len`` L and ``tiles`` T):

* after a vision layer: ``(features [T, P, Hv] (projector: [T, tile_tokens, H]), ids [R, L],
  segments [R, L], slots [R, L])``; ``ids`` are the text ids at their merged positions, ``segments``
  1 on real (vision or text) tokens, ``slots`` the 1-based index of the vision token a position takes
  (0 on text and padding; a placeholder position holds id 0 in ``ids``). The first stage computes all
  of it from the batch; later stages need no batch until the head.
* after the merge and every GPT block: ``(hidden [R, L, H], segments [R, L])``, as ``gpt-tiny``.

A text-only micro-batch has ``tiles == 0``: both ends of a link agree, from the plan, on an empty
``[0, P, Hv]`` feature tensor, and every vision layer returns without computing (each counts the
calls that computed in ``calls``; `vision_calls` sums them). The ViT attends within a tile only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...core.cost.model import ModelConfig
from .layered import LayeredModel
from .blocks import GPTBlock, GPTHead, SelfAttentionBlock
from .contract import IGNORE_INDEX
from .spec import MicroBatchShape, TensorSpec


# ---------------------------------------------------------------------------------------------
# layout: where the vision tokens and the text tokens of each row go


def _text_mask(batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    if "cu_seqlens" in batch or "position_ids" in batch:
        raise ValueError("vlm-tiny takes padded micro-batches with one sample per row (collate='padded')")
    mask = batch.get("attention_mask")
    return torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()


def _vision_tokens(batch: dict, tile_tokens: int) -> torch.Tensor:
    """[rows] vision tokens per row (``image_tiles`` x ``tile_tokens``; 0 without ``image_tiles``)."""
    rows = batch["input_ids"].shape[0]
    tiles = batch.get("image_tiles")
    if tiles is None:
        return torch.zeros(rows, dtype=torch.long, device=batch["input_ids"].device)
    return tiles.long().reshape(rows) * tile_tokens


def placeholder_mask(batch: dict, tile_tokens: int, image_token_id: int | None) -> torch.Tensor | None:
    """[rows, text length] bool: the image placeholder positions of a micro-batch, or None when it
    has none (or ``image_token_id`` is None): its vision tokens are then prepended. With
    placeholders every row must hold exactly ``image_tiles[i] * tile_tokens`` of them (ValueError
    naming the row and its ``sample_ids`` entry otherwise)."""
    if image_token_id is None:
        return None
    ph = (batch["input_ids"] == image_token_id) & _text_mask(batch)
    if not bool(ph.any()):
        return None
    have, want = ph.sum(1), _vision_tokens(batch, tile_tokens)
    bad = torch.nonzero(have != want).flatten()
    if len(bad):
        r = int(bad[0])
        sid = batch.get("sample_ids")
        who = f" (sample_id {int(sid[r])})" if isinstance(sid, torch.Tensor) and len(sid) > r else ""
        tiles = batch.get("image_tiles")
        t = int(tiles.reshape(-1)[r]) if tiles is not None else 0
        raise ValueError(f"vlm-tiny: micro-batch row {r}{who} holds {int(have[r])} image placeholder tokens "
                         f"(image_token_id {image_token_id}) but its {t} tile(s) give {int(want[r])} vision tokens "
                         f"({tile_tokens} per tile); {len(bad)} row(s) disagree: the formatter's vision policy and "
                         "image_token_id must be the model's")
    return ph


def _inserted(batch: dict, tile_tokens: int, ph: torch.Tensor | None) -> torch.Tensor:
    """[rows] tokens the model inserts before each row's text: its vision tokens, 0 with placeholders."""
    V = _vision_tokens(batch, tile_tokens)
    return torch.zeros_like(V) if ph is not None else V


def merged_length(batch: dict, tile_tokens: int, image_token_id: int | None = None) -> int:
    """Tokens per row of the language model's sequence: ``max(text length, max_i(vision_i + text_i))``
    (vision tokens prepended), or the text length when the ids hold image placeholders (they are the
    vision tokens already)."""
    text = _text_mask(batch)
    ph = placeholder_mask(batch, tile_tokens, image_token_id)
    total = _inserted(batch, tile_tokens, ph) + text.sum(1)
    return max(int(text.shape[1]), int(total.max()) if total.numel() else 0)


def _merge_text(x: torch.Tensor, mask: torch.Tensor, first: torch.Tensor, fill: int, length: int) -> torch.Tensor:
    """``x`` [rows, text length] moved to the merged layout [rows, length]: row ``i``'s real tokens
    (``mask``) from column ``first[i]`` on, in order; ``fill`` elsewhere."""
    col = first[:, None] + mask.long().cumsum(1) - 1
    rows = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(col)
    out = torch.full((x.shape[0], length), fill, dtype=x.dtype, device=x.device)
    out[rows[mask], col[mask]] = x[mask]
    return out


def _layout(batch: dict, tile_tokens: int, image_token_id: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, segments, slots), each int64 [rows, merged length] (see the module docstring)."""
    mask = _text_mask(batch)
    ph = placeholder_mask(batch, tile_tokens, image_token_id)
    L = merged_length(batch, tile_tokens, image_token_id)
    V = _vision_tokens(batch, tile_tokens)
    first = _inserted(batch, tile_tokens, ph)
    n = mask.sum(1)
    col = torch.arange(L, device=V.device)[None]
    seg = (col < (first + n)[:, None]).long()
    ids = batch["input_ids"]
    if ph is None:  # prepend: row i's vision tokens take its first V_i columns, in tile order
        offset = V.cumsum(0) - V
        slots = torch.where(col < V[:, None], offset[:, None] + col + 1, torch.zeros_like(col))
    else:  # placeholders: the k-th placeholder of the micro-batch (row-major) takes vision token k
        ids = ids.masked_fill(ph, 0)
        at = _merge_text(ph.long(), mask, first, 0, L).bool()
        slots = torch.where(at, at.reshape(-1).long().cumsum(0).reshape(at.shape), torch.zeros_like(col))
    return _merge_text(ids, mask, first, 0, L).long(), seg, slots


def vlm_batch_shapes(microbatches, tile_tokens: int, image_token_id: int | None = None) -> list[MicroBatchShape]:
    """`MicroBatchShape`s (padded) of a step's vision micro-batch dicts for ``vlm-tiny``: ``input_len`` is
    `merged_length` (tokens), ``tiles`` the micro-batch's image tiles, plus the plan's predicted
    ``predicted_time_s`` (seconds) and ``predicted_memory_bytes`` (bytes). ``image_token_id``: the
    model's placeholder id (micro-batches with placeholders are as long as their ids)."""
    out = []
    for b in microbatches:
        tiles = int(b["image_tiles"].sum()) if "image_tiles" in b else 0
        length = merged_length(b, tile_tokens, image_token_id)
        out.append(MicroBatchShape("padded", int(b["input_ids"].shape[0]), length, 0, 0,
                                   float(b.get("predicted_time_s", 0.0)), float(b.get("predicted_memory_bytes", 0.0)),
                                   tiles))
    return out


# ---------------------------------------------------------------------------------------------
# layers


class PatchEmbedding(nn.Module):
    """Layer 0: ``pixel_values`` [T, 3, S, S] -> patches [T, P, Hv] (a stride-``patch`` convolution plus
    learned patch positions), and the language-side layout of the batch. ``calls`` counts the calls
    that computed (0 tiles: no compute, an empty [0, P, Hv] feature tensor)."""

    def __init__(self, tile_size: int, patch_size: int, vision_hidden: int, tile_tokens: int,
                 image_token_id: int | None = None):
        super().__init__()
        if tile_size % patch_size:
            raise ValueError(f"tile_size {tile_size} px is not a multiple of patch_size {patch_size} px")
        self.grid = tile_size // patch_size
        self.tile_size, self.tile_tokens, self.calls = tile_size, tile_tokens, 0
        self.image_token_id = image_token_id
        self.conv = nn.Conv2d(3, vision_hidden, patch_size, stride=patch_size)
        self.pos = nn.Parameter(torch.randn(self.grid * self.grid, vision_hidden) * 0.02)

    def forward(self, batch: dict) -> tuple:
        ids, seg, slots = _layout(batch, self.tile_tokens, self.image_token_id)
        tiles = int(batch["image_tiles"].sum()) if "image_tiles" in batch else 0
        P, dtype = self.grid * self.grid, self.pos.dtype
        if tiles == 0:
            return torch.zeros(0, P, self.pos.shape[1], dtype=dtype, device=ids.device), ids, seg, slots
        px = batch.get("pixel_values")
        if px is None:
            raise ValueError("vlm-tiny needs pixel_values for micro-batches with image tiles: DataLoader(..., "
                             "load_pixels=True)")
        if tuple(px.shape) != (tiles, 3, self.tile_size, self.tile_size):
            raise ValueError(f"pixel_values has shape {list(px.shape)} but image_tiles sum to {tiles} tiles of "
                             f"{self.tile_size} px: the vision policy's tile size must be the model's")
        self.calls += 1
        x = self.conv(px.to(dtype)).flatten(2).transpose(1, 2)
        return x + self.pos, ids, seg, slots


class ViTBlock(SelfAttentionBlock):
    """Pre-LayerNorm bidirectional block over the patches of each tile; skipped (not counted) on 0 tiles."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__(hidden, heads, ffn)
        self.calls = 0

    def forward(self, state: tuple) -> tuple:
        if state[0].shape[0] == 0:
            return state
        self.calls += 1
        return (self._block(state[0], None), *state[1:])


class Projector(nn.Module):
    """Patches [T, P, Hv] -> vision tokens [T, tile_tokens, H]: pixel shuffle (``P / tile_tokens``
    neighbouring patches side by side, as InternVL's downsampling), LayerNorm, two-layer GELU MLP."""

    def __init__(self, grid: int, vision_hidden: int, hidden: int, tile_tokens: int):
        super().__init__()
        d = int(round((grid * grid / tile_tokens) ** 0.5))
        if d < 1 or grid % d or (grid // d) ** 2 != tile_tokens:
            raise ValueError(f"tile_tokens {tile_tokens} must be (patch grid {grid} / d)**2 for an integer d")
        self.grid, self.d, self.calls = grid, d, 0
        self.ln = nn.LayerNorm(vision_hidden * d * d)
        self.up = nn.Linear(vision_hidden * d * d, hidden)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, state: tuple) -> tuple:
        x = state[0]
        T, _, Hv = x.shape
        g, d = self.grid, self.d
        if T == 0:
            return (x.new_zeros(0, (g // d) ** 2, self.down.out_features), *state[1:])
        self.calls += 1
        x = x.reshape(T, g // d, d, g // d, d, Hv).permute(0, 1, 3, 2, 4, 5).reshape(T, (g // d) ** 2, d * d * Hv)
        return (self.down(F.gelu(self.up(self.ln(x)))), *state[1:])


class MergeEmbedding(nn.Module):
    """Token + learned position embedding of the merged rows, the vision tokens written at their slots:
    ``(vision [T, tile_tokens, H], ids, segments, slots)`` -> ``(hidden [R, L, H], segments)``."""

    def __init__(self, vocab: int, hidden: int, max_positions: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_positions, hidden)

    def forward(self, state: tuple) -> tuple:
        vis, ids, seg, slots = state
        pos = (seg.cumsum(-1) - 1).clamp(min=0)
        h = self.tok(ids)
        if vis.shape[0]:
            flat = vis.reshape(-1, vis.shape[-1])
            h = torch.where((slots > 0)[..., None], flat[(slots - 1).clamp(min=0)], h)
        return h + self.pos(pos), seg


class VLMHead(GPTHead):
    """`GPTHead` on the merged rows: the batch's ``labels`` move to the text positions, -100 elsewhere
    (on the vision tokens, prepended or at placeholders, and on padding)."""

    def __init__(self, hidden: int, vocab: int, tile_tokens: int, image_token_id: int | None = None):
        super().__init__(hidden, vocab)
        self.tile_tokens, self.image_token_id = tile_tokens, image_token_id

    def forward(self, state: tuple, batch: dict):
        L = state[0].shape[1]
        ph = placeholder_mask(batch, self.tile_tokens, self.image_token_id)
        labels = batch["labels"] if ph is None else batch["labels"].masked_fill(ph, IGNORE_INDEX)
        labels = _merge_text(labels, _text_mask(batch), _inserted(batch, self.tile_tokens, ph), IGNORE_INDEX, L)
        return super().forward(state, {**batch, "labels": labels})


VISION_LAYER_TYPES = (PatchEmbedding, ViTBlock, Projector)


def vision_calls(model) -> int:
    """Calls that ran vision compute, summed over the vision layers of ``model`` (a `LayeredModel`, or
    a layer list / `PipelineStage`: any iterable of modules)."""
    layers = getattr(model, "layers", model)
    return sum(m.calls for m in layers if isinstance(m, VISION_LAYER_TYPES))


# ---------------------------------------------------------------------------------------------
# the model


@dataclass
class VisionLanguageModel(LayeredModel):
    """A `LayeredModel` with what its vision micro-batches need: ``tile_tokens`` (language tokens per
    tile), ``tile_size`` (pixels), ``vision_layers`` (the first ``vision_layers`` layers are the
    patch embedding, ViT blocks and projector), ``image_token_id`` (the placeholder id it scatters
    vision tokens into; None: it only prepends) and ``batch_shapes(step)`` (`vlm_batch_shapes`)."""

    tile_tokens: int = 0
    tile_size: int = 0
    vision_layers: int = 0
    image_token_id: int | None = None

    def batch_shapes(self, microbatches) -> list[MicroBatchShape]:
        """The runner's `MicroBatchShape`s of a step's micro-batch dicts (`vlm_batch_shapes`)."""
        return vlm_batch_shapes(microbatches, self.tile_tokens, self.image_token_id)

    def idle_layers(self, shape: MicroBatchShape) -> int:
        """The vision layers for a micro-batch without image tiles, else 0 (`LayeredModel.idle_layers`)."""
        return self.vision_layers if shape.tiles == 0 else 0


def _vlm_boundary(n_vision: int, patches: int, vision_hidden: int, hidden: int, tile_tokens: int, dtype):
    def boundary(shape: MicroBatchShape, layer: int) -> tuple[TensorSpec, ...]:
        if shape.packed or shape.target_len:
            raise ValueError("vlm-tiny takes padded decoder micro-batches (collation padded, target_len 0)")
        R, L, T = shape.rows, shape.input_len, shape.tiles
        if layer >= n_vision:
            return TensorSpec((R, L, hidden), dtype, True), TensorSpec((R, L), torch.int64)
        feat = (TensorSpec((T, patches, vision_hidden), dtype, True) if layer < n_vision - 1 else
                TensorSpec((T, tile_tokens, hidden), dtype, True))
        return feat, TensorSpec((R, L), torch.int64), TensorSpec((R, L), torch.int64), TensorSpec((R, L), torch.int64)
    return boundary


def vlm_random_batch(vocab: int, tile_tokens: int, tile_size: int, image_token_id: int | None = None):
    """Synthetic vision micro-batch of a `MicroBatchShape`: ``shape.tiles`` tiles spread over the rows
    (row 0 gets the rest), text lengths such that `merged_length` is exactly ``shape.input_len``. With
    ``image_token_id`` each row's ids start with its placeholder run (labels -100 there)."""
    def make(shape: MicroBatchShape, generator: torch.Generator | None = None) -> dict:
        gen = generator or torch.Generator().manual_seed(0)
        R, L, T = shape.rows, shape.input_len, shape.tiles
        tiles = torch.zeros(R, dtype=torch.long)
        if T:
            tiles += torch.bincount(torch.randint(0, R, (T,), generator=gen), minlength=R)
        V = tiles * tile_tokens
        if int(V.max()) >= L:
            raise ValueError(f"{T} tiles of {tile_tokens} tokens leave no text in rows of {L} tokens")
        # row 0 is the longest merged row: vision_0 + text_0 == L; the text ids are as long as row 0's text
        n = torch.minimum(torch.randint(1, L + 1, (R,), generator=gen), L - V)
        n[int(torch.argmax(V))] = L - int(V.max())
        ids = torch.randint(0, vocab, (R, int(n.max())), generator=gen)
        mask = (torch.arange(ids.shape[1])[None] < n[:, None]).long()
        out = {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX),
               "image_tiles": tiles, "pixel_values": torch.randn(T, 3, tile_size, tile_size, generator=gen)}
        return out if image_token_id is None or not T else with_placeholders(out, tile_tokens, image_token_id)
    return make


def with_placeholders(batch: dict, tile_tokens: int, image_token_id: int) -> dict:
    """A prepend-layout micro-batch (text-only ids, ``image_tiles``) as its placeholder twin: each row's
    ``image_tiles[i] * tile_tokens`` placeholders first, then its text (right-padded, labels -100 on
    the placeholders). Both give the same merged sequence (what the `Formatter` with
    ``image_token_id`` makes for samples without an ``<image>`` marker)."""
    mask = _text_mask(batch)
    V = _vision_tokens(batch, tile_tokens)
    L = merged_length(batch, tile_tokens)
    n = mask.sum(1)
    col = torch.arange(L, device=V.device)[None]
    ph = col < V[:, None]
    ids = _merge_text(batch["input_ids"], mask, V, 0, L).masked_fill(ph, image_token_id)
    out = {**batch, "input_ids": ids, "attention_mask": (col < (V + n)[:, None]).long()}
    if "labels" in batch:
        out["labels"] = _merge_text(batch["labels"], mask, V, IGNORE_INDEX, L)
    return out


def vlm_tiny(*, vocab: int = 512, hidden: int = 128, layers: int = 2, heads: int = 4, ffn: int | None = None,
             vision_hidden: int = 64, vision_layers: int = 2, vision_heads: int = 2, vision_ffn: int | None = None,
             tile_size: int = 56, patch_size: int = 14, tile_tokens: int = 4, vision=None, max_positions: int = 2048,
             image_token_id: int | None = None, dtype: torch.dtype = torch.float32, seed: int = 0
             ) -> VisionLanguageModel:
    """A tiny vision-language model: ``[patch embedding, ViT block x vision_layers, projector, merge
    embedding, GPT block x layers, head]`` (about 1M parameters by default).

    Tiles are ``tile_size`` px squares cut into ``patch_size`` px patches ((56 / 14)**2 = 16 patches,
    shuffled 2 x 2 into ``tile_tokens`` = 4 language tokens per tile). ``vision`` (a tokenization
    `DynamicTiling` or `FixedResolution`) sets ``tile_size``, ``patch_size`` and ``tile_tokens`` from
    the policy the `DataLoader` plans and decodes pixels with (its ``extra_tokens`` must be 0: the
    model inserts no image markers). ``image_token_id``: the placeholder id of the `DataLoader`'s
    ``image_token_id=`` (any int >= 0, inside the vocabulary or not: placeholder positions never look
    up the token embedding); micro-batches holding it get their vision tokens scattered there, the
    others prepended. ``seed`` fixes the initialization (every rank builds the same).
    """
    if image_token_id is not None and (isinstance(image_token_id, bool) or not isinstance(image_token_id, int)
                                       or image_token_id < 0):
        raise ValueError(f"image_token_id must be an int >= 0 or None, got {image_token_id!r}")
    if vision is not None:
        if getattr(vision, "extra_tokens", 0):
            raise ValueError("vlm-tiny inserts no image start/end tokens: use a vision policy with extra_tokens=0")
        tile_size = int(getattr(vision, "tile_size", getattr(vision, "image_size", tile_size)))
        patch_size = int(vision.patch_size)
        tile_tokens = int(vision.tile_tokens if hasattr(vision, "tile_tokens") else vision.image_tokens)
    ffn, vision_ffn = ffn or 4 * hidden, vision_ffn or 4 * vision_hidden
    torch.manual_seed(seed)
    patch = PatchEmbedding(tile_size, patch_size, vision_hidden, tile_tokens, image_token_id)
    mods: list[nn.Module] = [patch]
    mods += [ViTBlock(vision_hidden, vision_heads, vision_ffn) for _ in range(vision_layers)]
    mods.append(Projector(patch.grid, vision_hidden, hidden, tile_tokens))
    n_vision = len(mods)
    mods.append(MergeEmbedding(vocab, hidden, max_positions))
    mods += [GPTBlock(hidden, heads, ffn) for _ in range(layers)]
    mods.append(VLMHead(hidden, vocab, tile_tokens, image_token_id))
    for m in mods:
        m.to(dtype)
    P = patch.grid ** 2
    cfg = ModelConfig("vlm-tiny", "vision_language", hidden=hidden, attn_dim=hidden, kv_dim=hidden, ffn=ffn,
                      layers=layers, vision_hidden=vision_hidden, vision_attn_dim=vision_hidden, vision_ffn=vision_ffn,
                      vision_layers=vision_layers, tile_patches=P, tile_tokens=tile_tokens, flash_attention=False,
                      dtype_bytes=torch.empty((), dtype=dtype).element_size())
    return VisionLanguageModel("vlm-tiny", "vision_language", mods,
                               _vlm_boundary(n_vision, P, vision_hidden, hidden, tile_tokens, dtype), cfg,
                               vlm_random_batch(vocab, tile_tokens, tile_size, image_token_id), tile_tokens=tile_tokens,
                               tile_size=tile_size, vision_layers=n_vision, image_token_id=image_token_id)


__all__ = ["VisionLanguageModel", "vlm_tiny", "vlm_batch_shapes", "merged_length", "vision_calls", "placeholder_mask",
           "with_placeholders",
           "PatchEmbedding", "ViTBlock", "Projector", "MergeEmbedding", "VLMHead"]
