"""Formatting samples into model token sequences for the two model families.

Encoder-decoder: ``input_ids`` = [BOS] + inputs, ``target_ids`` = targets + EOS.
Decoder-only: ``input_ids`` = [BOS] + prompt + response + EOS with ``labels`` equal to the ids
on the response (+EOS) and ``IGNORE_INDEX`` (-100) on BOS and the prompt. Prompt and
response are tokenized separately (the usual SFT practice: the mask boundary is exact).

Pre-tokenized rows (``input_ids``, optional ``labels``: see `tokenization._pretokenized`) are
taken as they are. A batch is first laid out as a segment table (`tokenization._segments`: texts,
given ids, special tokens, image runs); every text of a batch goes to the tokenizer in one
``encode_batch`` call; truncation is plain numpy arithmetic on token counts, shared by the
formatters and `scan_shapes` so the length table always equals what the formatter produces. A
sample's vision tokens count towards the max lengths and are never cut (the text is cut to the
limit less them), as the planner's ``max_len`` counts text + vision tokens.

Image placeholders (opt-in, LLaVA-style: ``FormatConfig.image_token_id``): each image of a sample
becomes a run of ``image_token_id`` copies in ``input_ids``, one per vision token of that image
under the vision policy, at the image's `IMAGE_MARKER` (``"<image>"``) in the prompt, or (no
marker) all runs right after BOS, before the text; labels are -100 on them. The length table keeps
counting text only in ``input_tokens``/``target_tokens``, the runs in ``vision_tokens``, so the
planner (main length = input + target + vision tokens) counts every vision token once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ._adapters import load_tokenizer
from ._chat import ChatOption, ChatRenderer, resolve_chat
from ._config import Family, FormatConfig, OnError
from ._protocol import IGNORE_INDEX, SampleError, Tokenizer
from ._segments import (PART_INPUT, PART_TARGET, PART_VISION, ImageRuns, SegmentTable, add_sample, is_conversation,
                        sample_key)
from ._vision import VisionPolicy, image_tokens_batch

@dataclass(frozen=True, eq=False)
class EncodedSample:
    """One formatted sample.

    ``input_ids`` are the encoder input (encoder-decoder) or the whole sequence
    (decoder-only); ``target_ids`` are the decoder targets (encoder-decoder only, else
    None); ``labels`` align with ``input_ids`` with -100 on masked positions (decoder-only,
    else None). ``input_tokens``/``target_tokens`` are the text token counts written to the
    length table (decoder-only: prompt/masked part and response part). ``vision_tokens`` is the
    sample's image token count and ``truncated`` says whether any text token was cut. Ids are
    int32 arrays. Decoder-only, ``len(input_ids)`` is ``input_tokens + target_tokens``, plus
    ``vision_tokens`` with image placeholders (`FormatConfig.image_token_id`: the runs are in
    ``input_ids`` but in neither text count); encoder-decoder, ``len(input_ids)`` is
    ``input_tokens`` (+ ``vision_tokens`` with placeholders), ``len(target_ids)`` is
    ``target_tokens``.
    """

    sample_id: int
    input_ids: np.ndarray
    target_ids: np.ndarray | None
    labels: np.ndarray | None
    input_tokens: int
    target_tokens: int
    vision_tokens: int
    truncated: bool




def _sample_id(sample: dict) -> int:
    value = sample.get("sample_id")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SampleError(sample_key(sample), f"needs an integer 'sample_id', got {value!r}")
    return int(value)


def _position_keep(lens: np.ndarray, owner: np.ndarray, budget: np.ndarray, n: int, from_end: bool) -> np.ndarray:
    """Tokens kept of each piece (``lens``, grouped by ``owner`` in sequence order) when sample ``s``
    keeps ``budget[s]`` tokens of its pieces, from their start, or from their end with ``from_end``."""
    ends = np.cumsum(lens)
    totals = np.bincount(owner, weights=lens, minlength=n).astype(np.int64)
    end_in_sample = ends - (np.cumsum(totals) - totals)[owner]
    before = totals[owner] - end_in_sample if from_end else end_in_sample - lens
    return np.clip(budget[owner] - before, 0, lens)


def _keep_counts(
    lengths: np.ndarray, sample: np.ndarray, part: np.ndarray, is_text: np.ndarray, conv: np.ndarray,
    pre: np.ndarray, vis: np.ndarray, cfg: FormatConfig
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens kept per segment, refused samples) under the max lengths (vectorised over the batch).
    ``is_text``: the segments that may be cut (texts, given ids); ``pre``: the pre-tokenized samples
    (they have no BOS/EOS of the formatter's); ``vis``: each sample's vision tokens. Vision tokens
    (image placeholder runs, `PART_VISION`, or the ones the model inserts) are kept whole and take
    their room first; a sample whose vision and special tokens alone pass a limit is refused."""
    keep = lengths.copy()
    n = len(conv)
    bos = np.where(pre, 0, int(cfg.add_bos))
    eos = np.where(pre, 0, 1)
    seg_conv = conv[sample]
    refused = np.zeros(n, bool)
    left = cfg.truncation_side == "left"

    # Plain samples: the input pieces are cut first (on truncation_side), then the target pieces
    # (keeping their start); specials and vision tokens (image runs or not) are always kept.
    plain = ~seg_conv & is_text
    p_sel, r_sel = plain & (part == PART_INPUT), plain & (part == PART_TARGET)
    p = np.bincount(sample[p_sel], weights=lengths[p_sel], minlength=n).astype(np.int64)
    r = np.bincount(sample[r_sel], weights=lengths[r_sel], minlength=n).astype(np.int64)
    if cfg.max_input_tokens is not None:
        room = cfg.max_input_tokens - bos - vis
        refused |= ~conv & (room < 0)
        p = np.minimum(p, np.maximum(room, 0))
    if cfg.max_target_tokens is not None:
        r = np.minimum(r, cfg.max_target_tokens - eos)
    if cfg.max_total_tokens is not None:
        room = cfg.max_total_tokens - bos - eos - vis
        refused |= ~conv & (room < 0)
        over = np.maximum(p + r - np.maximum(room, 0), 0)
        cut_p = np.minimum(over, p)
        p, r = p - cut_p, r - (over - cut_p)
    keep[p_sel] = _position_keep(lengths[p_sel], sample[p_sel], p, n, left)
    keep[r_sel] = _position_keep(lengths[r_sel], sample[r_sel], r, n, False)

    # Conversations: cut by position, BOS and image runs excluded, from the end ("right") or start ("left").
    if cfg.max_total_tokens is not None and seg_conv.any():
        body = seg_conv & (part != PART_VISION) & ~((part == PART_INPUT) & ~is_text)
        room = cfg.max_total_tokens - bos - vis
        refused |= conv & (room < 0)
        keep[body] = _position_keep(lengths[body], sample[body], np.maximum(room, 0), n, left)
    return keep, refused


