"""What the data side must know about the model it feeds, read from the model's own Hugging Face config.

`Tokenization(model=...)` (a ``save_pretrained`` folder, a ``config.json`` path, a config or a model
object; a tokenizer folder that holds a ``config.json`` is taken as the model too) fills, from the
config, what a user would otherwise have to repeat by hand and could get wrong without a word:

* the family: ``encoder_decoder`` when ``config.is_encoder_decoder``, else ``decoder``;
* ``decoder_start_token_id``: an encoder-decoder's first decoder input (BART-style checkpoints start
  with 2, T5 with the pad id 0), as ``generate()`` uses it;
* LLaVA-style vision settings: ``image_token_id`` and a `tokenization.FixedResolution` policy with the
  vision tower's image and patch size and the tokens per image its feature selection keeps, and the
  processor's pixel mean / std when the folder has ``preprocessor_config.json``;
* ``vocab_size``: the tokenizer's ids are checked against it before any step (an id past the
  embedding would fail deep inside the model with a bare ``IndexError``).

A value stated on `Tokenization` that disagrees with the config is kept and warned about (the user
said it); one left unset is taken from the config.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelMismatchWarning(UserWarning):
    """A `Tokenization` setting differs from what the model's config says."""


@dataclass(frozen=True)
class ModelFacts:
    """The model's facts the loader uses (see the module docstring); ``where`` names the model in messages."""

    where: str
    family: str
    vocab_size: int | None
    pad_token_id: int | None
    decoder_start_token_id: int | None
    image_token_id: int | None = None
    image_size: int | None = None
    patch_size: int | None = None
    tokens_per_image: int | None = None
    pixel_mean: tuple | None = None
    pixel_std: tuple | None = None

    @property
    def vision(self):
        """The `tokenization.FixedResolution` policy of a LLaVA-style model, else None."""
        if self.image_size is None:
            return None
        from tokenization import FixedResolution

        return FixedResolution(image_size=self.image_size, patch_size=self.patch_size,
                               tokens_per_image=self.tokens_per_image)


def _config(source) -> tuple[Any, str, Path | None] | None:
    """(config, name for messages, folder) of ``source``, or None when it names no model config."""
    if source is None:
        return None
    if hasattr(source, "config") and hasattr(source.config, "to_dict"):  # a model object
        return source.config, type(source).__name__, None
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):  # a config
        return source, type(source).__name__, None
    if isinstance(source, (str, Path)):
        path = Path(source)
        cfg = path if path.is_file() and path.name == "config.json" else path / "config.json"
        if not cfg.is_file():
            return None
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(cfg.parent if cfg.name == "config.json" else cfg)), str(path), cfg.parent
    return None


def _processor_pixels(folder: Path | None) -> tuple[tuple | None, tuple | None]:
    if folder is None or not (folder / "preprocessor_config.json").is_file():
        return None, None
    p = json.loads((folder / "preprocessor_config.json").read_text())
    mean, std = p.get("image_mean"), p.get("image_std")
    return (tuple(float(x) for x in mean) if mean else None, tuple(float(x) for x in std) if std else None)


def model_facts(source) -> ModelFacts | None:
    """The `ModelFacts` of a model folder / ``config.json`` / config / model object, None for anything else
    (a tokenizer name, a tokenizer object, a folder without ``config.json``)."""
    found = _config(source)
    if found is None:
        return None
    config, where, folder = found
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    vocab = getattr(text, "vocab_size", None)
    facts = dict(where=where, family="encoder_decoder" if seq2seq else "decoder",
                 vocab_size=int(vocab) if vocab else None, pad_token_id=getattr(config, "pad_token_id", None),
                 decoder_start_token_id=getattr(config, "decoder_start_token_id", None) if seq2seq else None)
    vision = getattr(config, "vision_config", None)
    if vision is not None and getattr(config, "image_token_id", None) is not None:
        size, patch = int(vision.image_size), int(vision.patch_size)
        drop_cls = getattr(config, "vision_feature_select_strategy", "default") == "default"
        # a CLIP tower adds a class token; "default" drops it, "full" keeps it
        has_cls = "clip" in str(getattr(vision, "model_type", "")).lower()
        per = (size // patch) ** 2 + int(has_cls and not drop_cls)
        mean, std = _processor_pixels(folder)
        facts.update(image_token_id=int(config.image_token_id), image_size=size, patch_size=patch,
                     tokens_per_image=per, pixel_mean=mean, pixel_std=std)
    return ModelFacts(**facts)


def _say(where: str, name: str, stated, config_value) -> None:
    warnings.warn(f"Tokenization({name}={stated!r}) differs from the model's config ({where}: {config_value!r}); "
                  f"the stated value is used. Leave {name} unset to take the config's", ModelMismatchWarning,
                  stacklevel=4)


def with_model_facts(tok, facts: ModelFacts | None):
    """``tok`` (a `Tokenization`) with the unset fields filled from ``facts``; stated ones that differ warn."""
    if facts is None:
        return tok
    fill: dict[str, Any] = {}
    wanted = {"family": facts.family, "decoder_start_token_id": facts.decoder_start_token_id,
              "image_token_id": facts.image_token_id}
    for name, value in wanted.items():
        stated = getattr(tok, name)
        if value is None:
            continue
        if stated is None:
            fill[name] = value
        elif stated != value:
            _say(facts.where, name, stated, value)
    if facts.vision is not None:
        if tok.vision is None:  # the model's vision settings, and its pixels (it needs them to train)
            fill["vision"] = facts.vision
            fill["load_pixels"] = True
        elif tok.vision.tokens(facts.image_size, facts.image_size).item() != facts.vision.image_tokens:
            _say(facts.where, "vision", tok.vision, facts.vision)
        if facts.pixel_mean is not None and tok.pixel_mean == type(tok).pixel_mean:
            fill["pixel_mean"] = facts.pixel_mean
        if facts.pixel_std is not None and tok.pixel_std == type(tok).pixel_std:
            fill["pixel_std"] = facts.pixel_std
    return dataclasses.replace(tok, **fill) if fill else tok


def check_vocabulary(tokenizer, facts: ModelFacts | None) -> None:
    """Refuse a tokenizer whose ids go past the model's embedding (``vocab_size``), naming both."""
    if facts is None or facts.vocab_size is None:
        return
    size = getattr(tokenizer, "vocab_size", None)
    if size is None:
        return
    if int(size) > facts.vocab_size:
        raise ValueError(
            f"the tokenizer has {int(size)} ids but the model ({facts.where}) embeds only {facts.vocab_size} "
            f"(vocab_size): ids {facts.vocab_size}..{int(size) - 1} would fail inside the embedding. Use the "
            "model's own tokenizer, or resize the model's embeddings (model.resize_token_embeddings) and save it")


__all__ = ["ModelFacts", "ModelMismatchWarning", "check_vocabulary", "model_facts", "with_model_facts"]
