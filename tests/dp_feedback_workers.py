"""Rank-side code of the data-parallel feedback and FSDP tests (`tests/test_trainer_feedback.py`,
`tests/test_trainer_fsdp.py`), run by `dynabatch.pipeline.launch_local`; no tests are defined here.

The feedback runs time a tiny Llama whose real cost is set by the test: `Truth` makes each
micro-batch sleep ``phi(rows, length) @ coef`` seconds (a third in the forward, the rest in the
backward), so the measured times follow a known cost model whatever else the machine runs (sleeps
cost no CPU; the model itself adds a few milliseconds of real compute and the machine's noise).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

MAX_LEN = 128
SECONDS_PER_TOKEN = 2e-4  # the sleeps' scale: a full micro-batch of 4 x 128 tokens sleeps ~0.1-0.3 s
PER_MICROBATCH_S = 4e-3


def coefficients(quadratic: float) -> np.ndarray:
    """Time coefficients (`dynabatch.core.cost.model.FEATURES`) of ``SECONDS_PER_TOKEN`` per token, ``quadratic``
    x that / MAX_LEN per squared token (rows x length^2) and `PER_MICROBATCH_S` per micro-batch."""
    c = np.zeros(10)
    c[0], c[1], c[7] = SECONDS_PER_TOKEN, quadratic * SECONDS_PER_TOKEN / MAX_LEN, PER_MICROBATCH_S
    return c


#: The prior the loader plans with, and the truth the sleeps follow: at MAX_LEN a micro-batch costs
#: (1 + 3.5) / (1 + 0.5) = 3x the prior's, a short one (16 tokens) 1.35x.
PRIOR, TRUTH = coefficients(0.5), coefficients(3.5)


def write_data(path: str, n: int = 96, seed: int = 0) -> str:
    """A Parquet file of ``n`` samples whose inputs run from 4 to ~120 bytes (the length spread the
    planner and the wrong prior differ on); returns ``path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        size = int(rng.choice([int(rng.integers(4, 24)), int(rng.integers(80, 120))]))
        rows.append({"inputs": f"q{i} " + "".join(rng.choice(list("abcdefgh "), size)),
                     "targets": "y" * int(rng.integers(1, 6))})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


class Truth:
    """Sleep each micro-batch's ``phi @ coef`` seconds in the model (see the module docstring)."""

    def __init__(self, cost, coef):
        self.cost, self.coef = cost, np.asarray(coef, np.float64)

    def seconds(self, rows: int, length: int) -> float:
        return float(self.cost.padded_features(rows, length, 0, 0)[0] @ self.coef)

    def attach(self, model: torch.nn.Module) -> torch.nn.Module:
        def before(module, args, kwargs):
            ids = kwargs["input_ids"]
            module._truth_s = self.seconds(int(ids.shape[0]), int(ids.shape[1]))
            time.sleep(module._truth_s / 3)

        def after(module, args, kwargs, out):
            rest = 2 * module._truth_s / 3
            out.logits.register_hook(lambda g: (time.sleep(rest), g)[1])
            return out

        model.register_forward_pre_hook(before, with_kwargs=True)
        model.register_forward_hook(after, with_kwargs=True)
        return model


def tiny_llama(seed: int = 0):
    """`tests/test_hf_trainer.py`'s random 1-layer Llama (float64) in float32 (the Trainer runs)."""
    from test_hf_trainer import tiny_llama as llama

    return llama(seed).float()


def feedback_loader(path: str, rank: int, world: int, *, global_batch_tokens: int = 1800, feedback: bool = True):
    """The tests' loader: bytes tokens, padded, one stage, planned on demand, its cost model's time
    coefficients `PRIOR` (the gpt-cpu preset's memory model), with a `FeedbackLoop` (refit every 3 steps)."""
    import dynabatch
    from dynabatch import Costing, CostModel, FeedbackLoop, PlanOptions, Runtime, Tokenization

    cost = CostModel.preset("gpt", "cpu")
    cost.time_coef = PRIOR
    loop = FeedbackLoop(cost, refit_every=3, forgetting=0.9) if feedback else None
    return dynabatch.DataLoader(
        path, feedback=loop, options=PlanOptions(global_batch_tokens=global_batch_tokens, max_len=MAX_LEN, num_stages=1,
                                                 memory_limit=8e9),
        tokenization=Tokenization(tokenizer="bytes"), costing=Costing(cost_model=cost, collate="padded"),
        runtime=Runtime(rank=rank, world_size=world, plan_ahead=0))


