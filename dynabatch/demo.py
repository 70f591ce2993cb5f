"""`dynabatch demo`: generate FLAN-like and image+text shards, stream them through
`dynabatch.DataLoader`, and print what the planner decided next to what the loader delivered."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from .core.plan.bounds import iteration_lower_bound, objective_lower_bound
from .core.cost.model import CostModel
from .core.options import PlanOptions
from .core.shapes import Shapes
from .core.plan.steps import global_batches, plan_step

RANKS, STAGES, BATCH_TOKENS = 8, 4, 65536


def _microbatch_table(plan, rank: int) -> str:
    head = f"{'mb':>3} {'rows':>5} {'in len':>7} {'tgt len':>7} {'tiles':>5} {'real tok':>9} {'pad eff':>7} {'pred ms':>8}"
    lines = [head, "-" * len(head)]
    for mb in plan.microbatches(rank):
        eff = mb.real_tokens / mb.tokens if mb.tokens else 1.0
        lines.append(f"{mb.index:>3} {mb.rows:>5} {mb.input_len:>7} {mb.target_len:>7} {mb.vision_tiles:>5} "
                     f"{mb.real_tokens:>9} {eff:>7.2f} {mb.time_s * 1e3:>8.1f}")
    return "\n".join(lines)


def _text_demo(text_dir: Path, model: str, seed: int) -> None:
    from .loader.dataloader import DataLoader, build_index
    from .loader.settings import Costing, DataSource, Runtime, Tokenization

    family = "encoder_decoder" if model == "t5" else "decoder"
    cost = CostModel.preset(model, num_stages=STAGES)
    index = build_index(str(text_dir), tokenizer="bytes", family=family, max_len=2048, max_target_len=512)
    shapes = Shapes.from_arrow(index)
    # One PlanOptions for the planner and the DataLoader: the same steps and micro-batches online.
    options = PlanOptions(global_batch_tokens=BATCH_TOKENS, max_len=2048, max_target_len=512, num_stages=STAGES,
                          num_ranks=RANKS, seed=seed)
    main, dec, _ = cost.sample_dims(shapes, options.max_len, options.max_target_len)
    first = global_batches(shapes, cost, options, epoch=0)[0]
    batch = shapes.take(first)
    dp = plan_step(shapes, cost, options, first, step=0)
    pack = plan_step(shapes, cost, options.replace(method="pack"), first, step=0)
    bound_kw = dict(num_stages=STAGES, num_ranks=RANKS, max_len=options.max_len, max_target_len=options.max_target_len)
    iter_lb = iteration_lower_bound(batch, cost, **bound_kw)
    obj_lb = objective_lower_bound(batch, cost, **bound_kw)
    print(f"\n=== {model} ({cost.model.kind}) on {cost.device.name}: step 0 = {len(batch)} FLAN-like samples, "
          f"{int((main + dec)[first].sum())} tokens (byte tokenizer), {RANKS} ranks x {STAGES} stages")
    print(f"dynabatch dp: {dp.num_microbatches} micro-batches ({dp.microbatches_per_rank()[0]} per rank), "
          f"iteration {dp.iteration_time_s * 1e3:.0f} ms, padding efficiency {dp.padding_efficiency:.2f}, "
          f"rank max/mean {dp.rank_imbalance:.3f}")
    print(f"packing:      {pack.num_microbatches} micro-batches, iteration {pack.iteration_time_s * 1e3:.0f} ms, "
          f"padding efficiency {pack.padding_efficiency:.2f}  ->  dp is "
          f"{pack.iteration_time_s / dp.iteration_time_s:.2f}x faster")
    print(f"iteration lower bound {iter_lb * 1e3:.0f} ms (any plan, any schedule); dp iteration "
          f"{dp.iteration_time_s * 1e3:.0f} ms = {dp.iteration_time_s / iter_lb:.2f}x the bound")
    print(f"objective lower bound {obj_lb * 1e3:.0f} ms (sum/R + (S-1) x max, not an iteration time); dp objective "
          f"{dp.objective_s * 1e3:.0f} ms = {dp.objective_s / obj_lb:.2f}x the bound")
    print(f"rank 0's micro-batches in execution order:\n{_microbatch_table(dp, 0)}")

    loader = DataLoader(str(text_dir), options=options,
                        tokenization=Tokenization(tokenizer="bytes"), source=DataSource(index=index, mode="indexed"),
                        costing=Costing(cost_model=cost), runtime=Runtime(rank=0, world_size=RANKS))
    try:
        step = next(iter(loader))
    finally:
        loader.close()
    keys = ("input_ids", "decoder_input_ids") if family == "encoder_decoder" else ("input_ids",)
    print(f"the DataLoader (rank 0 of {RANKS}, {len(loader)} steps per epoch) streamed step 0 as:")
    for mb in step:
        shapes_txt = ", ".join(f"{k} {tuple(mb[k].shape)}" for k in keys)
        print(f"  micro-batch {mb['microbatch']}: {shapes_txt}, {mb['real_tokens']} real tokens, "
              f"predicted {mb['predicted_time_s'] * 1e3:.1f} ms")
    planned = [mb.sample_ids.tolist() for mb in dp.microbatches(0)]
    delivered = [mb["sample_ids"].tolist() for mb in step]
    print(f"delivered samples equal the plan's rank-0 micro-batches: {planned == delivered}; loss per token "
          f"normalizes by step_target_tokens = {step[0]['step_target_tokens']} (all ranks)")


def _image_text_demo(image_dir: Path, seed: int) -> None:
    from tokenization import DynamicTiling

    from .loader.dataloader import DataLoader
    from .loader.settings import Costing, Tokenization

    # One rank cannot shard the optimizer state of a 26B model, so the H200's memory is needed.
    # (a CostModel, not device="h200": planning for other hardware than this machine's is the point)
    vlm = CostModel.preset("vlm", "h200", num_stages=STAGES)
    loader = DataLoader(str(image_dir), options=PlanOptions(num_stages=STAGES, global_batch_tokens=BATCH_TOKENS,
                                                            max_len=8192, seed=seed),
                        tokenization=Tokenization(tokenizer="bytes", vision=DynamicTiling()),
                        costing=Costing(cost_model=vlm))
    try:
        step = next(iter(loader))
    finally:
        loader.close()
    tiles = np.concatenate([mb["image_tiles"].numpy() for mb in step])
    print(f"\n=== vlm (InternViT-6B + InternLM2-20B) on h200: {loader.mode} DataLoader over generated image+text "
          f"webdataset shards, 1 rank x {STAGES} stages")
    print(f"step 0: {step[0]['step_samples']} samples, {step[0]['step_real_tokens']} LLM tokens, "
          f"{len(step)} micro-batches, 448-px tiles per image {int(tiles.min())}-{int(tiles.max())}")
    pred = np.array([mb["predicted_time_s"] for mb in step]) * 1e3
    print(f"predicted micro-batch time {pred.min():.0f}-{pred.max():.0f} ms (max/mean {pred.max() / pred.mean():.2f})")
    head = f"{'mb':>3} {'rows':>5} {'text len':>8} {'tiles':>5} {'real tok':>9} {'pred ms':>8}"
    print(head + "\n" + "-" * len(head))
    for mb in step[:8]:
        print(f"{mb['microbatch']:>3} {mb['input_ids'].shape[0]:>5} {mb['input_ids'].shape[1]:>8} "
              f"{int(mb['image_tiles'].sum()):>5} {mb['real_tokens']:>9} {mb['predicted_time_s'] * 1e3:>8.1f}")
    if len(step) > 8:
        print(f"... {len(step) - 8} more")


def run_demo(out_dir: str | None = None, seed: int = 0, text_samples: int = 6000, image_text_samples: int = 200) -> int:
    """Generate shards, plan and stream them; print the plans and the delivered micro-batches."""
    from .datagen import write_image_text_shards, write_text_shards

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(out_dir) if out_dir else Path(tmp)
        text_dir, image_dir = root / "text", root / "image_text"
        write_text_shards(text_dir, text_samples, num_shards=4, seed=seed)
        write_image_text_shards(image_dir, image_text_samples, num_shards=2, seed=seed)
        print(f"generated {text_samples} FLAN-like samples in {text_dir} and {image_text_samples} image+text "
              f"samples in {image_dir}")
        for model in ("gpt", "t5"):
            _text_demo(text_dir, model, seed)
        _image_text_demo(image_dir, seed)
    return 0
