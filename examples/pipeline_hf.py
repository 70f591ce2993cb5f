"""Train a Hugging Face folder (model + tokenizer; decoder, T5/BART or LLaVA) on pipeline stages, each rank loading
only its stage's weights, with feedback and adaptive recomputation; merge the stages into a save_pretrained folder.
Run `python examples/pipeline_hf.py MODEL_DIR DATA --stages 2` (local ranks; `--ranks 4`: 2 replicas of 2 stages)
or under torchrun, one rank each (`torchrun --nproc-per-node 4 examples/pipeline_hf.py MODEL_DIR DATA --stages 2`)."""
import argparse
import os

import torch

from dynabatch import Costing, DataLoader, DataSource, FeedbackLoop, PlanOptions, Tokenization
from dynabatch.check import folder_report
from dynabatch.pipeline import (PipelineRunner, RunnerConfig, init_pipeline, load_stage, loader_runtime, run_ranks,
                                stage_cost_model)


def train(rank, world, port, a):
    with init_pipeline(a["stages"], rank=rank, world_size=world, master_port=port) as ctx:
        part = load_stage(a["model_dir"], ctx)  # this rank's layers only
        cost = stage_cost_model(part.model, ctx.num_stages)  # analytic prior, refit from the measured steps
        options = PlanOptions(num_stages=ctx.num_stages, global_batch_tokens=a["batch_tokens"], max_len=a["max_len"],
                              recompute="adaptive", device_memory_limit=a["memory_limit"])
        loader = DataLoader(a["data"], options=options, tokenization=Tokenization(tokenizer=a["model_dir"]),
                            source=DataSource(mode="indexed"), costing=Costing(cost_model=cost),
                            feedback=FeedbackLoop(cost),
                            runtime=loader_runtime(ctx, plan_ahead=0))  # this replica's share of the data
        if ctx.rank == 0 and len(loader) < a["steps"]:  # said before any step: more epochs than one
            print(f"the data gives {len(loader)} steps per epoch: training {a['steps']} steps over "
                  f"{-(-a['steps'] // len(loader))} epochs", flush=True)
        runner = PipelineRunner.from_model(part.model, ctx, part.bounds, RunnerConfig(gather_timing=True))
        optimizer = torch.optim.AdamW(runner.parameters(), lr=1e-3)
        for k, step in enumerate(loader.train_steps(a["steps"])):  # an epoch without a step is an error
            result = runner.step(step.plan, step, optimizer=optimizer)
            loader.feedback(result)  # refit the cost model from the measured times
            if ctx.rank == 0:
                t = result.timing  # the recomputed layers the plan chose and the activation bytes measured
                print(f"step {k} loss {result.loss:.4f} tokens {result.num_tokens} recomputed layers "
                      f"{t.recompute_layers} peak activations {t.peak_saved_bytes:.0f} B", flush=True)
        loader.close()
        part.save(a["out"])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model_dir", help="a save_pretrained folder with the tokenizer")
    p.add_argument("data", help="JSONL/Parquet file, folder or glob of records")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--ranks", type=int, help="local processes: stages x data-parallel replicas (default --stages)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="pipeline_hf_out", help="the merged save_pretrained folder")
    p.add_argument("--batch-tokens", type=int, default=4096, help="global batch, tokens")
    p.add_argument("--max-len", type=int, default=512, help="longest sample, tokens")
    p.add_argument("--memory-limit", type=float, default=256e6, help="activation bytes a stage may hold")
    args = p.parse_args()
    problems = folder_report(args.model_dir, stages=args.stages).problems  # before any rank starts
    if problems:
        raise SystemExit("\n".join(f"{args.model_dir}: {x}" for x in problems))
    run_ranks(f"{__file__}:train", args.ranks or args.stages, args=(vars(args),),
              idle_timeout_s=600)  # 600 s: numba's first compile
    if os.environ.get("RANK", "0") == "0":  # under torchrun every process is a rank: one line of it
        print("merged into", args.out)
