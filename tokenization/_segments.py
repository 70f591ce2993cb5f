"""A batch's samples laid out as a segment table, the pieces `tokenize_batch` tokenizes and cuts.

One row per piece of a sample's sequence, in order: a text (prompt, response, conversation turns
rendered with the plain `ChatTemplate`), given ids (pre-tokenized rows, or conversations a Jinja chat
template rendered: `tokenization._chat`), given ids (pre-tokenized rows, with their labels), one special
token (BOS/EOS) or an image's placeholder run. Each row says which length-table column its tokens
count towards (``PART_*``) and whether they are trained. Nothing here tokenizes or truncates: a
text's length (tokens) is only known after the batch's one ``encode_batch`` call.

Image placeholders (opt-in: ``FormatConfig.image_token_id``): `ImageRuns` puts one run of
``image_token_id`` copies per image, as long as the image's vision tokens, at the image's
`IMAGE_MARKER` (``"<image>"``) in the prompt, or (no marker) all runs right after BOS, before the
text. The runs are `PART_VISION` rows: vision tokens, never cut, -100 in the labels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ._chat import content_text, jinja_messages, plain_messages
from ._pretokenized import ids_holder, label_runs, pretokenized_ids
from ._protocol import IGNORE_INDEX, SampleError, Tokenizer

if TYPE_CHECKING:
    from ._chat import ChatTemplate
    from ._config import FormatConfig

#: Marker of an image's position in a prompt (equal to ``loaders.IMAGE_PLACEHOLDER``; this package
#: does not import ``loaders``). Only read with ``FormatConfig.image_token_id`` set.
IMAGE_MARKER = "<image>"


def sample_key(sample: dict) -> object:
    """The name used for a sample in error messages: its ``key``, else its ``sample_id``."""
    return sample.get("key", sample.get("sample_id"))


def _text_field(sample: dict, name: str, required: bool) -> str:
    value = sample.get(name)
    if value is None:
        if required:
            raise SampleError(sample_key(sample), f"has no {name!r} text")
        return ""
    if not isinstance(value, str):
        raise SampleError(sample_key(sample), f"field {name!r} must be a str, got {type(value).__name__}")
    return value


# Segment table of a batch: one row per piece of a sequence, in order. A piece is a text
# (index into the batch's text list), given ids (pre-tokenized rows, with their labels), one
# special token or an image's placeholder run. PART_* says which length-table column it counts
# towards (PART_VISION: vision_tokens; the run sits in the input ids and is never cut).
PART_INPUT, PART_TARGET, PART_VISION = 0, 1, 2


class SegmentTable:
    """A batch's segment table (see the module docstring): entry ``k`` of each list describes piece ``k``;
    ``text[k]`` indexes ``texts`` (the texts to encode, once each) or is -1."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.sample: list[int] = []
        self.text: list[int] = []  # -1 for a special token
        self.special: list[int] = []
        self.part: list[int] = []
        self.trained: list[bool] = []
        self.ids: list[np.ndarray | None] = []
        self.labels: list[np.ndarray | None] = []

    def lists(self) -> tuple[list, ...]:
        """The per-piece lists: sample, text, special, part, trained, ids, labels."""
        return self.sample, self.text, self.special, self.part, self.trained, self.ids, self.labels

    def add(self, sample: int, part: int, trained: bool, text: str | None = None, special: int = -1,
            ids: np.ndarray | None = None, labels: np.ndarray | None = None) -> None:
        """Append one piece of sample ``sample`` (its batch position): a text, a special token id or given ids
        (with their labels), counted towards column ``part`` (``PART_*``)."""
        self.sample.append(sample)
        self.part.append(part)
        self.trained.append(trained)
        self.special.append(special)
        self.ids.append(ids)
        self.labels.append(labels)
        if text is None:
            self.text.append(-1)
        else:
            self.text.append(len(self.texts))
            self.texts.append(text)


def _render_history(msgs: list[tuple[str, str]], t: ChatTemplate) -> str:
    return "".join(t.prefix(role) + content + t.turn_suffix for role, content in msgs)


