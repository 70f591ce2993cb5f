"""Train a tiny T5-style encoder-decoder (or, with --model gpt-tiny, a GPT-style decoder) for real on
FLAN-like data over 2 pipeline stages (2 local processes, gloo on CPU), fed by `dynabatch.DataLoader`,
run by `dynabatch.pipeline.PipelineRunner`, with the planner's cost model refit online by
`dynabatch.core.feedback.FeedbackLoop` from the measured micro-batch times.

    python examples/train_t5_pipeline.py --steps 30
    python examples/train_t5_pipeline.py --steps 30 --data ../shared/data/text/niv2_sample.jsonl.gz

Each step prints the loss (per real target token of the global batch), the real tokens, the
planned vs measured forward+backward seconds (summed over micro-batches, slowest stage) and the
MAPE of the cost model's predictions for that step (made before the step ran).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile

import numpy as np
import torch

import dynabatch
from dynabatch.bench.train import batch_shapes, representative, stage_cost_model
from dynabatch.datagen import write_text_shards
from dynabatch.core.feedback import FeedbackLoop
from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, launch_local, make_model, search_partition


def worker(rank: int, world_size: int, port: int, args: dict):
    """One pipeline stage. Every rank builds the same model and the same DataLoader (same data
    order, same cost model), so every rank holds the same micro-batches and the same plan."""
    torch.set_num_threads(1)
    stages = world_size
    with init_pipeline(num_stages=stages, rank=rank, world_size=world_size, master_port=port) as ctx:
        model = make_model(args["model"], hidden=args["hidden"], seed=args["seed"])
        enc_dec = model.kind == "encoder_decoder"
        cost = stage_cost_model(model, stages, "cpu")          # analytic prior for one stage, refit below
        feedback = FeedbackLoop(cost, refit_every=2, forgetting=0.8)
        loader = dynabatch.DataLoader(
            args["data"], index=args["index"], cost_model=cost, num_stages=stages,
            batch_tokens=args["batch_tokens"], max_len=args["max_len"],
            max_target_len=args["max_target_len"] if enc_dec else None,
            world_size=1, rank=0,        # one pipeline: both stages read the same micro-batches
            plan_ahead=0,                # plan each step after the previous refit: identical on every rank
            seed=args["seed"], drop_last=True)
        steps = iter(loader.steps())
        first = next(steps)
        # the stage split: profile every layer on the first global batch's micro-batch mix, simulate
        # every split, keep the fastest (per-layer costs are averaged over ranks: one split for all)
        split = search_partition(model.layers, representative(first), stages)
        if rank == 0:
            print(f"stage split {list(split.bounds)} (simulated step {split.makespan_s * 1e3:.0f} ms, "
                  f"stage busy {', '.join(f'{t * 1e3:.0f}' for t in split.stage_busy_s)} ms)", flush=True)
        runner = PipelineRunner.from_model(model, ctx, split, config=RunnerConfig(schedule="1f1b", gather_timing=True))
        optimizer = torch.optim.AdamW(runner.parameters(), lr=args["lr"])
        losses = []
        for step, mbs in enumerate(itertools.chain([first], steps)):
            if step >= args["steps"]:
                break
            shapes = batch_shapes(mbs, loader.collation)         # the plan's shapes, from the batches
            result = runner.step(shapes, mbs, optimizer=optimizer)
            measured = np.max([t.compute_s for t in result.all_timings], axis=0)   # slowest stage
            predicted = np.array([s.time_s for s in shapes])
            phi = cost.padded_features(np.array([s.rows for s in shapes]), np.array([s.input_len for s in shapes]),
                                       np.array([s.target_len for s in shapes]), np.zeros(len(shapes), np.int64))
            mape = feedback.record(phi, measured, predicted_s=predicted)   # the same numbers on every rank
            feedback.maybe_refit()                                          # refits the loader's cost model
            losses.append(result.loss)
            if rank == 0:
                print(f"step {step:3d}  loss {result.loss:.4f}  real tokens {sum(b['real_tokens'] for b in mbs):6d}  "
                      f"micro-batches {len(mbs):3d}  predicted {predicted.sum() * 1e3:7.1f} ms  "
                      f"measured {measured.sum() * 1e3:7.1f} ms  MAPE {mape:6.1%}", flush=True)
        loader.close()
        return {"losses": losses, "refits": len(feedback.history)} if rank == 0 else None


def main(argv=None, default_model: str = "t5-tiny") -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("t5-tiny", "gpt-tiny"), default=default_model)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--data", nargs="+", help="JSONL files with inputs/targets (default: generated FLAN-like data)")
    p.add_argument("--samples", type=int, default=3000, help="generated samples when --data is not given")
    p.add_argument("--batch-tokens", type=int, default=8192, help="global batch in tokens")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-target-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = a.data or [str(x) for x in write_text_shards(os.path.join(tmp, "data"), a.samples, seed=a.seed)]
        family = "encoder_decoder" if a.model == "t5-tiny" else "decoder"
        index = os.path.join(tmp, "index.parquet")                 # scan once, share with both ranks
        dynabatch.build_index(data, family=family, max_len=a.max_len,
                              max_target_len=a.max_target_len if family == "encoder_decoder" else None, path=index)
        args = dict(model=a.model, steps=a.steps, data=data, index=index, batch_tokens=a.batch_tokens,
                    max_len=a.max_len, max_target_len=a.max_target_len, hidden=a.hidden, lr=a.lr, seed=a.seed)
        procs = launch_local(f"{os.path.abspath(__file__)}:worker", 2, args=(args,), timeout_s=a.timeout)
    for pr in procs:
        if pr.returncode != 0 or pr.timed_out:
            sys.stderr.write(f"rank {pr.rank} failed (rc={pr.returncode}, timed out={pr.timed_out}):\n{pr.stderr}\n")
            return 1
    sys.stdout.write(procs[0].stdout.split("DYNABATCH_RESULT")[0])
    res = procs[0].result
    if res and res["losses"]:
        print(f"{a.model}: loss {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f} over {len(res['losses'])} steps, "
              f"{res['refits']} cost model refits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
