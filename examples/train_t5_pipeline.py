"""Train a tiny T5-style encoder-decoder (or, with --model gpt-tiny, a GPT-style decoder) for real on
FLAN-like data over 2 pipeline stages (2 local processes, gloo on CPU), fed by `dynabatch.DataLoader`,
run by `dynabatch.pipeline.PipelineRunner`, with the planner's cost model refit online from the
measured micro-batch times by the loader's `dynabatch.core.plan.feedback.FeedbackLoop`:

    loader = DataLoader(..., costing=Costing(cost_model=cost), feedback=FeedbackLoop(cost))
    for step in loader.steps():
        result = runner.step(batch_shapes(step), step, optimizer=optimizer)
        loader.feedback(result)

    python examples/train_t5_pipeline.py --steps 30
    python examples/train_t5_pipeline.py --steps 30 --data ../shared/data/text/niv2_sample.jsonl.gz

Each step prints the loss (per real target token of the global batch), the real tokens, the
planned vs measured forward+backward seconds (summed over micro-batches, slowest stage), the MAPE
of the cost model's predictions for that step (made before the step ran) and the cost model
version the step was planned with.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile

import torch

import dynabatch
from dynabatch import Costing, DataSource, PlanOptions, Runtime
from dynabatch.datagen import write_text_shards
from dynabatch.pipeline import (PipelineRunner, RunnerConfig, batch_shapes, init_pipeline, launch_local, make_model,
                                search_partition, stage_cost_model)
from dynabatch.pipeline.measure import representative


def worker(rank: int, world_size: int, port: int, args: dict):
    """One pipeline stage. Every rank builds the same model and the same DataLoader (same data
    order, same cost model), so every rank holds the same micro-batches and the same plan."""
    torch.set_num_threads(1)
    stages = world_size
    with init_pipeline(num_stages=stages, rank=rank, world_size=world_size, master_port=port) as ctx:
        model = make_model(args["model"], hidden=args["hidden"], seed=args["seed"])
        enc_dec = model.kind == "encoder_decoder"
        cost = stage_cost_model(model, stages, "cpu")          # analytic prior for one stage, refit online
        feedback = dynabatch.FeedbackLoop(cost, refit_every=2, forgetting=0.8)
        loader = dynabatch.DataLoader(args["data"], feedback=feedback,
                                      options=PlanOptions(num_stages=stages, global_batch_tokens=args["batch_tokens"],
                                                          max_len=args["max_len"],
                                                          max_target_len=args["max_target_len"] if enc_dec else None,
                                                          seed=args["seed"], drop_last=True),
                                      source=DataSource(index=args["index"]), costing=Costing(cost_model=cost),
                                      # one pipeline: both stages read the same micro-batches; plan each step
                                      # after the previous refit (plan_ahead=0): identical on every rank
                                      runtime=Runtime(world_size=1, rank=0, plan_ahead=0))
        steps = loader.steps()
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
        for k, step in enumerate(itertools.chain([first], steps)):
            if k >= args["steps"]:
                break
            result = runner.step(batch_shapes(step), step, optimizer=optimizer)
            loader.feedback(result)      # record the measured times against the plan, refit every 2 steps
            losses.append(result.loss)
            err = feedback.step_errors[-1]   # the same numbers on every rank (gathered timings)
            if rank == 0:
                print(f"step {k:3d}  loss {result.loss:.4f}  real tokens {sum(b['real_tokens'] for b in step):6d}  "
                      f"micro-batches {len(step):3d}  predicted {err.predicted_s * 1e3:7.1f} ms  "
                      f"measured {err.measured_s * 1e3:7.1f} ms  MAPE {err.mape:6.1%}  "
                      f"cost model v{step.cost_version}", flush=True)
        loader.close()
        return {"losses": losses, "refits": len(feedback.history), "version": cost.version} if rank == 0 else None


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
              f"{res['refits']} cost model refits (version {res['version']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