class ImageRuns:
    """One sample's image placeholder runs (`FormatConfig.image_token_id`), handed out in image order:
    one at each `IMAGE_MARKER` of the prompt texts (``in_place``), else all before the text. Inert
    (``on`` False) without ``image_token_id``."""

    def __init__(self, sample: dict, tokens: np.ndarray, token_id: int | None) -> None:
        self.key, self.tokens, self.id = sample_key(sample), tokens, token_id
        self.next, self.in_place = 0, False

    @property
    def on(self) -> bool:
        """True with an ``image_token_id`` (placeholders are inserted)."""
        return self.id is not None

    def check_texts(self, prompts: Sequence[str], responses: Sequence[str]) -> None:
        """Count the markers of the prompt-side and the trained texts; decide where the runs go."""
        if not self.on:
            return
        if any(IMAGE_MARKER in r for r in responses):
            raise SampleError(self.key, f"has an {IMAGE_MARKER} marker in a response/assistant turn: image "
                                        "placeholders go in the prompt")
        self.decide(sum(p.count(IMAGE_MARKER) for p in prompts))

    def decide(self, markers: int) -> None:
        """``markers`` image marks in the sample: one per image (runs in place) or none (runs first)."""
        n = len(self.tokens)
        if markers and not n:
            raise SampleError(self.key, f"has {markers} {IMAGE_MARKER} marker(s) but no image")
        if markers not in (0, n):
            raise SampleError(self.key, f"has {n} image(s) but {markers} {IMAGE_MARKER} marker(s): give one marker "
                                        "per image (in image order) or none (the images then go before the text)")
        self.in_place = markers > 0

    def add_run(self, seg: SegmentTable, i: int) -> None:
        """Append the next image's run: its vision tokens' count of ``image_token_id``."""
        n = int(self.tokens[self.next])
        self.next += 1
        seg.add(i, PART_VISION, False, ids=np.full(n, self.id, np.int32))

    def add_leading(self, seg: SegmentTable, i: int) -> None:
        """Every run, for a sample without markers (called where its text starts, after BOS)."""
        if self.on and not self.in_place:
            while self.next < len(self.tokens):
                self.add_run(seg, i)

    def add_text(self, seg: SegmentTable, i: int, part: int, trained: bool, text: str) -> None:
        """Append a prompt-side text, with the next image's run in place of each marker."""
        if not self.in_place:
            seg.add(i, part, trained, text=text)
            return
        for k, piece in enumerate(text.split(IMAGE_MARKER)):
            if k:
                self.add_run(seg, i)
            seg.add(i, part, trained, text=piece)


def _add_ids(seg: SegmentTable, i: int, holder: dict, sample: dict, cfg: FormatConfig, tok: Tokenizer,
             images: ImageRuns) -> bool:
    """Append a pre-tokenized sample's segments (no special tokens); True: cut it by position. With
    placeholders each ``image_token_id`` in the ids marks an image and becomes that image's run."""
    ids, labels = pretokenized_ids(holder, sample, cfg.family, tok, image_token_id=cfg.image_token_id)
    decoder = cfg.family == "decoder"
    marks = np.zeros(0, np.int64)
    if images.on:
        marks = np.flatnonzero(ids == images.id)
        images.decide(len(marks))
        if not decoder and np.any(labels == images.id):
            raise SampleError(images.key, f"target ids hold image_token_id {images.id}: images go in the input")
    if not decoder:
        _add_id_pieces(seg, i, ids, marks, images, lambda a, b: seg.add(i, PART_INPUT, False, ids=ids[a:b]))
        seg.add(i, PART_TARGET, True, ids=labels)
    elif labels is None:  # language-modelling rows: every token is trained
        _add_id_pieces(seg, i, ids, marks, images, lambda a, b: seg.add(i, PART_TARGET, True, ids=ids[a:b]))
    else:
        trained = labels != IGNORE_INDEX
        _add_id_pieces(seg, i, ids, marks, images,
                       lambda a, b: _add_runs(seg, i, ids[a:b], trained[a:b], labels[a:b]))
    return decoder


def _add_id_pieces(seg: SegmentTable, i: int, ids: np.ndarray, marks: np.ndarray, images: ImageRuns, add) -> None:
    """The runs before the ids (no marks), then ``add(start, stop)`` for each piece of ``ids`` between the
    image marks (positions ``marks``), each mark replaced by that image's placeholder run."""
    images.add_leading(seg, i)
    cuts = [-1, *marks.tolist(), len(ids)]
    for k in range(len(cuts) - 1):
        if k:
            images.add_run(seg, i)
        a, b = cuts[k] + 1, cuts[k + 1]
        if a < b:
            add(a, b)


def _add_runs(seg: SegmentTable, i: int, ids: np.ndarray, trained: np.ndarray, labels: np.ndarray | None) -> None:
    """One id segment per run of trained (`PART_TARGET`) and masked (`PART_INPUT`) tokens; ``labels``:
    the given labels of a pre-tokenized row (None: the ids where trained)."""
    for c, d, t in label_runs(np.where(trained, 0, IGNORE_INDEX)):  # runs of the trained flags
        seg.add(i, PART_TARGET if t else PART_INPUT, t, ids=ids[c:d], labels=None if labels is None else labels[c:d])


