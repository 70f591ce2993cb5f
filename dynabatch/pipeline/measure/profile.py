"""Measure a model's micro-batch costs on this machine and keep them as a cost model file.

`profile_model` times forward+backward layer by layer (`dynabatch.pipeline.profile_layers`) and
counts the activation bytes autograd saves for backward, on a grid of padded micro-batch shapes
(rows x main length [x decoder length]), on packed (varlen) micro-batches of a text model
(decoder-only or encoder-decoder) and on micro-batches with image tiles of a vision-language model
(a `Profile`). With
``num_stages > 1`` the layers are split with `dynabatch.pipeline.balanced_partition` and each
micro-batch records the slowest stage, which is what one stage of the pipeline costs.
`fitted_cost_model` turns it into a `CostModel`: padded shapes interpolated from the measured table
(`CostModel.profiled`), packed ones and image tiles priced by coefficients fitted to their own
measurements. `save_profile` writes the cost model (what `CostModel.load` reads: the DataLoader and
the planner) with the per-layer costs beside it (what `load_layer_costs` reads: the partition
search); `profile_table` is the padded grid alone.

Command line: ``dynabatch profile --model gpt-tiny --device cpu --out costs.json`` (``--model
hf:FOLDER`` for a Hugging Face ``save_pretrained`` folder or ``config.json``; its parser
`dynabatch.commands.profile`, what it prints `dynabatch.pipeline.measure.profile_report`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...core.cost.model import PACKED_ATTENTION, CostModel, DeviceProfile, ProfiledTable, device_preset
from ...core.kernels.cost import FEATURES, Q_PAD

DEFAULT_ROWS = (1, 2, 4, 8)
DEFAULT_LENGTHS = (16, 32, 64, 128)
DEFAULT_TARGET_LENGTHS = (8, 16, 32)
LAYER_COSTS_KEY = "layer_costs"  # the per-layer costs' key in a profile file (beside CostModel.to_dict's)
LAYER_FIELDS = ("forward_s", "backward_s", "memory_bytes", "boundary_bytes")
DEFAULT_TILES = (1, 2, 4)  # image tiles per micro-batch a vision-language model is measured with


def closest_device_profile(device) -> DeviceProfile:
    """The closest device preset: ``cpu``, or the GPU's name and memory mapped by
    `dynabatch.devices.gpu_preset` (the one mapping of GPU names to presets)."""
    import torch

    from ...devices import gpu_preset

    dev = torch.device(device)
    if dev.type != "cuda":
        return device_preset("cpu")
    props = torch.cuda.get_device_properties(dev)
    return device_preset(gpu_preset(torch.cuda.get_device_name(dev), float(props.total_memory))[0])


@dataclass(frozen=True)
class Profile:
    """What `profile_model` measured on one device (seconds, bytes).

    ``table``: padded text-only micro-batches on the (rows, length, target length) grid, each the
    slowest stage's seconds and the largest stage's bytes; ``bounds``: the stage cut (``(0, n_layers)``
    for one stage); ``shapes``: every measured micro-batch, the grid's first (table order), then the
    packed ones (text models: ``rows`` samples in one row; an encoder-decoder's targets in a second row)
    and the ones with image tiles (vision-language models); ``lengths``: each packed one's sample
    lengths (None for padded); ``decoder_lengths``: their target lengths (encoder-decoder; else None);
    ``time_s``/``memory_bytes`` [len(shapes)]: slowest stage's seconds, largest stage's bytes;
    ``layer_costs``: every layer on every measured micro-batch (what `balanced_partition` takes);
    ``padding``: for each shape, whether it was measured with a padded row (a decoder-only model's
    padded shapes repeated with row 0 one token short: the mask cost, ``q_pad``); ``round_s``: each
    timed round's seconds of each shape over all layers (how far repeats disagree: `timing_warnings`).
    """

    table: ProfiledTable
    bounds: tuple[int, ...]
    shapes: tuple
    lengths: tuple
    decoder_lengths: tuple
    time_s: np.ndarray
    memory_bytes: np.ndarray
    layer_costs: object  # dynabatch.pipeline.models.LayerCosts (torch-side, imported lazily)
    padding: tuple = ()  # per shape: a padded one measured with a padded row (``q_pad``); () for none
    round_s: np.ndarray | None = None  # [repeats, shapes]: every layer's fwd+bwd seconds summed, per timed round

    @property
    def extra(self) -> np.ndarray:
        """Indices of the measured micro-batches outside the padded grid (packed, with image tiles, padded
        with a padded row)."""
        return np.arange(self.table.time_s.size, len(self.shapes))

    @property
    def packed(self) -> np.ndarray:
        """Indices of the packed micro-batches measured (those with per-sample ``lengths``)."""
        return np.array([k for k, lens in enumerate(self.lengths) if lens is not None], np.int64)

    @property
    def ragged(self) -> np.ndarray:
        """Indices of the padded micro-batches measured with a padded row (``padding``)."""
        return np.flatnonzero(np.asarray(self.padding, bool)) if self.padding else np.zeros(0, np.int64)


def _extra_shapes(model, rows, lengths, tgrid, packed: bool, tiles) -> list:
    """The micro-batch shapes measured beyond the padded grid: with ``packed``, packed ones for a
    decoder-only model (``r`` samples, ``r * L`` tokens in one row, r > 1) or an encoder-decoder (also
    ``r * T`` target tokens in the decoder's row, for ``T`` in ``tgrid``) and, for a vision-language model,
    ``t`` of ``tiles`` image tiles in ``r`` rows of ``L`` tokens wherever they fit one row (``t * tile_tokens < L``)."""
    from ..models.spec import MicroBatchShape

    if model.kind == "decoder":
        return [MicroBatchShape("packed", r, L, 0, r * L) for r in rows if r > 1 for L in lengths] if packed else []
    if model.kind == "encoder_decoder":
        return [MicroBatchShape("packed", r, L, T, r * L, target_tokens=r * T)
                for r in rows if r > 1 for L in lengths for T in tgrid] if packed else []
    if model.kind != "vision_language" or not tiles:
        return []
    per_tile = int(model.config.tile_tokens)
    out = [MicroBatchShape("padded", r, L, tiles=t) for r in rows for L in lengths for t in tiles if t * per_tile < L]
    if not out:
        raise ValueError(f"{model.name}: no length of {tuple(lengths)} holds {min(tiles)} image tile(s) of "
                         f"{per_tile} tokens; profile longer lengths (--lengths) or fewer tiles (--tiles)")
    return out


def _ragged_shapes(model, rows, lengths, ragged: bool) -> list:
    """The padded shapes a decoder-only model is measured on again with padding (``ragged``): every row
    count at the longer half of ``lengths``, where a padding mask costs most."""
    from ..models.spec import MicroBatchShape

    if not ragged or model.kind != "decoder":
        return []
    return [MicroBatchShape("padded", r, L) for r in rows for L in lengths[len(lengths) // 2:]]


def _with_padding(batch: dict) -> dict:
    """``batch`` (a padded one from ``random_batch``) with its first row one token short: at least one
    padded row, so the model attends with a padding mask."""
    from ..models.tiny import IGNORE_INDEX

    mask = batch["attention_mask"].clone()
    mask[0, -1] = 0
    out = dict(batch, attention_mask=mask, input_ids=batch["input_ids"] * mask)
    if "labels" in batch:
        out["labels"] = batch["labels"].masked_fill(mask == 0, IGNORE_INDEX)
    return out


def _measure(model, batches, repeats: int, warmup: int, device, seed: int, progress):
    """`LayerCosts` of every layer on each of ``batches`` and each timed round's seconds of each batch
    over all layers [repeats, batches]: rounds over all of them in a shuffled order (not repeats of one
    shape back to back), so slow drift or a noisy moment spreads over all shapes instead of biasing one;
    the first rounds warm up; per layer the fastest round (noise on a shared machine only adds).
    ``progress(done, total)`` after every batch's timing, warm-up rounds included."""
    from ..models.partition import LayerCosts
    from .layers import profile_layers

    n, m, warm = len(model.layers), len(batches), max(warmup, 1)
    samples_f, samples_b = np.zeros((repeats, n, m)), np.zeros((repeats, n, m))
    mem, boundary = np.zeros((n, m)), np.zeros(m)
    order_rng = np.random.default_rng(seed)
    done = 0
    for rnd in range(-warm, repeats):
        for k in order_rng.permutation(m):  # no shape always follows the same one
            c = profile_layers(model.layers, [batches[k]], repeats=1, warmup=0, device=device)
            if rnd >= 0:
                samples_f[rnd, :, k], samples_b[rnd, :, k] = c.forward_s[:, 0], c.backward_s[:, 0]
                mem[:, k], boundary[k] = c.memory_bytes[:, 0], c.boundary_bytes[0]
            done += 1
            if progress is not None:
                progress(done, (warm + repeats) * m)
    rounds = samples_f.sum(axis=1) + samples_b.sum(axis=1)
    return LayerCosts(samples_f.min(axis=0), samples_b.min(axis=0), mem, boundary), rounds


def profile_model(model, *, rows=DEFAULT_ROWS, lengths=DEFAULT_LENGTHS, target_lengths=None, packed: bool = True,
                  tiles=DEFAULT_TILES, num_stages: int = 1, repeats: int = 3, warmup: int = 1, device="cpu", seed: int = 0,
                  progress=None, ragged: bool = True) -> Profile:
    """Measure ``model`` (a `dynabatch.pipeline.LayeredModel`) layer by layer on this device: a `Profile`.

    ``rows``, ``lengths`` (main-stack tokens) and ``target_lengths`` (decoder tokens; encoder-decoder
    models only, default (8, 16, 32)) are strictly increasing grids of padded micro-batches (full rows:
    every grid point computes exactly rows x length tokens). With ``packed`` a decoder-only or
    encoder-decoder model is also measured on packed micro-batches (varlen), and a vision-language model on micro-batches with ``tiles``
    image tiles (none: ``tiles=()``). With ``ragged`` a decoder-only model is also measured on padded
    micro-batches that hold padding (`_ragged_shapes`): the cost of its padding mask (``q_pad``).
    With ``num_stages > 1`` the layers are split by `balanced_partition` over everything measured.
    ``progress(done, total)`` is called after every shape's timing (``total``: shapes x rounds, the
    warm-up round included).
    """
    import torch

    from ..models.partition import balanced_partition
    from ..models.spec import MicroBatchShape

    enc_dec = model.kind == "encoder_decoder"
    tgrid = tuple(target_lengths) if target_lengths is not None else (DEFAULT_TARGET_LENGTHS if enc_dec else (0,))
    if enc_dec and min(tgrid) < 1:
        raise ValueError("an encoder-decoder model needs target lengths >= 1")
    if not enc_dec and tuple(tgrid) != (0,):
        raise ValueError("a decoder-only model has no target lengths (use the default)")
    model.to(device)
    gen = torch.Generator().manual_seed(seed)
    shapes = [MicroBatchShape("padded", r, L, T) for r in rows for L in lengths for T in tgrid]
    shapes += _extra_shapes(model, rows, lengths, tgrid, packed, tiles)
    plain = len(shapes)
    shapes += _ragged_shapes(model, rows, lengths, ragged)
    padding = tuple(k >= plain for k in range(len(shapes)))
    batches, sample_lengths, decoder_lengths = [], [], []
    for shape, pad in zip(shapes, padding):
        batch = model.random_batch(shape, gen)
        if pad:
            batch = _with_padding(batch)
        elif not shape.packed and not shape.tiles:
            batch.pop("attention_mask", None)  # full rows: every grid point computes exactly r x L tokens
            batch.pop("decoder_attention_mask", None)
        batches.append(batch)
        for key, out in (("cu_seqlens", sample_lengths), ("decoder_cu_seqlens", decoder_lengths)):
            cu = batch.get(key)
            out.append(None if cu is None else tuple(int(x) for x in np.diff(cu.numpy())))
    costs, rounds = _measure(model, batches, repeats, warmup, device, seed, progress)
    bounds = balanced_partition(costs, num_stages).bounds if num_stages > 1 else (0, len(model.layers))
    b = np.asarray(bounds)
    stage_t = np.add.reduceat(costs.forward_s + costs.backward_s, b[:-1], axis=0)  # [S, micro-batches]
    t = stage_t[np.argmax(stage_t, axis=0), np.arange(len(shapes))]
    m = np.add.reduceat(costs.memory_bytes, b[:-1], axis=0).max(axis=0)
    g = len(rows) * len(lengths) * len(tgrid)
    grid = (len(rows), len(lengths), len(tgrid))
    table = ProfiledTable(np.asarray(rows), np.asarray(lengths), np.asarray(tgrid), t[:g].reshape(grid),
                          m[:g].reshape(grid))
    return Profile(table, tuple(int(x) for x in bounds), tuple(shapes), tuple(sample_lengths), tuple(decoder_lengths),
                   t, m, costs, padding, rounds)


def profile_table(model, *, rows=DEFAULT_ROWS, lengths=DEFAULT_LENGTHS, target_lengths=None, num_stages: int = 1,
                  repeats: int = 3, warmup: int = 1, device="cpu", seed: int = 0,
                  progress=None) -> tuple[ProfiledTable, tuple[int, ...]]:
    """The padded grid of `profile_model` alone (no packed or image micro-batches): the `ProfiledTable`
    (seconds, bytes) and the stage bounds used (``(0, n_layers)`` for one stage)."""
    prof = profile_model(model, rows=rows, lengths=lengths, target_lengths=target_lengths, packed=False, tiles=(),
                         num_stages=num_stages, repeats=repeats, warmup=warmup, device=device, seed=seed,
                         progress=progress, ragged=False)
    return prof.table, prof.bounds


def _features(cost: CostModel, prof: Profile, idx) -> np.ndarray:
    """Cost-model features [len(idx), NUM_FEATURES] of measured micro-batches ``idx`` of ``prof``."""
    rows = []
    for k in idx:
        shape, lens, dec = prof.shapes[k], prof.lengths[k], prof.decoder_lengths[k]
        if lens is not None:
            z = np.zeros(len(lens))
            rows.append(cost.packed_features(np.asarray(lens), z if dec is None else np.asarray(dec), z,
                                             z.astype(np.int64))[0])
        else:
            pad = bool(prof.padding[k]) if prof.padding else False
            rows.append(cost.padded_features(shape.rows, shape.input_len, shape.target_len, shape.tiles, pad)[0])
    return np.array(rows)


def fitted_cost_model(prof: Profile, model, *, device="cpu", device_profile: DeviceProfile | str | None = None,
                      pad_multiple: int = 8) -> CostModel:
    """The `CostModel` of one stage of ``model`` from the measurements ``prof``: padded micro-batches are
    looked up in ``prof.table`` (`CostModel.profiled`); the linear coefficients (what packed
    micro-batches and the per-stage predictions are priced by) are fitted to every measured micro-batch,
    padded, padded with a padded row and packed, in the features of the packed attention that fits the
    packed measurements better (`packed_attention`; without packed measurements, the model's own
    ``packed_attention()``): a varlen kernel's cost is per sample, an attention
    given the whole packed row and a mask (SDPA, eager) costs what one padded row of that length does.
    A vision-language model's table cannot hold image tiles, so it keeps no table. A padded micro-batch
    with a padded row adds ``q_pad``'s coefficient, fitted to the grid points measured again with one
    (`_with_mask_cost`). The model config is one stage's share of the layers (`stage_cost_model`); the
    device profile (the analytic prior) defaults to the preset closest to ``device``."""
    from .microbatches import stage_cost_model

    dev = (device_preset(device_profile) if isinstance(device_profile, str)
           else device_profile or closest_device_profile(device))
    prior = stage_cost_model(model, len(prof.bounds) - 1, dev)
    cfg = prior.model
    vision = cfg.kind == "vision_language"
    cm = CostModel(cfg, dev, pad_multiple=pad_multiple) if vision else \
        CostModel.profiled(prof.table, cfg, dev, pad_multiple=pad_multiple)
    # the model's own word, unless packed rows were measured: then each attention's fit, the better one kept
    candidates = PACKED_ATTENTION if len(prof.packed) and not vision else (prior.packed_attention,)
    fits = {a: _fit(cm, prof, a) for a in candidates}
    cm.packed_attention = min(fits, key=lambda a: fits[a][2])
    cm.time_coef, cm.mem_coef, _ = fits[cm.packed_attention]
    if len(prof.ragged) and cm.table is not None:
        cm.time_coef = _with_mask_cost(cm, prof, prof.ragged)
    return cm


def _fit(cm: CostModel, prof: Profile, attention: str) -> tuple[np.ndarray, np.ndarray, float]:
    """(time, memory coefficients, MAPE of the time fit on the packed measurements) of ``cm``'s features
    with ``packed_attention=attention``, fitted to every measured micro-batch of ``prof``. ``q_pad``,
    priced 0 by the analytic prior, is fitted from 0 in the units of the attention's own coefficient
    (a mask costs the attention it makes dense)."""
    from ...core.cost.fit import fit_relative, mape

    trial = copy.copy(cm)
    trial.packed_attention = attention
    idx = np.arange(len(prof.shapes))
    phi, w = _features(trial, prof, idx), np.ones(len(idx))
    scale = np.zeros(len(cm.prior_time_coef))
    scale[Q_PAD] = cm.prior_time_coef[FEATURES.index("q_main")]
    time_coef = fit_relative(phi, prof.time_s, w, cm.prior_time_coef, 1e-6, scale=scale)
    mem_coef = fit_relative(phi, prof.memory_bytes, w, cm.mem_coef, 1e-6)
    packed = prof.packed
    err = mape(phi[packed] @ time_coef, prof.time_s[packed]) if len(packed) else 0.0
    return time_coef, mem_coef, err


def _with_mask_cost(cm: CostModel, prof: Profile, ragged: np.ndarray) -> np.ndarray:
    """``cm.time_coef`` with ``q_pad`` fitted to the padded shapes measured with a padded row (`_ragged_shapes`):
    each is a grid point of the table measured again, so what it costs beyond the table's full rows is its
    padding mask. Relative least squares (as every fit here) of that surplus on ``rows x L**2``, never below 0."""
    shapes = [prof.shapes[k] for k in ragged]
    rows = np.array([s.rows for s in shapes])
    length = np.array([s.input_len for s in shapes])
    full = cm.table.lookup(rows, length, np.zeros(len(shapes), np.int64))[0]
    y = prof.time_s[ragged]
    q = rows * length.astype(np.float64) ** 2 / y  # relative units: each shape's error in percent
    coef = cm.time_coef.copy()
    coef[Q_PAD] = max(float(q @ ((y - full) / y) / (q @ q)), 0.0)
    return coef


def profile_cost_model(model, *, num_stages: int = 1, device="cpu", device_profile: DeviceProfile | str | None = None,
                       pad_multiple: int = 8, rows=DEFAULT_ROWS, lengths=DEFAULT_LENGTHS, target_lengths=None,
                       packed: bool = True, tiles=DEFAULT_TILES, repeats: int = 3, warmup: int = 1, seed: int = 0,
                       progress=None, ragged: bool = True) -> CostModel:
    """`fitted_cost_model` of `profile_model` measurements of ``model`` on ``device`` (the grids ``rows``,
    ``lengths``, ``target_lengths``, ``tiles`` and ``packed``, ``repeats``, ``warmup``, ``seed``, ``progress``,
    ``ragged`` as in `profile_model`)."""
    prof = profile_model(model, rows=rows, lengths=lengths, target_lengths=target_lengths, packed=packed, tiles=tiles,
                         num_stages=num_stages, repeats=repeats, warmup=warmup, device=device, seed=seed,
                         progress=progress, ragged=ragged)
    return fitted_cost_model(prof, model, device=device, device_profile=device_profile, pad_multiple=pad_multiple)


def save_profile(path, cost: CostModel, layer_costs) -> None:
    """Write ``cost`` as `CostModel.save` does, with the per-layer costs (`LayerCosts`, seconds and bytes)
    beside it under ``layer_costs``: one file that `CostModel.load` (the DataLoader and the planner) and
    `load_layer_costs` (the partition search) read."""
    doc = cost.to_dict()
    doc[LAYER_COSTS_KEY] = {name: (None if getattr(layer_costs, name) is None else
                                   np.asarray(getattr(layer_costs, name), np.float64).tolist()) for name in LAYER_FIELDS}
    Path(path).write_text(json.dumps(doc, indent=1))


def load_layer_costs(path):
    """The per-layer `LayerCosts` a ``dynabatch profile`` file holds (forward and backward seconds, kept
    activation bytes per layer and measured micro-batch), for `balanced_partition`; ValueError naming
    the file when it has none (a cost model saved by `CostModel.save`) or is not JSON."""
    from ..models.partition import LayerCosts

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        part = doc[LAYER_COSTS_KEY]
        return LayerCosts(*(None if part[name] is None else np.asarray(part[name], np.float64)
                            for name in LAYER_FIELDS))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: no per-layer costs ({e!r}); write the file with `dynabatch profile` "
                         "(save_profile), not CostModel.save") from e


# ---------------------------------------------------------------------------------------------
# command line


def load_model(spec: str, *, seed: int = 0, hidden: int | None = None, layers: int | None = None):
    """The `LayeredModel` a ``--model`` names: a tiny model (``hidden`` and ``layers``, when given, resize it:
    ``layers`` are ``gpt-tiny``'s blocks, the encoder layers of the others) or, for ``hf:PATH``, the Hugging
    Face model of a ``save_pretrained`` folder (its weights) or a ``config.json`` (random weights from
    ``seed``), through `dynabatch.pipeline.from_hf`."""
    from ..models import make_model

    if not spec.startswith("hf:"):
        sizes = {} if layers is None else {"layers" if spec == "gpt-tiny" else "encoder_layers": layers}
        return make_model(spec, seed=seed, hidden=hidden, **sizes)
    if hidden is not None or layers is not None:
        raise ValueError(f"--hidden/--layers resize the tiny models only; edit the config of {spec[3:]} instead")
    from ..models.hf import from_hf

    return from_hf(spec[3:], seed=seed)