@dataclass
class _TokenizedBatch:
    """One tokenized batch (not a plan: the planners' records are in dynabatch): per kept sample counts plus
    the segment table (ids already cut)."""

    index: np.ndarray  # positions of the kept samples in the batch
    sample_id: np.ndarray
    input_tokens: np.ndarray
    target_tokens: np.ndarray
    vision_tokens: np.ndarray
    truncated: np.ndarray
    skipped: list[tuple[int, SampleError]]
    seg_sample: np.ndarray
    seg_ids: list[np.ndarray]
    seg_trained: np.ndarray
    seg_part: np.ndarray
    seg_labels: list[np.ndarray | None]  # given labels of pre-tokenized pieces (cut like seg_ids)


def tokenize_batch(
    samples: Sequence[dict],
    tokenizer: Tokenizer,
    cfg: FormatConfig,
    vision: VisionPolicy | None = None,
    on_error: OnError = "raise",
    with_ids: bool = True,
    chat: ChatRenderer | None = None,
) -> _TokenizedBatch:
    """Tokenize and truncate a batch; the shared core of `Formatter` and `scan_shapes`. ``chat``: how
    conversations are rendered (default: `resolve_chat` of ``cfg.chat_template``)."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if cfg.image_token_id is not None and vision is None:
        raise ValueError("image_token_id needs a vision policy (it sets each image's placeholder count)")
    chat = chat or resolve_chat(cfg.chat_template, tokenizer, cfg.family)
    per_image, skipped = image_tokens_batch(samples, vision, on_error=on_error)
    vis = np.fromiter((int(a.sum()) for a in per_image), np.int64, count=len(per_image))
    bad = {i for i, _ in skipped}
    talks = [i for i, s in enumerate(samples) if i not in bad and is_conversation(s, cfg.pretokenized)]
    if talks:
        chat.announce()
    # A Jinja template renders and tokenizes whole conversations (one apply_chat_template call per batch).
    rendered = dict(zip(talks, chat.render([samples[i] for i in talks], tokenizer))) if talks and chat.jinja else {}
    seg = SegmentTable()
    kept: list[int] = []
    sample_ids: list[int] = []
    conv: list[bool] = []
    pre: list[bool] = []
    for i, s in enumerate(samples):
        if i in bad:
            continue
        mark, text_mark = len(seg.sample), len(seg.texts)
        try:
            sid = _sample_id(s)
            c, given = add_sample(seg, len(kept), s, cfg, tokenizer, ImageRuns(s, per_image[i], cfg.image_token_id),
                                   chat.plain, rendered.get(i))
        except SampleError as exc:
            if on_error != "skip":
                raise
            for lst in seg.lists():
                del lst[mark:]
            del seg.texts[text_mark:]
            skipped.append((i, exc))
            continue
        kept.append(i)
        sample_ids.append(sid)
        conv.append(c)
        pre.append(given)
    skipped.sort(key=lambda e: e[0])

    counter = getattr(tokenizer, "count_batch", None)
    if with_ids or counter is None or cfg.image_token_id is not None:  # placeholders: the ids are checked
        encoded = tokenizer.encode_batch(seg.texts) if seg.texts else []
        counts = [len(a) for a in encoded]
    else:  # a length scan needs counts only: skip building id arrays
        encoded = []
        counts = counter(seg.texts) if seg.texts else []
    text_idx = np.asarray(seg.text, dtype=np.int64)
    is_text = text_idx >= 0
    is_ids = np.fromiter((a is not None for a in seg.ids), bool, count=len(seg.ids))
    lengths = np.ones(len(text_idx), dtype=np.int64)
    lengths[is_text] = counts  # texts were numbered in segment order
    lengths[is_ids] = [len(a) for a in seg.ids if a is not None]
    sample = np.asarray(seg.sample, dtype=np.int64)
    part = np.asarray(seg.part, dtype=np.int64)
    kept_vis = vis[kept] if kept else np.zeros(0, np.int64)
    keep, refused = _keep_counts(lengths, sample, part, is_text | is_ids, np.asarray(conv, dtype=bool),
                                 np.asarray(pre, dtype=bool), kept_vis, cfg)
    errors = _refusals(samples, kept, encoded, sample[is_text], kept_vis, refused, tokenizer, cfg)
    if errors:
        if on_error != "skip":
            raise errors[0][1]
        # Rare: plan the batch again without them (their positions join the skipped ones).
        drop = {i for i, _ in errors}
        rest = [i for i in range(len(samples)) if i not in drop]
        sub = tokenize_batch([samples[i] for i in rest], tokenizer, cfg, vision, on_error, with_ids, chat)
        sub.index = np.asarray(rest, np.int64)[sub.index]
        sub.skipped = sorted([(rest[i], e) for i, e in sub.skipped] + errors, key=lambda e: e[0])
        return sub

    n = len(kept)
    inp = np.bincount(sample, weights=keep * (part == PART_INPUT), minlength=n).astype(np.int64)
    tgt = np.bincount(sample, weights=keep * (part == PART_TARGET), minlength=n).astype(np.int64)
    truncated = np.bincount(sample, weights=keep < lengths, minlength=n) > 0

    seg_ids: list[np.ndarray] = []
    seg_labels: list[np.ndarray | None] = []
    if with_ids:
        # Which end a cut text keeps: inputs and conversations follow truncation_side,
        # plain targets always keep their beginning.
        from_end = (cfg.truncation_side == "left") & ((part == PART_INPUT) | np.asarray(conv, dtype=bool)[sample])
        for j in range(len(text_idx)):
            if is_text[j]:
                piece = encoded[text_idx[j]]
            else:
                piece = seg.ids[j] if is_ids[j] else np.array([seg.special[j]], dtype=np.int32)
            k = int(keep[j])
            cut = slice(len(piece) - k, None) if from_end[j] else slice(0, k)
            seg_ids.append(piece[cut])
            seg_labels.append(None if seg.labels[j] is None else seg.labels[j][cut])
    return _TokenizedBatch(  # per kept sample, then the segment table
        index=np.asarray(kept, dtype=np.int64), sample_id=np.asarray(sample_ids, dtype=np.int64),
        input_tokens=inp, target_tokens=tgt, vision_tokens=kept_vis, truncated=truncated, skipped=skipped,
        seg_sample=sample, seg_ids=seg_ids, seg_trained=np.asarray(seg.trained, dtype=bool), seg_part=part,
        seg_labels=seg_labels)


def _refusals(samples: Sequence[dict], kept: list[int], encoded: list[np.ndarray], text_sample: np.ndarray,
              vis: np.ndarray, refused: np.ndarray, tok: Tokenizer, cfg: FormatConfig) -> list[tuple[int, SampleError]]:
    """``(batch position, error)`` of the kept samples the max lengths or image placeholders rule out,
    in order: vision tokens (``vis``) that leave no room under the max lengths (``refused``), or, with
    ``image_token_id``, a text that encodes to it."""
    tid = cfg.image_token_id
    hit = np.zeros(len(kept), bool)
    if tid is not None and encoded:
        flat = np.concatenate(encoded)
        owner = np.repeat(text_sample, [len(a) for a in encoded])  # texts are numbered in segment order
        hit[owner[flat == tid]] = True
    out = []
    for k in np.flatnonzero(hit | refused):
        s = samples[kept[k]]
        if hit[k]:
            msg = (f"its text encodes to image_token_id {tid}, the image placeholder: use an id tokenizer "
                   f"{tok.name!r} never produces for text (e.g. its vocab_size {tok.vocab_size})")
        else:
            what, never = (("placeholder", "an image's placeholder run is never cut") if tid is not None else
                           ("vision", "vision tokens count towards the max lengths and an image is never cut"))
            msg = (f"its images need {int(vis[k])} {what} tokens, more than the max lengths leave room for "
                   f"(max_input_tokens={cfg.max_input_tokens}, max_total_tokens={cfg.max_total_tokens} tokens, "
                   f"BOS/EOS included): {never}")
        out.append((kept[k], SampleError(sample_key(s), msg)))
    return out


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, np.int32)


def _labels(plan: _TokenizedBatch, j: int) -> np.ndarray:
    """Decoder-only labels of segment ``j``: given ones, else its ids when trained, else -100."""
    if plan.seg_labels[j] is not None:
        return plan.seg_labels[j]
    return plan.seg_ids[j] if plan.seg_trained[j] else np.full(len(plan.seg_ids[j]), IGNORE_INDEX, np.int32)


#: The default of a `Formatter` keyword not given (the `FormatConfig` default applies).
_UNSET: Any = object()


class Formatter:
    """Turns samples into `EncodedSample` s for one tokenizer, family and set of max lengths.

    ``vision`` (a `FixedResolution` or `DynamicTiling`) fills ``vision_tokens``. By default image
    placeholder tokens are not inserted into the ids (they are model specific: the model inserts
    its vision tokens itself), the count is reported separately (and counts towards the max
    lengths: see `FormatConfig`); with
    ``FormatConfig.image_token_id`` each image's run of placeholders is inserted LLaVA-style (see
    `FormatConfig`). The keywords after ``vision`` are the `FormatConfig` fields of their names (documented
    there); those given build the `FormatConfig` when ``config`` is not given (not both).
    ``tokenizer`` may be a `load_tokenizer` spec. ``chat`` is the resolved conversation rendering
    (`FormatConfig.chat_template`; ``chat.record()`` names it).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str,
        config: FormatConfig | None = None,
        *,
        vision: VisionPolicy | None = None,
        family: Family = _UNSET,
        max_input_tokens: int | None = _UNSET,
        max_target_tokens: int | None = _UNSET,
        max_total_tokens: int | None = _UNSET,
        truncation_side: str = _UNSET,
        add_bos: bool = _UNSET,
        chat_template: ChatOption = _UNSET,
        pretokenized: bool | None = _UNSET,
        image_token_id: int | None = _UNSET,
    ) -> None:
        config_kwargs = {k: v for k, v in (
            ("family", family), ("max_input_tokens", max_input_tokens), ("max_target_tokens", max_target_tokens),
            ("max_total_tokens", max_total_tokens), ("truncation_side", truncation_side), ("add_bos", add_bos),
            ("chat_template", chat_template), ("pretokenized", pretokenized), ("image_token_id", image_token_id),
        ) if v is not _UNSET}
        if config is not None and config_kwargs:
            raise TypeError("pass either config= or FormatConfig keyword arguments, not both")
        self.config = config if config is not None else FormatConfig(**config_kwargs)
        tokenizer = load_tokenizer(tokenizer)
        if self.config.add_bos and tokenizer.bos_id is None:
            raise ValueError(f"add_bos=True but tokenizer {tokenizer.name!r} has no BOS token")
        if self.config.image_token_id is not None and vision is None:
            raise ValueError("image_token_id needs a vision policy (vision=DynamicTiling() or FixedResolution()): "
                             "it sets how many placeholder tokens each image gets")
        self.tokenizer = tokenizer
        self.vision = vision
        self.chat = resolve_chat(self.config.chat_template, tokenizer, self.config.family)

    def encode(self, sample: dict) -> EncodedSample:
        """Format one sample (raises `SampleError` for a bad sample)."""
        result = self.encode_batch([sample])[0]
        assert result is not None
        return result

    def encode_batch(self, samples: Sequence[dict], *, on_error: OnError = "raise") -> list[EncodedSample | None]:
        """Format a list of samples with one batched tokenizer call.

        With ``on_error="skip"`` a sample raising `SampleError` (bad fields, unreadable
        image) gives ``None`` at its position instead of failing the batch.
        """
        samples = list(samples)
        plan = tokenize_batch(samples, self.tokenizer, self.config, self.vision, on_error, chat=self.chat)
        out: list[EncodedSample | None] = [None] * len(samples)
        bounds = np.searchsorted(plan.seg_sample, np.arange(len(plan.index) + 1))
        decoder = self.config.family == "decoder"
        for k, pos in enumerate(plan.index):
            segs = range(bounds[k], bounds[k + 1])
            if decoder:
                input_ids = _cat([plan.seg_ids[j] for j in segs])
                labels = _cat([_labels(plan, j) for j in segs])
                target_ids = None
            else:
                input_ids = _cat([plan.seg_ids[j] for j in segs if plan.seg_part[j] != PART_TARGET])
                target_ids = _cat([plan.seg_ids[j] for j in segs if plan.seg_part[j] == PART_TARGET])
                labels = None
            out[pos] = EncodedSample(
                sample_id=int(plan.sample_id[k]),
                input_ids=input_ids,
                target_ids=target_ids,
                labels=labels,
                input_tokens=int(plan.input_tokens[k]),
                target_tokens=int(plan.target_tokens[k]),
                vision_tokens=int(plan.vision_tokens[k]),
                truncated=bool(plan.truncated[k]),
            )
        return out
