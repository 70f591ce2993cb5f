"""Measure a model's micro-batch costs on this machine and keep them as a cost model file.

`profile_table` times forward+backward of a grid of padded micro-batch shapes (rows x main length
[x decoder length]) layer by layer (`dynabatch.pipeline.profile_layers`), and counts the activation
bytes autograd saves for backward. With ``num_stages > 1`` the layers are split with
`dynabatch.pipeline.balanced_partition` over the grid and each grid point records the slowest
stage, which is what one stage of the pipeline costs. `profile_cost_model` wraps the result in
`CostModel.profiled` (padded shapes are interpolated from the table, packed ones use the linear
fit to it); `CostModel.save` writes it, `CostModel.load` reads it back.

Command line: ``dynabatch profile --model gpt-tiny --device cpu --out costs.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import numpy as np

from ...core.cost.model import CostModel, DeviceProfile, ProfiledTable, device_preset

DEFAULT_ROWS = (1, 2, 4, 8)
DEFAULT_LENGTHS = (16, 32, 64, 128)
DEFAULT_TARGET_LENGTHS = (8, 16, 32)


def _device_profile(device) -> DeviceProfile:
    """The closest device preset: ``cpu``, or the GPU's name and memory mapped by
    `dynabatch.devices.gpu_preset` (the one mapping of GPU names to presets)."""
    import torch

    from ...devices import gpu_preset

    dev = torch.device(device)
    if dev.type != "cuda":
        return device_preset("cpu")
    props = torch.cuda.get_device_properties(dev)
    return device_preset(gpu_preset(torch.cuda.get_device_name(dev), float(props.total_memory))[0])


def profile_table(model, *, rows=DEFAULT_ROWS, lengths=DEFAULT_LENGTHS, target_lengths=None, num_stages: int = 1,
                  repeats: int = 3, warmup: int = 1, device="cpu", seed: int = 0,
                  progress=None) -> tuple[ProfiledTable, tuple[int, ...]]:
    """Measure a `ProfiledTable` (seconds, bytes) for ``model`` (a `dynabatch.pipeline.LayeredModel`).

    ``rows``, ``lengths`` (main-stack tokens) and ``target_lengths`` (decoder tokens; encoder-decoder
    models only, default (8, 16, 32)) are strictly increasing grids. Returns the table and the stage
    bounds used (``(0, n_layers)`` for one stage). ``progress(done, total)`` is called per round
    over the grid.
    """
    import torch

    from ..models.partition import LayerCosts, balanced_partition
    from .layers import profile_layers
    from ..models.spec import MicroBatchShape

    enc_dec = model.kind == "encoder_decoder"
    tgrid = tuple(target_lengths) if target_lengths is not None else (DEFAULT_TARGET_LENGTHS if enc_dec else (0,))
    if enc_dec and min(tgrid) < 1:
        raise ValueError("an encoder-decoder model needs target lengths >= 1")
    if not enc_dec and tuple(tgrid) != (0,):
        raise ValueError("a decoder-only model has no target lengths (use the default)")
    model.to(device)
    gen = torch.Generator().manual_seed(seed)
    grid = [(r, L, T) for r in rows for L in lengths for T in tgrid]
    batches = []
    for r, L, T in grid:
        batch = model.random_batch(MicroBatchShape("padded", r, L, T), gen)
        batch.pop("attention_mask", None)  # full rows: every grid point computes exactly r x L tokens
        batch.pop("decoder_attention_mask", None)
        batches.append(batch)
    # Rounds over the whole grid in a shuffled order (not repeats of one shape back to back), so slow
    # drift or a noisy moment spreads over all shapes instead of biasing one; the first round warms up.
    samples_f = np.zeros((repeats, len(model.layers), len(grid)))
    samples_b = np.zeros_like(samples_f)
    mem = np.zeros((len(model.layers), len(grid)))
    order_rng = np.random.default_rng(seed)
    for rnd in range(-max(warmup, 1), repeats):
        for k in order_rng.permutation(len(batches)):  # no shape always follows the same one
            batch = batches[k]
            c = profile_layers(model.layers, [batch], repeats=1, warmup=0, device=device)
            if rnd >= 0:
                samples_f[rnd, :, k], samples_b[rnd, :, k] = c.forward_s[:, 0], c.backward_s[:, 0]
                mem[:, k] = c.memory_bytes[:, 0]
        if progress is not None and rnd >= 0:
            progress(rnd + 1, repeats)
    # the minimum, not the mean: on a shared machine timing noise only ever adds time
    fwd, bwd = samples_f.min(axis=0), samples_b.min(axis=0)
    costs = LayerCosts(fwd, bwd, mem)
    bounds = (0, len(model.layers))
    if num_stages > 1:
        bounds = balanced_partition(costs, num_stages).bounds
    b = np.asarray(bounds)
    stage_t = np.add.reduceat(fwd + bwd, b[:-1], axis=0)  # [S, G]
    stage_m = np.add.reduceat(mem, b[:-1], axis=0)
    slow = np.argmax(stage_t, axis=0)
    t = stage_t[slow, np.arange(len(grid))]
    m = stage_m.max(axis=0)
    shape = (len(rows), len(lengths), len(tgrid))
    table = ProfiledTable(np.asarray(rows), np.asarray(lengths), np.asarray(tgrid), t.reshape(shape), m.reshape(shape))
    return table, tuple(int(x) for x in bounds)


def profile_cost_model(model, *, num_stages: int = 1, device="cpu", device_profile: DeviceProfile | str | None = None,
                       pad_multiple: int = 8, **kw) -> CostModel:
    """`CostModel.profiled` from `profile_table` measurements of ``model`` on ``device``; the model
    config is scaled to one stage's share of the layers, the device profile (the analytic prior)
    defaults to the preset closest to ``device``."""
    table, _ = profile_table(model, num_stages=num_stages, device=device, **kw)
    cfg = model.config
    if num_stages > 1:
        cfg = replace(cfg, layers=cfg.layers / num_stages, decoder_layers=cfg.decoder_layers / num_stages)
    dev = device_preset(device_profile) if isinstance(device_profile, str) else (device_profile or _device_profile(device))
    return CostModel.profiled(table, cfg, dev, pad_multiple=pad_multiple)


# ---------------------------------------------------------------------------------------------
# command line


def add_profile_command(sub) -> None:
    """Register ``dynabatch profile`` on an argparse subparsers object."""
    from ..models import MODELS

    p = sub.add_parser("profile", help="time micro-batch shapes of a tiny model and save a cost model",
                       description="Time forward+backward of a grid of padded micro-batch shapes (rows x length "
                                   "[x target length]) for a tiny trainable model on this machine, build a "
                                   "profiled cost model (CostModel.profiled) and save it as JSON "
                                   "(load it with CostModel.load).",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example:\n  dynabatch profile --model gpt-tiny --device cpu --out costs.json\n"
                              "  dynabatch profile --model t5-tiny --rows 1 4 --lengths 32 64 --target-lengths 8 16 "
                              "--out t5.json\n  dynabatch profile --model hf:path/to/llama --lengths 64 128 --out llama.json")
    p.add_argument("--model", type=_model_spec, default="gpt-tiny",
                   help=f"model to profile: one of {', '.join(MODELS)}, or hf:PATH for a Hugging Face save_pretrained "
                        "folder or config.json (random weights from a config; default gpt-tiny)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 ... (default cpu)")
    p.add_argument("--out", required=True, help="where to write the cost model (JSON)")
    p.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS), help="rows per micro-batch")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="main-stack lengths (tokens)")
    p.add_argument("--target-lengths", type=int, nargs="+", default=None,
                   help="decoder lengths (tokens) for t5-tiny (default 8 16 32)")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages: record the slowest stage (default 1)")
    p.add_argument("--hidden", type=int, default=None, help="override the model's hidden size")
    p.add_argument("--layers", type=int, default=None, help="override the number of (encoder) layers")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds over the grid, fastest kept (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default 0)")
    p.set_defaults(func=_cmd_profile)


def _model_spec(text: str) -> str:
    """``--model``: a tiny model's name or ``hf:PATH`` (argparse type; a clear error otherwise)."""
    from ..models import MODELS

    if text in MODELS or (text.startswith("hf:") and len(text) > 3):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither one of {', '.join(MODELS)} nor hf:PATH")


