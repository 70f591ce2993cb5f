"""``mtmm-tiny``: the tiny multi-task multi-modal member, built as the components of
`dynabatch.core.multitask.zoo.mtmm_tiny_graph` (same names, layer counts and widths: ``MTMM_TINY``).

Components (`ComponentModel`, the contract in `dynabatch.pipeline.models.component_model`):

* ``vit`` (encoder): ``pixel_values`` [T, 3, S, S] -> patch embedding (vlm-tiny's `PatchEmbedding`), the ViT
  blocks within each tile, 2 x 2 average pooling of the patch grid -> [T, tile_tokens, Hv];
* ``audio`` (encoder): ``audio_values`` [R, F, mel] with ``audio_frames`` [R] real frames per row -> a linear
  frame embedding + positions, bidirectional blocks over each row's real frames, average pooling of
  ``audio_pool`` frames -> [R, F / audio_pool, Ha] (a row's token ``k`` is real when ``k * pool`` < its frames);
* ``projector``: one LayerNorm + two-layer GELU MLP (``Hv`` = ``Ha`` -> H -> H) applied to whichever encoder the
  task reaches: [T, tile_tokens, H] or [R, F / pool, H];
* ``backbone``: the merged sequence, then GPT blocks -> hidden [R, L, H]. Row ``i`` of the merged sequence is
  its modality tokens (``image_tiles[i] * tile_tokens`` vision tokens, its tiles in order, or its real audio
  tokens), then its real text tokens, then padding: ``L = max(text length, max_i(modality_i + text_i))``;
* ``head_caption`` (LM head): summed next-token loss on the text positions of the merged rows (the modality
  tokens and padding are no targets);
* ``head_cls`` (classifier): the mean of the backbone's output over each row's real tokens -> LayerNorm ->
  ``classes`` logits; summed cross-entropy against ``class_labels`` [R] (-100: no target).

Micro-batches are padded, one sample per row, right-padded text (``input_ids``/``attention_mask``, ``labels``
for the LM head), plus ``image_tiles``/``pixel_values`` or ``audio_values``/``audio_frames``, plus
``class_labels`` for the classifier; one task per micro-batch. Every shape that crosses a component boundary
follows from the micro-batch's `TaskShape` (`mtmm_shape`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...loader.token_loss import summed_cross_entropy
from .blocks import GPTBlock, SelfAttentionBlock, padded_self_mask
from .component_model import ComponentModel, TaskShape
from .contract import IGNORE_INDEX
from .spec import TensorSpec
from .vlm import PatchEmbedding, ViTBlock

#: the component names (those of `dynabatch.core.multitask.zoo.mtmm_tiny_graph`)
COMPONENTS = ("vit", "audio", "projector", "backbone", "head_caption", "head_cls")
HEADS = ("head_caption", "head_cls")


# ---------------------------------------------------------------------------------------------
# layout of the merged rows: modality tokens first, then the row's text


def _text_lengths(batch: dict) -> torch.Tensor:
    """[rows] real text tokens per row; ValueError unless every row is right-padded (real tokens first)."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if "cu_seqlens" in batch or "position_ids" in batch:
        raise ValueError("mtmm-tiny takes padded micro-batches with one sample per row (collate='padded')")
    if mask is None:
        return torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long, device=ids.device)
    n = mask.long().sum(1)
    if not torch.equal(mask.bool(), torch.arange(ids.shape[1], device=ids.device)[None] < n[:, None]):
        raise ValueError("mtmm-tiny needs right-padded text (attention_mask 1...1 0...0 in every row)")
    return n


def audio_tokens(batch: dict, pool: int) -> torch.Tensor:
    """[rows] real audio tokens per row: ``ceil(audio_frames / pool)`` (0 without ``audio_frames``)."""
    rows = batch["input_ids"].shape[0]
    frames = batch.get("audio_frames")
    if frames is None:
        return torch.zeros(rows, dtype=torch.long, device=batch["input_ids"].device)
    return (frames.long().reshape(rows) + pool - 1) // pool