def _add_rendered(seg: SegmentTable, i: int, sample: dict, rendered: tuple[np.ndarray, np.ndarray], cfg: FormatConfig,
                  tok: Tokenizer, images: ImageRuns) -> None:
    """Append a decoder-only conversation that a Jinja chat template rendered: its ids in runs of
    trained (assistant) and masked tokens. With image placeholders each ``image_token_id`` in the ids
    (the tokenizer's encoding of an ``<image>`` marker) becomes that image's run."""
    ids, trained = rendered
    bos = len(ids) > 0 and ids[0] == tok.bos_id  # the template's own BOS: image runs without markers go after it
    if cfg.add_bos:  # one BOS, kept by truncation
        seg.add(i, PART_INPUT, False, special=tok.bos_id)
    elif bos:
        seg.add(i, PART_INPUT, False, ids=ids[:1])
    if bos:
        ids, trained = ids[1:], trained[1:]
    marks = np.zeros(0, np.int64)
    if images.on:
        msgs = jinja_messages(sample)
        images.check_texts([content_text(m.get("content")) for m in msgs if m["role"] != "assistant"],
                           [content_text(m.get("content")) for m in msgs if m["role"] == "assistant"])
        marks = np.flatnonzero(ids == images.id)
        want = len(images.tokens) if images.in_place else 0
        if len(marks) != want:
            raise SampleError(images.key, f"its {want} {IMAGE_MARKER} marker(s) render to {len(marks)} "
                                          f"image_token_id {images.id} token(s) under the chat template: the "
                                          f"tokenizer must encode {IMAGE_MARKER} as that one id (add it as a special "
                                          "token) and the template must not write image tokens of its own")
    _add_id_pieces(seg, i, ids, marks, images, lambda a, b: _add_runs(seg, i, ids[a:b], trained[a:b], None))


def is_conversation(sample: dict, pretokenized: bool | None) -> bool:
    """Whether the sample is formatted as a conversation (it has ``messages`` and is not pre-tokenized)."""
    if not sample.get("messages"):
        return False
    try:
        return ids_holder(sample, pretokenized) is None
    except SampleError:  # pretokenized=True and no ids: add_sample names it
        return False


def add_sample(seg: SegmentTable, i: int, sample: dict, cfg: FormatConfig, tok: Tokenizer, images: ImageRuns,
                t: ChatTemplate | None, rendered: tuple[np.ndarray, np.ndarray] | SampleError | None = None,
                ) -> tuple[bool, bool]:
    """Append sample ``i``'s segments; returns (cut by position, pre-tokenized): the first is True
    for a decoder-only conversation or pre-tokenized row. ``t``: the plain chat template (None when a
    Jinja template renders the conversations); ``rendered``: the sample's Jinja rendering (ids, trained)."""
    holder = ids_holder(sample, cfg.pretokenized)
    if holder is not None:
        return _add_ids(seg, i, holder, sample, cfg, tok, images), True
    if isinstance(rendered, SampleError):
        raise rendered
    if rendered is not None:
        _add_rendered(seg, i, sample, rendered, cfg, tok, images)
        return True, False
    msgs = plain_messages(sample, t) if t is not None else None
    decoder = cfg.family == "decoder"
    if msgs is not None and decoder:
        images.check_texts([c for r, c in msgs if r != "assistant"], [c for r, c in msgs if r == "assistant"])
        if cfg.add_bos:
            seg.add(i, PART_INPUT, False, special=tok.bos_id)
        images.add_leading(seg, i)
        pending = ""  # consecutive masked text is encoded as one piece
        for role, content in msgs:
            if role != "assistant":
                pending += t.prefix(role) + content + t.turn_suffix
                continue
            images.add_text(seg, i, PART_INPUT, False, pending + t.assistant_prefix)
            pending = ""
            seg.add(i, PART_TARGET, True, text=content)
            seg.add(i, PART_TARGET, True, special=tok.eos_id)
        if pending:
            images.add_text(seg, i, PART_INPUT, False, pending)
        return True, False
    if msgs is not None:
        last_is_reply = msgs[-1][0] == "assistant"
        prompt = _render_history(msgs[:-1] if last_is_reply else msgs, t)
        response = msgs[-1][1] if last_is_reply else ""
    else:
        prompt = _text_field(sample, "inputs", required=True)
        response = _text_field(sample, "targets", required=False)
    images.check_texts([prompt], [response])
    # Decoder-only text without a response is language-modelling data: train on all of it.
    lm = decoder and not response
    if cfg.add_bos:
        seg.add(i, PART_INPUT, False, special=tok.bos_id)
    images.add_leading(seg, i)
    images.add_text(seg, i, PART_INPUT, lm, prompt)
    seg.add(i, PART_TARGET, True, text=response)
    seg.add(i, PART_TARGET, True, special=tok.eos_id)
    return False, False
