"""What ``dynabatch profile`` reports: progress per timed shape while it measures, the measured table,
and `timing_warnings` where the timings disagree beyond the noise of their own repeats.

On a shared or busy machine a timing can come out far slower than the same shape's other rounds, or
slower than a larger shape: the profile keeps every layer's fastest round, which hides most of it,
but not when every round of one shape was unlucky. Such a table prices micro-batches wrongly (a
1x16 micro-batch predicted dearer than 1x32), so the command says so instead of writing it
silently. Seconds throughout; the printed table is in ms. Its parser: `dynabatch.commands.profile`.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from .profile import Profile, fitted_cost_model, load_model, profile_model, save_profile

#: How `dynabatch profile` says which packed attention it measured (`CostModel.packed_attention`).
PACKED_WORDS = {"varlen": "attention per sample (a varlen kernel)",
                "dense": "the whole row attended with a mask (N**2 per row, as one padded row of N tokens)"}

#: The least disagreement called out, relative: below it even a quiet machine's timings wobble.
MIN_TOLERANCE = 0.05
#: A shape whose repeats spread more than this many times the median shape's is called out.
SPREAD_FACTOR = 3.0
#: Disagreements listed per warning (the count says how many there were).
MAX_LISTED = 3


def _shape_text(rows: int, length: int, target: int) -> str:
    return f"{rows}x{length}" + (f"+{target}" if target else "") + " tokens"


def noise_floor(prof: Profile) -> float:
    """The median over shapes of how far a shape's timed rounds spread, ``max / min - 1`` of its
    all-layer seconds (0 with fewer than two rounds: nothing to compare)."""
    r = prof.round_s
    if r is None or len(r) < 2 or not r.size:
        return 0.0
    lo = np.maximum(r.min(axis=0), 1e-12)
    return float(np.median(r.max(axis=0) / lo - 1.0))


def timing_warnings(prof: Profile) -> list[str]:
    """One line per kind of disagreement beyond the noise floor (`noise_floor`, at least `MIN_TOLERANCE`):

    * non-monotone table: a padded shape measured slower than the next larger one on the grid
      (one more row step, length step or target-length step) by more than the tolerance;
    * wide repeats: a shape whose rounds spread more than `SPREAD_FACTOR` x the noise floor (and
      more than the tolerance).

    An empty list when the timings agree."""
    noise = noise_floor(prof)
    tol = max(noise, MIN_TOLERANCE)
    tab = prof.table
    t = np.asarray(tab.time_s)
    grids = (np.asarray(tab.rows), np.asarray(tab.main_len), np.asarray(tab.dec_len))
    pairs = []
    for axis in range(3):
        for idx in np.argwhere(np.take(t, range(t.shape[axis] - 1), axis=axis) >
                               np.take(t, range(1, t.shape[axis]), axis=axis) * (1 + tol)):
            small = tuple(int(i) for i in idx)
            large = tuple(i + (d == axis) for d, i in enumerate(small))
            pairs.append((float(t[small] / t[large]), small, large))
    out = []
    floor = f"the repeats' median spread is {noise:.0%}" if noise else "one timed round only"
    if pairs:
        pairs.sort(reverse=True)
        listed = "; ".join(f"{_shape_text(*(int(g[i]) for g, i in zip(grids, s)))} {t[s] * 1e3:.1f} ms > "
                           f"{_shape_text(*(int(g[i]) for g, i in zip(grids, b)))} {t[b] * 1e3:.1f} ms"
                           for _, s, b in pairs[:MAX_LISTED])
        out.append(f"{len(pairs)} larger shape{'s' * (len(pairs) != 1)} measured faster than a smaller one, by more "
                   f"than {tol:.0%} ({floor}): {listed}" + (" ..." if len(pairs) > MAX_LISTED else ""))
    r = prof.round_s
    if r is not None and len(r) >= 2 and r.size:
        spread = r.max(axis=0) / np.maximum(r.min(axis=0), 1e-12) - 1.0
        wide = np.flatnonzero(spread > max(SPREAD_FACTOR * noise, tol))
        if len(wide):
            wide = wide[np.argsort(-spread[wide])]
            listed = "; ".join(f"{_measured_text(prof, k)} {r[:, k].min() * 1e3:.1f}-{r[:, k].max() * 1e3:.1f} ms"
                               for k in wide[:MAX_LISTED])
            out.append(f"{len(wide)} shape{'s' * (len(wide) != 1)} whose repeats spread more than "
                       f"{max(SPREAD_FACTOR * noise, tol):.0%} ({SPREAD_FACTOR:g}x the median {noise:.0%}): {listed}"
                       + (" ..." if len(wide) > MAX_LISTED else ""))
    return out


def _measured_text(prof: Profile, k: int) -> str:
    s = prof.shapes[k]
    text = _shape_text(s.rows, s.input_len, s.target_len)
    if prof.lengths[k] is not None:
        text += " packed"
    elif s.tiles:
        text += f", {s.tiles} tiles"
    elif prof.padding and prof.padding[k]:
        text += " with a padded row"
    return text


def profile_command(args) -> int:
    """Run ``dynabatch profile`` with its parsed arguments: 2 with a one-line error on bad input."""
    from ...core.cost.model import describe
    from ...progress import progress_bar, show_progress

    for name, grid in (("rows", args.rows), ("lengths", args.lengths), ("target-lengths", args.target_lengths),
                       ("tiles", args.tiles)):
        if grid is not None and (len(grid) == 0 or any(b <= a for a, b in zip(grid[:-1], grid[1:])) or min(grid) < 1):
            print(f"dynabatch profile: error: --{name} must be positive and strictly increasing", file=sys.stderr)
            return 2
    try:
        model = load_model(args.model, seed=args.seed, hidden=args.hidden or None, layers=args.layers or None)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"dynabatch profile: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    bar = progress_bar(None, f"profile {args.model} on {args.device}", "timing", show_progress(args))

    def progress(done: int, total: int) -> None:
        # the first timings of every shape warm up (one round), then --repeats timed rounds
        bar.total = total
        per_round = total // (args.repeats + 1)
        rnd = (done - 1) // per_round
        bar.set_postfix_str("warm-up round" if rnd == 0 else f"round {rnd}/{args.repeats}", refresh=False)
        bar.update(done - bar.n)

    try:
        with bar:
            prof = profile_model(model, num_stages=args.stages, device=args.device, rows=args.rows,
                                 lengths=args.lengths, target_lengths=args.target_lengths, tiles=args.tiles,
                                 repeats=args.repeats, seed=args.seed, progress=progress)
    except ValueError as e:  # e.g. no length holds an image tile
        print(f"dynabatch profile: error: {e}", file=sys.stderr)
        return 2
    cost = fitted_cost_model(prof, model, device=args.device)
    save_profile(args.out, cost, prof.layer_costs)
    t = prof.table
    ragged = len(prof.ragged)
    extra = len(prof.extra) - ragged
    print(f"{args.model} on {args.device}: {len(prof.shapes)} shapes ({t.time_s.size} padded"
          + (f", {extra} {'with image tiles' if model.kind == 'vision_language' else 'packed'}" if extra else "")
          + (f", {ragged} padded with a padded row" if ragged else "")
          + f") in {time.perf_counter() - t0:.1f} s, written to {args.out}")
    print("ms per micro-batch (fwd+bwd), rows x length" + (" (first target length)" if len(t.dec_len) > 1 else "") + ":")
    print("rows\\len " + " ".join(f"{int(x):>8d}" for x in t.main_len))
    for i, r in enumerate(t.rows):
        print(f"{int(r):>8d} " + " ".join(f"{t.time_s[i, j, 0] * 1e3:8.2f}" for j in range(len(t.main_len))))
    if extra and model.kind != "vision_language":
        print(f"packed micro-batches: {PACKED_WORDS[cost.packed_attention]} (packed_attention={cost.packed_attention!r}, "
              "the better fit to the packed measurements)")
    print(describe(cost))
    warned = timing_warnings(prof)
    for line in warned:
        print(f"dynabatch profile: warning: {line}", file=sys.stderr)
    if warned:
        print("dynabatch profile: warning: the timings above are noisier than their repeats: the machine was busy "
              f"while measuring; rerun with more --repeats (now {args.repeats}; the fastest round is kept) and "
              "fewer other jobs before planning with this cost model", file=sys.stderr)
    return 0