def load_model(spec: str, *, seed: int = 0, **overrides):
    """The `LayeredModel` a ``--model`` names: a tiny model (sizes overridden by ``overrides``) or, for
    ``hf:PATH``, the Hugging Face model of a ``save_pretrained`` folder (its weights) or a
    ``config.json`` (random weights from ``seed``), through `dynabatch.pipeline.from_hf`."""
    from ..models import make_model

    if not spec.startswith("hf:"):
        return make_model(spec, seed=seed, **overrides)
    if overrides:
        raise ValueError(f"--hidden/--layers resize the tiny models only; edit the config of {spec[3:]} instead")
    from ..models.hf import from_hf

    return from_hf(spec[3:], seed=seed)


def _cmd_profile(args) -> int:
    from ...core.cost.model import describe

    over = {}
    if args.hidden:
        over["hidden"] = args.hidden
    if args.layers:
        over["layers" if args.model == "gpt-tiny" else "encoder_layers"] = args.layers
    for name, grid in (("rows", args.rows), ("lengths", args.lengths), ("target-lengths", args.target_lengths)):
        if grid is not None and (len(grid) == 0 or any(b <= a for a, b in zip(grid[:-1], grid[1:])) or min(grid) < 1):
            print(f"dynabatch profile: error: --{name} must be positive and strictly increasing", file=sys.stderr)
            return 2
    try:
        model = load_model(args.model, seed=args.seed, **over)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"dynabatch profile: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()

    def progress(done, total):
        print(f"\rprofiling {args.model} on {args.device}: round {done}/{total} over the grid", end="",
              file=sys.stderr, flush=True)

    cost = profile_cost_model(model, num_stages=args.stages, device=args.device, rows=args.rows, lengths=args.lengths,
                              target_lengths=args.target_lengths, repeats=args.repeats, seed=args.seed,
                              progress=progress)
    print(file=sys.stderr)
    cost.save(args.out)
    t = cost.table
    print(f"{args.model} on {args.device}: {len(t.rows) * len(t.main_len) * len(t.dec_len)} shapes in "
          f"{time.perf_counter() - t0:.1f} s, written to {args.out}")
    print("ms per micro-batch (fwd+bwd), rows x length" + (" (first target length)" if len(t.dec_len) > 1 else "") + ":")
    print("rows\\len " + " ".join(f"{int(x):>8d}" for x in t.main_len))
    for i, r in enumerate(t.rows):
        print(f"{int(r):>8d} " + " ".join(f"{t.time_s[i, j, 0] * 1e3:8.2f}" for j in range(len(t.main_len))))
    print(describe(cost))
    return 0
