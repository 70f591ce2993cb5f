"""What a user's model folder is, before a long run: family, layers and how they split over stages, the
parameter bytes each stage holds, the tokenizer against the model's vocabulary, the decoder start and the
vision settings the data will be made with. Nothing is trained; only tensor names and shapes are read
(the model is built on the meta device), so this takes seconds for any size of model.

Every finding that would make the run wrong or fail late is a `Problem` with what to do; `FolderReport`
collects them for ``dynabatch check`` (which exits 1 on any) and for launchers that want to refuse early
(`folder_report` raises nothing itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    """A finding that makes the run wrong or fail: ``what`` is wrong, ``fix`` says what to do."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}. {self.fix}"


@dataclass
class FolderReport:
    """A model folder as the pipeline and the DataLoader will see it (units: layers, bytes, tokens)."""

    folder: str
    model_class: str = ""
    family: str = ""
    num_layers: int = 0
    bounds: tuple[int, ...] = ()
    stage_bytes: tuple[int, ...] = ()  # distinct parameter bytes each stage holds (shared ones on each)
    tokenizer: str = ""
    tokenizer_spec: str | None = None  # what the loader is given: the folder, the bytes tokenizer, or --tokenizer
    tokenizer_ids: int | None = None
    vocab_size: int | None = None
    decoder_start_token_id: int | None = None
    vision: str | None = None
    problems: list[Problem] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The report as lines of text."""
        out = [f"model      {self.folder}: {self.model_class}, family {self.family}, {self.num_layers} layers"]
        if self.bounds:
            out.append(f"split      {len(self.bounds) - 1} stage(s), layer bounds {list(self.bounds)}")
            for s, b in enumerate(self.stage_bytes):
                out.append(f"  stage {s}  layers {self.bounds[s]}..{self.bounds[s + 1] - 1}: {b / 2 ** 20:.2f} MiB "
                           "of parameters")
        if self.tokenizer:
            out.append(f"tokenizer  {self.tokenizer}: {self.tokenizer_ids} ids, the model embeds {self.vocab_size}")
        if self.decoder_start_token_id is not None:
            out.append(f"decoder    starts with id {self.decoder_start_token_id} (config.decoder_start_token_id)")
        if self.vision:
            out.append(f"vision     {self.vision}")
        return out


def _stage_bytes(model, bounds) -> tuple[int, ...]:
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        seen, total = set(), 0
        for i in range(a, b):
            for p in model.layers[i].parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
        out.append(total)
    return tuple(out)


def folder_report(folder: str | Path, *, stages: int = 1, tokenizer=None) -> FolderReport:
    """The `FolderReport` of a ``save_pretrained`` folder split into ``stages`` equal stages (layer counts), with
    ``tokenizer`` (default: the folder's own tokenizer files, else the bytes tokenizer)."""
    import numpy as np

    from ..loader.model_facts import model_facts
    from ..pipeline.models.hf import from_hf
    from ..pipeline.models.partition import LayerCosts, uniform_partition

    folder = Path(folder)
    rep = FolderReport(str(folder))
    try:
        model = from_hf(folder, layers=range(0))  # names and shapes only: every tensor checked against the config
    except Exception as e:  # noqa: BLE001 - every refusal of the folder is a finding of the report
        rep.problems.append(Problem(f"{folder} does not load: {e}", "fix the folder (see the message) and check again"))
        return rep
    rep.model_class = type(model).__name__ if not getattr(model, "name", None) else model.name
    rep.family, rep.num_layers = model.kind, len(model.layers)
    if not 1 <= stages <= rep.num_layers:
        rep.problems.append(Problem(
            f"{stages} pipeline stages asked, but {rep.model_class} has {rep.num_layers} layers in the pipeline "
            "(embedding, blocks, head) and each stage needs one", f"use at most {rep.num_layers} stages"))
    else:
        unit = np.ones((rep.num_layers, 1))
        rep.bounds = tuple(int(b) for b in uniform_partition(LayerCosts(unit, unit), stages).bounds)
        rep.stage_bytes = _stage_bytes(model, rep.bounds)
    facts = model_facts(folder)
    rep.vocab_size = facts.vocab_size if facts else None
    rep.decoder_start_token_id = facts.decoder_start_token_id if facts else None
    if facts is not None and facts.vision is not None:
        v = facts.vision
        rep.vision = (f"{v.image_size} px images of {v.patch_size} px patches, {v.image_tokens} tokens per image, "
                      f"image token id {facts.image_token_id}")
    _check_tokenizer(rep, folder, tokenizer, facts)
    return rep


def _check_tokenizer(rep: FolderReport, folder: Path, tokenizer, facts) -> None:
    from tokenization import load_tokenizer

    spec = tokenizer
    if spec is None:
        spec = str(folder) if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                      "tokenizer.model")) else "bytes"
    try:
        tok = load_tokenizer(spec)
    except Exception as e:  # noqa: BLE001
        rep.problems.append(Problem(f"tokenizer {spec!r} does not load: {e}", "save the tokenizer into the folder "
                                    "(tokenizer.save_pretrained(folder)) or pass --tokenizer"))
        return
    rep.tokenizer, rep.tokenizer_spec, rep.tokenizer_ids = str(getattr(tok, "name", spec)), spec, int(tok.vocab_size)
    if rep.vocab_size is not None and rep.tokenizer_ids > rep.vocab_size:
        rep.problems.append(Problem(
            f"the tokenizer has {rep.tokenizer_ids} ids but the model embeds {rep.vocab_size}",
            "use the model's own tokenizer, or resize the embeddings (model.resize_token_embeddings) and save"))


__all__ = ["FolderReport", "Problem", "folder_report"]