def cuts(plan) -> str:
    """A hash of which samples form each micro-batch and where it runs (not of the predicted times):
    what the planner decided, whatever the cost model's coefficients."""
    import hashlib

    h = hashlib.sha256()
    for arr in (plan.sample_ids, plan.mb_offsets, plan.mb_rank, plan.mb_order):
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()[:16]


def prior_plans(path: str, world: int, steps: int) -> dict:
    """Step number -> (fingerprint, `cuts`) of the first ``steps`` steps as the loader plans them with the
    `PRIOR` alone (no feedback), epoch after epoch as the Trainer iterates them."""
    loader = feedback_loader(path, 0, world, feedback=False)
    out, epoch = {}, 0
    while len(out) < steps:
        loader.set_epoch(epoch)
        for step in loader:
            out[int(step.step)] = (step.plan.fingerprint(), cuts(step.plan))
        epoch += 1
    loader.close()
    return {k: v for k, v in out.items() if k < steps}


def _trainer_env(rank: int, world: int, port: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def _trainer_run(path: str, out: str, rank: int, world: int, *, max_steps: int, resume: str | None = None):
    """A `DynabatchTrainer` run on the `Truth` model; per step: plan fingerprint, cost version,
    micro-batches, the cost model's coefficients after the step."""
    import transformers

    from dynabatch.pipeline.runtime.launch import heartbeat
    from dynabatch.integrations import DynabatchTrainer

    class Recording(DynabatchTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            loop = self.train_loader.feedback_loop
            self.seen.append({"step": inputs.step, "plan": inputs.plan.fingerprint(), "cuts": cuts(inputs.plan),
                              "version": inputs.cost_version,
                              "microbatches": len(inputs), "coef": loop.cost_model.time_coef.tolist(),
                              "metrics": self.step_feedback.last.as_dict()})
            heartbeat()
            return loss

    loader = feedback_loader(path, rank, world)
    model = Truth(loader.cost, TRUTH).attach(tiny_llama())
    args = transformers.TrainingArguments(output_dir=out, max_steps=max_steps, save_strategy="steps", save_steps=7,
                                          use_cpu=True, report_to=[], logging_steps=1, disable_tqdm=True,
                                          learning_rate=0.05, lr_scheduler_type="constant", max_grad_norm=0.0)
    trainer = Recording(model=model, args=args, train_loader=loader,
                        optimizers=(torch.optim.SGD(model.parameters(), lr=0.05), None))
    trainer.seen = []
    trainer.train(resume_from_checkpoint=resume)
    loop = loader.feedback_loop
    return {"seen": trainer.seen, "history": [dict(step=r.step, observations=r.observations, window=r.window,
                                                    before=r.mape_before_refit, after=r.mape_after_refit)
                                               for r in loop.history],
            "errors": [(e.global_step, e.mape, e.microbatches) for e in loop.step_errors],
            "logs": [h for h in trainer.state.log_history if "loss" in h]}


def _accelerate_run(path: str, out_dir: str, rank: int, world: int, steps: int):
    """`StepFeedback.backward` in a hand-written accelerate loop: each step's metrics, and whether
    ``accelerator.save_state`` / ``load_state`` carried the refit state into a new StepFeedback."""
    from accelerate import Accelerator

    from dynabatch.integrations import StepFeedback

    accelerator = Accelerator(cpu=True)
    loader = feedback_loader(path, rank, world)
    model = Truth(loader.cost, TRUTH).attach(tiny_llama(seed=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = accelerator.prepare(model, opt)
    feedback = StepFeedback(loader)
    out = []
    for step in loader:
        m = feedback.backward(model, step, accelerator=accelerator)
        opt.step()
        opt.zero_grad()
        out.append({**m.as_dict(), "plan": step.plan.fingerprint()})
        if len(out) == steps:
            break
    # accelerate's own checkpoint carries the refit state (StepFeedback has state_dict/load_state_dict)
    folder = os.path.join(out_dir, "accelerate")
    accelerator.register_for_checkpointing(feedback)
    accelerator.save_state(folder)
    again = StepFeedback(feedback_loader(path, rank, world))
    resumed = Accelerator(cpu=True)  # as a new process would: only the feedback registered
    resumed.register_for_checkpointing(again)
    resumed.load_state(folder)
    restored = again.loop.cost_model.time_coef.tolist() == loader.cost.time_coef.tolist()
    return {"steps": out, "restored": restored and len(again.loop.history) == len(feedback.loop.history)}


def trainer_feedback(rank, world, port, path, out):
    """The 2-rank feedback launch: an uninterrupted Trainer run of 12 steps (checkpoint at 7), a run
    resumed from that checkpoint, and 4 steps of an accelerate loop."""
    torch.set_num_threads(1)
    _trainer_env(rank, world, port)
    full = _trainer_run(path, os.path.join(out, "full"), rank, world, max_steps=12)
    ckpt = os.path.join(out, "full", "checkpoint-7")
    resumed = _trainer_run(path, os.path.join(out, "resumed"), rank, world, max_steps=12, resume=ckpt)
    acc = _accelerate_run(path, out, rank, world, steps=4)
    return {"full": full, "resumed": resumed, "accelerate": acc, "saved": sorted(os.listdir(ckpt)),
            "cpu_s": time.process_time()}


def _fsdp_case(kind: str, path: str, rank: int, world: int) -> dict:
    """One step of `step_backward` on a ``kind`` (fsdp2: ``fully_shard`` per layer and at the root;
    fsdp1: ``FullyShardedDataParallel``) tiny Llama, with feedback: the full gradient's relative
    distance to the big padded batch's of the same global step (float64, on one process), whether any
    gradient existed before each micro-batch (FSDP2 keeps them unreduced until the last), the metrics
    and what feedback did."""
    import warnings

    from test_hf_trainer import big_batch, f64_loss, rel
    from test_hf_trainer import tiny_llama as llama
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    from dynabatch.integrations import StepFeedback, step_backward

    whole = next(iter(feedback_loader(path, 0, 1, feedback=False)))  # the same global step on one process
    ref_model = llama()
    f64_loss(ref_model, big_batch(whole), whole.target_tokens).backward()
    ref = torch.cat([p.grad.flatten() for p in ref_model.parameters()])
    model = llama()
    if kind == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))  # CPU: named
    loader = feedback_loader(path, rank, world)
    feedback = StepFeedback(loader)
    step = next(iter(loader))
    early = []

    def loss_fn(m, inputs, n):
        early.append(any(p.grad is not None for p in m.parameters()))
        return f64_loss(m, inputs, n)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = step_backward(model, step, loss_fn=loss_fn, feedback=feedback)
    if kind == "fsdp2":
        grad = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
    else:
        with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    loop = loader.feedback_loop
    return {"rel": rel(grad, ref), "early": early, "microbatches": len(step), "loss": float(loss),
            "samples": sorted(int(i) for mb in step for i in mb["sample_ids"].tolist()),
            "whole": sorted(int(i) for mb in whole for i in mb["sample_ids"].tolist()),
            "warnings": [str(w.message) for w in caught], "recorded": loop.steps_recorded,
            "metrics": feedback.last.as_dict()}


def fsdp_cases(rank, world, port, path):
    """The 2-rank FSDP launch (gloo, CPU): FSDP2 and FSDP1 steps (`_fsdp_case`), then the two Trainers
    that are refused on the CPU: one given an FSDP2-sharded model, one with ``TrainingArguments(fsdp=True)``
    (the error messages, None when not refused)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    _trainer_env(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {kind: _fsdp_case(kind, path, rank, world) for kind in ("fsdp2", "fsdp1")}
    import transformers
    from torch.distributed.fsdp import fully_shard

    from dynabatch.integrations import DynabatchTrainer

    def refusal(model, **fsdp):
        args = transformers.TrainingArguments(output_dir=os.path.join(os.path.dirname(path), f"t{rank}"), max_steps=1,
                                              use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, **fsdp)
        try:
            DynabatchTrainer(model=model, args=args, train_loader=feedback_loader(path, rank, world, feedback=False))
        except NotImplementedError as e:
            return str(e)
        return None

    sharded = tiny_llama()
    fully_shard(sharded)
    out["presharded"] = refusal(sharded)
    out["trainer_fsdp"] = refusal(tiny_llama(), fsdp=True, fsdp_config={"version": 2})
    out["cpu_s"] = time.process_time()
    return out