def modality_tokens(batch: dict, tile_tokens: int, pool: int) -> torch.Tensor:
    """[rows] modality tokens placed before each row's text: vision (``image_tiles * tile_tokens``) or audio
    (`audio_tokens`); a micro-batch holding both is refused (one modality per task)."""
    a = audio_tokens(batch, pool)
    tiles = batch.get("image_tiles")
    v = torch.zeros_like(a) if tiles is None else tiles.long().reshape(a.shape) * tile_tokens
    if bool(v.any()) and bool(a.any()):
        raise ValueError("mtmm-tiny: a micro-batch holds both image tiles and audio frames; each task has one "
                         "modality (image_text or audio_text), so tag such samples with one task each")
    return v + a


def merged_length(batch: dict, tile_tokens: int, pool: int) -> int:
    """Tokens per row of the backbone's sequence: ``max(text length, max_i(modality_i + text_i))``."""
    total = modality_tokens(batch, tile_tokens, pool) + _text_lengths(batch)
    return max(int(batch["input_ids"].shape[1]), int(total.max()))


def _merge(x: torch.Tensor, first: torch.Tensor, n: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """``x`` [rows, text length] placed at columns ``first[i] .. first[i] + n[i]`` of [rows, length]."""
    col = torch.arange(length, device=x.device)[None]
    src = col - first[:, None]
    keep = (src >= 0) & (src < n[:, None])
    got = x.gather(1, src.clamp(0, x.shape[1] - 1))
    return torch.where(keep, got, torch.full_like(got, fill))


def layout(batch: dict, tile_tokens: int, pool: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, segments, modality) of the merged rows, each [rows, `merged_length`] int64: the text ids at their
    merged columns (0 elsewhere), 1 on real tokens, and the modality tokens' running index + 1 (row-major over
    the micro-batch, so the k-th vision or real audio token of the micro-batch is 1 + k; 0 on text/padding)."""
    n = _text_lengths(batch)
    m = modality_tokens(batch, tile_tokens, pool)
    L = merged_length(batch, tile_tokens, pool)
    col = torch.arange(L, device=n.device)[None]
    seg = (col < (m + n)[:, None]).long()
    slot = torch.where(col < m[:, None], (m.cumsum(0) - m)[:, None] + col + 1, torch.zeros_like(col))
    return _merge(batch["input_ids"].long(), m, n, L, 0), seg, slot


def merged_labels(batch: dict, tile_tokens: int, pool: int) -> torch.Tensor:
    """[rows, `merged_length`] labels at the text's merged columns, -100 on the modality tokens and padding."""
    n = _text_lengths(batch)
    m = modality_tokens(batch, tile_tokens, pool)
    return _merge(batch["labels"].long(), m, n, merged_length(batch, tile_tokens, pool), IGNORE_INDEX)


# ---------------------------------------------------------------------------------------------
# components


