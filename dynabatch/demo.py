"""`dynabatch demo`: generate FLAN-like and image+text shards, stream them through
`dynabatch.DataLoader`, and print what the planner decided next to what the loader delivered.

Each part (GPT and T5 on the text shards, a vision-language model on the image+text shards) plans
one step with dynabatch and with packing (the usual baseline), prints rank 0's micro-batches and
what the DataLoader delivered, and ends on one ``result:`` line: dynabatch's step time against
packing's on the same samples. Times are the cost model's predictions (ms), not measurements.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from .core.cost.model import CostModel
from .core.options import PlanOptions
from .core.plan.bounds import iteration_lower_bound, objective_lower_bound
from .core.plan.steps import global_batches, plan_step
from .core.shapes import Shapes

RANKS, STAGES, BATCH_TOKENS = 8, 4, 65536
#: The generated conversations are rendered in dynabatch's plain ``User: / Assistant:`` format,
#: chosen here: the byte tokenizer carries no chat template to take instead.
CHAT_TEMPLATE = "plain"
#: Planned-for device of the text parts (any cluster: planning for other hardware is the point) and
#: of the vision part (`_vision_device` says why it differs).
TEXT_DEVICE, VISION_DEVICE = "a100-80gb", "h200"


def _microbatch_table(plan, rank: int) -> str:
    head = f"{'mb':>3} {'rows':>5} {'in len':>7} {'tgt len':>7} {'tiles':>5} {'real tok':>9} {'pad eff':>7} {'pred ms':>8}"
    lines = [head, "-" * len(head)]
    for mb in plan.microbatches(rank):
        eff = mb.real_tokens / mb.tokens if mb.tokens else 1.0
        lines.append(f"{mb.index:>3} {mb.rows:>5} {mb.input_len:>7} {mb.target_len:>7} {mb.vision_tiles:>5} "
                     f"{mb.real_tokens:>9} {eff:>7.2f} {mb.time_s * 1e3:>8.1f}")
    return "\n".join(lines)


def _plans(shapes: Shapes, cost: CostModel, options: PlanOptions, positions: np.ndarray):
    """dynabatch's plan (dp) and packing's of the samples at ``positions``, as step 0."""
    return (plan_step(shapes, cost, options, positions, step=0),
            plan_step(shapes, cost, options.replace(method="pack"), positions, step=0))


def _result(label: str, dp, pack, samples: int) -> str:
    return (f"result ({label}): dynabatch {dp.iteration_time_s * 1e3:.0f} ms per step vs packing "
            f"{pack.iteration_time_s * 1e3:.0f} ms on the same {samples} samples: "
            f"{pack.iteration_time_s / dp.iteration_time_s:.2f}x faster")


def _text_demo(text_dir: Path, model: str, seed: int, verbose: bool) -> None:
    from .loader.dataloader import DataLoader, build_index
    from .loader.settings import Costing, DataSource, Runtime, Tokenization

    family = "encoder_decoder" if model == "t5" else "decoder"
    cost = CostModel.preset(model, TEXT_DEVICE, num_stages=STAGES)
    index = build_index(str(text_dir), tokenizer="bytes", family=family, max_len=2048, max_target_len=512)
    shapes = Shapes.from_arrow(index)
    # One PlanOptions for the planner and the DataLoader: the same steps and micro-batches online.
    options = PlanOptions(global_batch_tokens=BATCH_TOKENS, max_len=2048, max_target_len=512, num_stages=STAGES,
                          num_ranks=RANKS, seed=seed)
    main, dec, _ = cost.sample_dims(shapes, options.max_len, options.max_target_len)
    first = global_batches(shapes, cost, options, epoch=0)[0]
    batch = shapes.take(first)
    dp, pack = _plans(shapes, cost, options, first)
    bound_kw = dict(num_stages=STAGES, num_ranks=RANKS, max_len=options.max_len, max_target_len=options.max_target_len)
    iter_lb = iteration_lower_bound(batch, cost, **bound_kw)
    print(f"\n=== {model} ({cost.model.kind}) on {cost.device.name}: step 0 = {len(batch)} FLAN-like samples, "
          f"{int((main + dec)[first].sum())} tokens (byte tokenizer), {RANKS} ranks x {STAGES} stages")
    print(f"dynabatch: {dp.num_microbatches} micro-batches ({dp.microbatches_per_rank()[0]} per rank), "
          f"{dp.iteration_time_s * 1e3:.0f} ms per step, padding efficiency {dp.padding_efficiency:.2f} "
          f"(real / computed tokens), slowest rank {dp.rank_imbalance:.3f}x the mean rank")
    print(f"packing:   {pack.num_microbatches} micro-batches, {pack.iteration_time_s * 1e3:.0f} ms per step, "
          f"padding efficiency {pack.padding_efficiency:.2f}")
    print(f"no plan of these samples can step in under {iter_lb * 1e3:.0f} ms (a lower bound: each rank's share "
          f"of the work plus filling and draining the pipeline); dynabatch is {dp.iteration_time_s / iter_lb:.2f}x it")
    if verbose:
        obj_lb = objective_lower_bound(batch, cost, **bound_kw)
        print(f"what the planner minimizes (the slowest rank's micro-batch times summed, plus {STAGES - 1} x its "
              f"longest one: the pipeline's fill and drain) is {dp.objective_s * 1e3:.0f} ms, "
              f"{dp.objective_s / obj_lb:.2f}x the least any plan of these samples could reach ({obj_lb * 1e3:.0f} ms)")
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
    print(_result(model, dp, pack, len(batch)))


def _vision_device(stages: int) -> str:
    """Why the vision part plans for `VISION_DEVICE`: the model's state per stage on one rank against
    `TEXT_DEVICE`'s memory (the text parts' device)."""
    on_text = CostModel.preset("vlm", TEXT_DEVICE, num_stages=stages)
    state, memory = on_text.state_bytes(num_ranks=1), on_text.device.memory_bytes
    return (f"planned for {VISION_DEVICE}, not {TEXT_DEVICE} as above: on one rank the 26B model's weights, "
            f"gradients and Adam state take {state / 2**30:.0f} GiB per stage of {stages}, more than "
            f"{TEXT_DEVICE}'s {memory / 2**30:.0f} GiB")


def _image_text_demo(image_dir: Path, seed: int) -> None:
    from tokenization import DynamicTiling

    from .loader.dataloader import DataLoader, build_index
    from .loader.settings import Costing, Tokenization

    # a CostModel, not device="h200": planning for other hardware than this machine's is the point
    vlm = CostModel.preset("vlm", VISION_DEVICE, num_stages=STAGES)
    options = PlanOptions(num_stages=STAGES, global_batch_tokens=BATCH_TOKENS, max_len=8192, seed=seed)
    tokenization = Tokenization(tokenizer="bytes", vision=DynamicTiling(), chat_template=CHAT_TEMPLATE)
    loader = DataLoader(str(image_dir), options=options, tokenization=tokenization, costing=Costing(cost_model=vlm))
    try:
        step = next(iter(loader))
    finally:
        loader.close()
    tiles = np.concatenate([mb["image_tiles"].numpy() for mb in step])
    print(f"\n=== vlm (InternViT-6B + InternLM2-20B) on {VISION_DEVICE}: {loader.mode} DataLoader over generated "
          f"image+text webdataset shards, 1 rank x {STAGES} stages")
    print(_vision_device(STAGES))
    print(f"step 0: {step[0]['step_samples']} samples, {step[0]['step_real_tokens']} LLM tokens, "
          f"{len(step)} micro-batches, 448-px tiles per image {int(tiles.min())}-{int(tiles.max())}")
    pred = np.array([mb["predicted_time_s"] for mb in step]) * 1e3
    print(f"predicted micro-batch time {pred.min():.0f}-{pred.max():.0f} ms (slowest {pred.max() / pred.mean():.2f}x "
          f"the mean)")
    head = f"{'mb':>3} {'rows':>5} {'text len':>8} {'tiles':>5} {'real tok':>9} {'pred ms':>8}"
    print(head + "\n" + "-" * len(head))
    for mb in step[:8]:
        print(f"{mb['microbatch']:>3} {mb['input_ids'].shape[0]:>5} {mb['input_ids'].shape[1]:>8} "
              f"{int(mb['image_tiles'].sum()):>5} {mb['real_tokens']:>9} {mb['predicted_time_s'] * 1e3:>8.1f}")
    if len(step) > 8:
        print(f"... and {len(step) - 8} more micro-batches ({len(step)} in all)")
    # the baseline: the same samples packed, from the length index of the same shards
    index = build_index(str(image_dir), tokenizer="bytes", max_len=options.max_len, vision=DynamicTiling(),
                        chat_template=CHAT_TEMPLATE)
    shapes = Shapes.from_arrow(index)
    ids = np.concatenate([mb["sample_ids"].numpy() for mb in step])
    order = np.argsort(shapes.sample_id, kind="stable")
    positions = np.sort(order[np.searchsorted(shapes.sample_id, ids, sorter=order)])
    dp, pack = _plans(shapes, vlm, options, positions)
    planned = sorted(sorted(mb.sample_ids.tolist()) for mb in dp.microbatches(0))
    delivered = sorted(sorted(mb["sample_ids"].tolist()) for mb in step)
    print(f"the streamed micro-batches equal dynabatch's plan of these samples from their length index: "
          f"{planned == delivered}")
    print(_result("vlm", dp, pack, len(positions)))


def run_demo(out_dir: str | None = None, seed: int = 0, text_samples: int = 6000, image_text_samples: int = 200,
             verbose: bool = False) -> int:
    """Generate shards, plan and stream them; print the plans, the delivered micro-batches and each
    part's result against packing (``verbose``: also the planner's objective against its bound)."""
    from .datagen import write_image_text_shards, write_text_shards

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(out_dir) if out_dir else Path(tmp)
        text_dir, image_dir = root / "text", root / "image_text"
        write_text_shards(text_dir, text_samples, num_shards=4, seed=seed)
        write_image_text_shards(image_dir, image_text_samples, num_shards=2, seed=seed)
        print(f"generated {text_samples} FLAN-like samples in {text_dir} and {image_text_samples} image+text "
              f"samples in {image_dir}")
        for model in ("gpt", "t5"):
            _text_demo(text_dir, model, seed, verbose)
        _image_text_demo(image_dir, seed)
    return 0
