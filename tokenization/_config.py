"""`FormatConfig`: a formatter's model family, max lengths, truncation and rendering settings (the record
`tokenization._format`'s `Formatter`, `tokenization._segments`' segment builders and `scan_shapes` read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ._chat import ChatOption, check_chat_option

Family = Literal["decoder", "encoder_decoder"]
OnError = Literal["raise", "skip"]



@dataclass(frozen=True)
class FormatConfig:
    """Model family, max lengths (tokens) and truncation policy.

    ``max_input_tokens`` caps the input part (BOS included), ``max_target_tokens`` the target
    part (EOS included; the EOS is always kept, the response is cut before it),
    ``max_total_tokens`` their sum. With a vision policy the sample's vision tokens count towards
    ``max_input_tokens`` and ``max_total_tokens`` (as the planner's ``max_len`` counts them:
    ``dynabatch.CostModel.sample_dims``) but are never cut: the text is cut to the limit less the
    vision tokens, and a sample whose vision tokens and BOS/EOS alone pass a limit is refused
    (`SampleError` naming it; skipped and counted with ``on_error="skip"``).
    When the sum is over, the input is shortened first, then the target. Inputs are cut on
    ``truncation_side`` ("right" keeps the start, "left" keeps the end, nearest the
    response); targets always keep their start. Conversations (decoder-only) are one
    sequence: only ``max_total_tokens`` applies, cutting on ``truncation_side``; BOS is kept.
    ``add_bos`` prepends the tokenizer's BOS id to the input (it counts as input).
    ``None`` means no limit.

    ``chat_template`` renders conversations (``messages``; see `tokenization._chat`): None (default)
    the tokenizer's own Jinja chat template when it has one (decoder-only), else the plain
    `ChatTemplate` with a `ChatTemplateWarning`; ``"tokenizer"`` its own template (an error without
    one); the text of a Jinja template; ``"plain"`` or a `ChatTemplate` the plain format. A Jinja
    template is applied by the tokenizer's ``apply_chat_template`` (a transformers tokenizer; the
    sample's ``tools`` are passed to it) and trains the assistant turns only (its ``{% generation %}``
    blocks, else the rendered-prefix diff); the template writes the special tokens (no EOS is
    added; ``add_bos`` adds BOS unless the template's ids start with it).

    ``pretokenized``: rows carry token ids (``input_ids``, optional ``labels``) instead of text;
    True: every row must, False: ids are ignored, None (default): a row without text that has
    ``input_ids`` is pre-tokenized. Such rows get no BOS/EOS added; decoder-only ones are cut
    like conversations (``max_total_tokens`` on ``truncation_side``), encoder-decoder ones like
    text (input on ``truncation_side``, targets keep their start).

    ``image_token_id`` (None: off) inserts image placeholder tokens (needs a vision policy in the
    `Formatter`): each image's run of ``image_token_id`` copies, as many as the image's vision
    tokens, replaces that image's ``"<image>"`` marker (`IMAGE_MARKER`) in the prompt (``inputs``,
    user/system turns; the k-th marker is the k-th image), or, when the sample has no marker, all
    runs go right after BOS, before the text. A sample needs one marker per image or none
    (`SampleError` otherwise, or for a marker in a response/assistant turn, or a marker without an
    image); a pre-tokenized row marks an image with one ``image_token_id`` in its ``input_ids``,
    which is expanded the same way. Labels are -100 on the runs. The runs are the vision tokens,
    so they count towards ``max_input_tokens`` and ``max_total_tokens`` as above and are never
    cut: the text around them is cut to make room, and a sample whose runs (plus BOS/EOS) alone
    pass a limit is refused. The id must be one the tokenizer never produces for
    text (e.g. ``tokenizer.vocab_size``, an id added for the model); a text that encodes to it is a
    `SampleError`.
    """

    family: Family = "decoder"
    max_input_tokens: int | None = None
    max_target_tokens: int | None = None
    max_total_tokens: int | None = None
    truncation_side: Literal["right", "left"] = "right"
    add_bos: bool = False
    chat_template: ChatOption = None
    pretokenized: bool | None = None
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in ("decoder", "encoder_decoder"):
            raise ValueError(f"family must be 'decoder' or 'encoder_decoder', got {self.family!r}")
        if self.truncation_side not in ("right", "left"):
            raise ValueError(f"truncation_side must be 'right' or 'left', got {self.truncation_side!r}")
        if self.pretokenized not in (None, True, False):
            raise ValueError(f"pretokenized must be True, False or None (auto), got {self.pretokenized!r}")
        check_chat_option(self.chat_template)
        tid = self.image_token_id
        if tid is not None and (isinstance(tid, bool) or not isinstance(tid, (int, np.integer)) or tid < 0):
            raise ValueError(f"image_token_id must be a token id (int >= 0) or None, got {tid!r}")
        b = int(self.add_bos)
        for name, least in (("max_input_tokens", max(b, 0)), ("max_target_tokens", 1), ("max_total_tokens", b + 1)):
            val = getattr(self, name)
            if val is not None and val < least:
                raise ValueError(f"{name} must be >= {least} (room for the special tokens), got {val}")


__all__ = ["Family", "FormatConfig", "OnError"]