class VisionEncoder(nn.Module):
    """``vit``: patches of each tile, ViT blocks within the tile, 2 x 2 average pooling -> [T, tile_tokens, Hv]."""

    def __init__(self, tile_size: int, patch_size: int, hidden: int, heads: int, ffn: int, layers: int,
                 tile_tokens: int):
        super().__init__()
        self.patch = PatchEmbedding(tile_size, patch_size, hidden, tile_tokens)
        g = self.patch.grid
        d = int(round((g * g / tile_tokens) ** 0.5))
        if d < 1 or g % d or (g // d) ** 2 != tile_tokens:
            raise ValueError(f"tile_tokens {tile_tokens} must be (patch grid {g} / d)**2 for an integer d")
        self.d = d
        self.blocks = nn.ModuleList(ViTBlock(hidden, heads, ffn) for _ in range(layers))

    def forward(self, inputs: dict, batch: dict) -> torch.Tensor:
        x = self.patch(batch)[0]
        for b in self.blocks:
            x = b((x,))[0]
        T, _, H = x.shape
        g, d = self.patch.grid, self.d
        return x.reshape(T, g // d, d, g // d, d, H).mean(dim=(2, 4)).reshape(T, (g // d) ** 2, H)


class AudioBlock(SelfAttentionBlock):
    """Pre-LayerNorm bidirectional block over each row's real audio frames."""

    def forward(self, h: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        return self._block(h, padded_self_mask(segments, causal=False))


class AudioEncoder(nn.Module):
    """``audio``: frames [R, F, mel] -> embedding + positions, bidirectional blocks, ``pool``:1 average pooling
    -> [R, F / pool, Ha]."""

    def __init__(self, mel: int, hidden: int, heads: int, ffn: int, layers: int, pool: int, max_frames: int):
        super().__init__()
        self.mel, self.pool = mel, pool
        self.embed = nn.Linear(mel, hidden)
        self.pos = nn.Embedding(max_frames, hidden)
        self.blocks = nn.ModuleList(AudioBlock(hidden, heads, ffn) for _ in range(layers))

    def forward(self, inputs: dict, batch: dict) -> torch.Tensor:
        x = batch["audio_values"]
        R, Fr, M = x.shape
        if M != self.mel or Fr % self.pool:
            raise ValueError(f"mtmm-tiny: audio_values has shape {list(x.shape)}; it needs {self.mel} mel bins and a "
                             f"frame count that is a multiple of audio_pool {self.pool} (pad the frames)")
        frames = batch["audio_frames"].long().reshape(R)
        seg = (torch.arange(Fr, device=x.device)[None] < frames[:, None]).long()
        h = self.embed(x.to(self.embed.weight.dtype)) + self.pos.weight[:Fr]
        for b in self.blocks:
            h = b(h, seg)
        # the mean of each group's real frames (a padded frame's state is no part of the audio)
        w = seg.to(h.dtype).reshape(R, Fr // self.pool, self.pool, 1)
        return (h.reshape(R, Fr // self.pool, self.pool, -1) * w).sum(2) / w.sum(2).clamp(min=1)


class SharedProjector(nn.Module):
    """``projector``: LayerNorm + two-layer GELU MLP on the encoder the task reaches (``vit`` or ``audio``)."""

    def __init__(self, d_in: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_in)
        self.up = nn.Linear(d_in, hidden)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, inputs: dict, batch: dict) -> torch.Tensor:
        if len(inputs) != 1:
            raise ValueError(f"mtmm-tiny's projector reads one encoder per micro-batch, got {sorted(inputs)}")
        (x,) = inputs.values()
        return self.down(F.gelu(self.up(self.ln(x))))


class Backbone(nn.Module):
    """``backbone``: token + position embedding of the merged rows with the projected modality tokens written at
    their columns, then GPT blocks -> hidden [R, L, H]."""

    def __init__(self, vocab: int, hidden: int, heads: int, ffn: int, layers: int, max_positions: int,
                 tile_tokens: int, pool: int):
        super().__init__()
        self.tile_tokens, self.pool = tile_tokens, pool
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(max_positions, hidden)
        self.blocks = nn.ModuleList(GPTBlock(hidden, heads, ffn) for _ in range(layers))

    def forward(self, inputs: dict, batch: dict) -> torch.Tensor:
        ids, seg, slot = layout(batch, self.tile_tokens, self.pool)
        h = self.tok(ids)
        if inputs:
            (x,) = inputs.values()
            if "audio_frames" in batch:  # the real audio tokens of each row, row-major
                real = torch.arange(x.shape[1], device=x.device)[None] < audio_tokens(batch, self.pool)[:, None]
                flat = x[real]
            else:  # vision: the tiles' tokens in tile order (row 0's tiles first)
                flat = x.reshape(-1, x.shape[-1])
            if flat.shape[0]:
                h = torch.where((slot > 0)[..., None], flat[(slot - 1).clamp(min=0)], h)
        state = (h + self.pos((seg.cumsum(-1) - 1).clamp(min=0)), seg)
        for b in self.blocks:
            state = b(state)
        return state[0]


class CaptionHead(nn.Module):
    """``head_caption``: final LayerNorm, LM head and the summed next-token loss on the merged rows' text
    positions (`summed_cross_entropy`: position t predicts the label at t + 1; in the model's dtype)."""

    def __init__(self, hidden: int, vocab: int, tile_tokens: int, pool: int):
        super().__init__()
        self.tile_tokens, self.pool = tile_tokens, pool
        self.ln = nn.LayerNorm(hidden)
        self.lm = nn.Linear(hidden, vocab)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[R, L, vocab] next-token logits of the backbone's output."""
        return self.lm(self.ln(h))

    def forward(self, inputs: dict, batch: dict):
        (h,) = inputs.values()
        return summed_cross_entropy(self.logits(h), merged_labels(batch, self.tile_tokens, self.pool), shift=True)

    def targets(self, batch: dict) -> int:
        """Target tokens of the micro-batch: merged labels past the first column that are not -100."""
        return int((merged_labels(batch, self.tile_tokens, self.pool)[:, 1:] != IGNORE_INDEX).sum())


class ClassifierHead(nn.Module):
    """``head_cls``: the mean of the backbone's output over each row's real tokens -> LayerNorm -> ``classes``
    logits; summed cross-entropy against ``class_labels`` [R] (-100 ignored)."""

    def __init__(self, hidden: int, classes: int, tile_tokens: int, pool: int):
        super().__init__()
        self.tile_tokens, self.pool = tile_tokens, pool
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, classes)

    def logits(self, h: torch.Tensor, batch: dict) -> torch.Tensor:
        """[R, classes] logits of the backbone's output ``h`` on ``batch``'s real tokens."""
        seg = layout(batch, self.tile_tokens, self.pool)[1].to(h.dtype)
        pooled = (h * seg[..., None]).sum(1) / seg.sum(1, keepdim=True).clamp(min=1)
        return self.out(self.ln(pooled))

    def forward(self, inputs: dict, batch: dict):
        (h,) = inputs.values()
        target = batch["class_labels"].long().reshape(-1)
        loss = F.cross_entropy(self.logits(h, batch), target, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, (target != IGNORE_INDEX).sum()

    def targets(self, batch: dict) -> int:
        """Rows with a class label."""
        return int((batch["class_labels"] != IGNORE_INDEX).sum())


# ---------------------------------------------------------------------------------------------
# the model


def mtmm_shape(batch: dict, task: str, tile_tokens: int, pool: int) -> TaskShape:
    """The `TaskShape` of an mtmm-tiny micro-batch of ``task``."""
    tiles = int(batch["image_tiles"].sum()) if "image_tiles" in batch else 0
    frames = int(batch["audio_values"].shape[1]) if "audio_values" in batch else 0
    return TaskShape(task, int(batch["input_ids"].shape[0]), merged_length(batch, tile_tokens, pool),
                     int(batch["input_ids"].shape[1]), tiles, frames)


def mtmm_sample_tokens(batch: dict, tile_tokens: int, pool: int) -> tuple[list, list, list]:
    """Per row of an mtmm-tiny micro-batch: (text tokens, vision tokens, audio tokens), in backbone tokens."""
    text = _text_lengths(batch)
    tiles = batch.get("image_tiles")
    vision = torch.zeros_like(text) if tiles is None else tiles.long().reshape(text.shape) * tile_tokens
    return text.tolist(), vision.tolist(), audio_tokens(batch, pool).tolist()


def _output_spec(c: dict, dtype: torch.dtype):
    tt, pool, hv, ha, h = c["tile_tokens"], c["audio_pool"], c["vision_hidden"], c["audio_hidden"], c["hidden"]

    def spec(name: str, shape: TaskShape) -> TensorSpec | None:
        if name == "vit":
            return TensorSpec((shape.tiles, tt, hv), dtype, True)
        if name == "audio":
            return TensorSpec((shape.rows, shape.audio_frames // pool, ha), dtype, True)
        if name == "projector":
            if shape.audio_frames:
                return TensorSpec((shape.rows, shape.audio_frames // pool, h), dtype, True)
            return TensorSpec((shape.tiles, tt, h), dtype, True)
        if name == "backbone":
            return TensorSpec((shape.rows, shape.input_len, h), dtype, True)
        if name in HEADS:
            return None
        raise KeyError(f"mtmm-tiny has no component {name!r} (components: {', '.join(COMPONENTS)})")
    return spec


def mtmm_random_batch(c: dict, tile_size: int, mel: int):
    """Synthetic mtmm-tiny micro-batches: ``make(path, rows, text_len, generator, tiles=0, audio_frames=0)`` for
    a task through the components ``path`` (``vit`` on it: ``tiles`` image tiles spread over the rows; ``audio``:
    ``audio_frames`` padded frames per row, each row 1..that many real; ``head_cls``: ``class_labels``). Row 0's
    text is ``text_len`` long, the others 1..text_len."""
    def make(path, rows: int, text_len: int, generator: torch.Generator | None = None, tiles: int = 0,
             audio_frames: int = 0) -> dict:
        gen = generator or torch.Generator().manual_seed(0)
        n = torch.randint(1, text_len + 1, (rows,), generator=gen)
        n[0] = text_len
        mask = (torch.arange(text_len)[None] < n[:, None]).long()
        ids = torch.randint(0, c["vocab"], (rows, text_len), generator=gen) * mask
        out = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}
        if "vit" in path:
            t = torch.zeros(rows, dtype=torch.long)
            t[0] = 1  # every image micro-batch has a tile in row 0
            if tiles > 1:
                t += torch.bincount(torch.randint(0, rows, (tiles - 1,), generator=gen), minlength=rows)
            out["image_tiles"] = t
            out["pixel_values"] = torch.randn(int(t.sum()), 3, tile_size, tile_size, generator=gen)
        if "audio" in path:
            if audio_frames < 1 or audio_frames % c["audio_pool"]:
                raise ValueError(f"audio_frames {audio_frames} must be a positive multiple of {c['audio_pool']}")
            fr = torch.randint(1, audio_frames + 1, (rows,), generator=gen)
            fr[0] = audio_frames
            out["audio_frames"] = fr
            out["audio_values"] = torch.randn(rows, audio_frames, mel, generator=gen) * \
                (torch.arange(audio_frames)[None] < fr[:, None])[..., None]
        if "head_cls" in path:
            out["class_labels"] = torch.randint(0, c["classes"], (rows,), generator=gen)
        return out
    return make


def mtmm_tiny(*, vocab: int | None = None, hidden: int | None = None, layers: int | None = None,
              heads: int | None = None, ffn: int | None = None, vision_hidden: int | None = None,
              vision_layers: int | None = None, audio_layers: int | None = None, classes: int | None = None,
              tile_size: int = 56, patch_size: int = 14, mel: int = 16, max_positions: int = 2048,
              max_frames: int = 4096, dtype: torch.dtype = torch.float32, seed: int = 0) -> ComponentModel:
    """mtmm-tiny as a `ComponentModel` with `dynabatch.core.multitask.zoo.MTMM_TINY`'s shapes (the graph's; the
    keywords override them for smaller test models: ``vision_hidden`` is the audio encoder's width too, as the
    shared projector reads both). Tiles are ``tile_size`` px squares of ``patch_size`` px patches (56 / 14: 16
    patches, pooled 2 x 2 into the graph's 4 tokens), audio frames ``mel`` bins wide. ``seed`` fixes the
    initialization (every rank builds the same model)."""
    from ...core.multitask.zoo import MTMM_TINY

    over = dict(vocab=vocab, hidden=hidden, layers=layers, heads=heads, ffn=ffn, vision_hidden=vision_hidden,
                vision_layers=vision_layers, audio_layers=audio_layers, classes=classes)
    c = {**MTMM_TINY, **{k: v for k, v in over.items() if v is not None}}
    c["audio_hidden"] = c["vision_hidden"]
    if vision_hidden is not None:
        c["vision_ffn"] = c["audio_ffn"] = 4 * vision_hidden
    if hidden is not None and ffn is None:
        c["ffn"] = 4 * hidden
    tt, pool = c["tile_tokens"], c["audio_pool"]
    torch.manual_seed(seed)
    modules = {
        "vit": VisionEncoder(tile_size, patch_size, c["vision_hidden"], c["vision_heads"], c["vision_ffn"],
                             c["vision_layers"], tt),
        "audio": AudioEncoder(mel, c["audio_hidden"], c["audio_heads"], c["audio_ffn"], c["audio_layers"], pool,
                              max_frames),
        "projector": SharedProjector(c["vision_hidden"], c["hidden"]),
        "backbone": Backbone(c["vocab"], c["hidden"], c["heads"], c["ffn"], c["layers"], max_positions, tt, pool),
        "head_caption": CaptionHead(c["hidden"], c["vocab"], tt, pool),
        "head_cls": ClassifierHead(c["hidden"], c["classes"], tt, pool),
    }
    model = ComponentModel("mtmm-tiny", modules, _output_spec(c, dtype),
                           lambda batch, task: mtmm_shape(batch, task, tt, pool),
                           lambda name, batch: modules[name].targets(batch), mtmm_random_batch(c, tile_size, mel),
                           lambda batch: mtmm_sample_tokens(batch, tt, pool))
    return model.to(dtype)


__all__ = ["COMPONENTS", "HEADS", "AudioEncoder", "Backbone", "CaptionHead", "ClassifierHead", "SharedProjector",
           "VisionEncoder", "audio_tokens", "layout", "merged_labels", "merged_length", "modality_tokens",
           "mtmm_sample_tokens", "mtmm_shape", "mtmm_tiny"]
