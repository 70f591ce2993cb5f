"""The rank side of ``dynabatch bench trainer`` (`dynabatch.bench.trainer`): real training through
``transformers.Trainer`` on one of two gloo DDP ranks, every method on the same samples, the same
tokenization, the same random initial weights, optimizer and number of steps.

Methods (`METHODS`):

* ``dp``: `dynabatch.DynabatchTrainer` over a `dynabatch.DataLoader` (padded micro-batches the DP
  planner balances over the ranks, ``global_batch_tokens`` per step) with a `FeedbackLoop` refitting
  the analytic cost model of the model's config from the measured micro-batch times
  (`dynabatch.integrations.feedback`); planned on demand (``plan_ahead=0``): its planning is in its
  step times.
* ``group_by_length``: ``transformers.Trainer`` with ``DataCollatorForSeq2Seq`` (padding to the
  batch's longest sample, labels -100) and ``train_sampling_strategy="group_by_length"`` (what
  ``group_by_length=True`` became in transformers 5), a batch size in samples that gives the same
  tokens per step on average.
* ``batch_rebalance``: the same with ``train_sampling_strategy="batch_rebalance"``, transformers' own
  balancer of padded-token cost across the data-parallel ranks (5.x).
* ``flattening``: ``transformers.Trainer`` with ``DataCollatorWithFlattening``: the batch's samples in
  one padding-free row with restarting ``position_ids`` (decoder-only models; the model's SDPA
  attention then builds the packed row's block-diagonal mask and computes it densely on a CPU).
* ``trl_bfd`` (when ``trl`` is installed; decoder-only): TRL's best-fit-decreasing packing
  (``trl.pack_dataset(..., strategy="bfd")``, what ``SFTTrainer(packing=True)`` runs) of the samples
  into rows of at most ``max_len`` tokens, a batch size in packed rows that gives the same tokens per
  step on average, and TRL's padding-free collator (the batch's rows in one row, ``position_ids``
  restarting at each sample, so the model's SDPA attention keeps samples apart); see `bfd_rows`.

Methods are interleaved: ``rounds`` rounds, each training every method ``steps / rounds`` steps in
turn (rotating which goes first), resumed from its own checkpoint of the round before; the first
step after each resume is not timed (it pays for the Trainer's start).

What each rank records per timed step: the wall seconds since its previous step ended (data,
forward, backward, all-reduce and optimizer: what a user waits for), the CPU seconds its process
used in that time (what the step cost it, whatever else the machine ran), its target (loss) tokens,
real and computed tokens, and the seconds its model's forward calls took (`ForwardClock`: clean of
the gradient all-reduce, which holds the backward of a step's last micro-batch).
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch

from .trainer_names import METHODS, MODELS, family, unsupported  # noqa: F401  (re-exported)

VOCAB = 259  # the bytes tokenizer's
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
T5 = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
          dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
          relative_attention_num_buckets=16, relative_attention_max_distance=64)


def build_model(model: str, seed: int):
    """The bench's tiny random ``model`` (float32; Llama with SDPA attention), the same weights on every rank."""
    import transformers

    torch.manual_seed(seed)
    if model == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(**T5))
    config = transformers.LlamaConfig(**LLAMA)
    config._attn_implementation = "sdpa"
    # training needs no KV cache, and with one (config.use_cache, the default, builds it even in train
    # mode) the model does not read packed rows' restarting position_ids: flattening's and trl_bfd's
    # samples would attend to each other (see dynabatch.loader.collate.model_inputs)
    config.use_cache = False
    return transformers.LlamaForCausalLM(config)


def cost_prior(model):
    """The analytic cost model of ``model``'s config on the CPU preset: dp's prior, refit by feedback."""
    from ..core.cost.model import CostModel, device_preset
    from ..pipeline.models.hf import from_hf

    return CostModel(from_hf(model.config, seed=0).config, device_preset("cpu"))


def tokenize(path: str, model: str, max_len: int, max_target_len: int) -> list[dict]:
    """The samples of the Parquet file ``path`` as the ``dp`` loader tokenizes them (bytes tokens,
    truncated alike): ``input_ids`` and ``labels`` (decoder: -100 on the prompt; T5: the target ids)."""
    import pyarrow.parquet as pq

    from ..loader.dataloader import make_formatter

    fmt = make_formatter("bytes", family(model), max_len=max_len, max_target_len=max_target_len)
    rows = pq.read_table(path).to_pylist()
    out = []
    for e in fmt.encode_batch([{**r, "sample_id": i} for i, r in enumerate(rows)]):
        labels = e.labels if e.target_ids is None else e.target_ids
        out.append({"input_ids": e.input_ids.astype(np.int64).tolist(), "labels": labels.astype(np.int64).tolist()})
    return out


def byte_tokenizer():
    """A ``transformers`` tokenizer over the bytes tokenizer's ids (pad 0), for the collators' padding."""
    import tokenizers
    import transformers

    vocab = tokenizers.models.WordLevel({f"<{i}>": i for i in range(VOCAB)}, unk_token="<1>")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(vocab), pad_token="<0>")


def bfd_rows(samples: list[dict], seq_length: int) -> "datasets.Dataset":
    """``samples`` (``input_ids``, ``labels``) packed by TRL's best-fit decreasing into rows of at most
    ``seq_length`` tokens, with their ``seq_lengths``. Each sample's first label is masked (-100): a
    causal LM never predicts it from inside its own sample, and in a packed row it would otherwise be
    predicted from the previous sample's last token (what ``DataCollatorWithFlattening`` masks too)."""
    import datasets
    from trl import pack_dataset

    rows = [{"input_ids": s["input_ids"], "labels": [-100, *s["labels"][1:]]} for s in samples]
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a bar per map() in the ranks' logs says nothing here
    try:
        return pack_dataset(datasets.Dataset.from_list(rows), seq_length, strategy="bfd")
    finally:
        if shown:
            datasets.enable_progress_bars()


def counts(inputs: dict, seq2seq: bool) -> tuple[int, int, int]:
    """(target tokens, real tokens, computed tokens) of a micro-batch's model inputs: target = loss
    tokens (decoder: after the shift), real = unpadded inputs (+ targets for T5), computed = every
    position the model runs (padding included)."""
    labels = inputs["labels"]
    target = int((labels != -100).sum()) if seq2seq else int((labels[:, 1:] != -100).sum())
    mask = inputs.get("attention_mask")
    ids = inputs["input_ids"]
    real = int(mask.sum()) if mask is not None else int(ids.numel())
    computed = int(ids.numel())
    if seq2seq:
        real, computed = real + int((labels != -100).sum()), computed + int(labels.numel())
    return target, real, computed


class ForwardClock:
    """Seconds this rank's model spent in its forward calls since the last `take` (CPU clock: the bench
    runs on gloo CPU ranks, where a forward is synchronous)."""

    def __init__(self, model: torch.nn.Module):
        self.seconds, self._t0 = 0.0, None
        model.register_forward_pre_hook(lambda m, a: self._start())
        model.register_forward_hook(lambda m, a, o: self._stop())

    def _start(self):
        self._t0 = time.perf_counter()

    def _stop(self):
        if self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def _recording(base):
    """``base`` (a Trainer class) recording each step's counts (`counts`), forward seconds
    (`ForwardClock`), end time and, for ``dp``, its feedback (`_record_step_end`, at ``on_step_end``)."""
    from ..loader.collate import model_inputs
    from ..loader.step import Step
    from .progress import rank_tick

    class Recording(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            mbs = [model_inputs(mb) for mb in inputs] if isinstance(inputs, Step) else [inputs]
            c = np.sum([counts(mb, self.seq2seq) for mb in mbs if "labels" in mb], axis=0)
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.pending = {"target": int(c[0]), "real": int(c[1]), "computed": int(c[2]), "microbatches": len(mbs)}
            fb = getattr(self, "step_feedback", None)
            if fb is not None and fb.loop is not None and fb.loop.last is not None:
                last = fb.loop.last
                self.pending.update(mape=fb.last.cost_mape, obs=[last.phi.tolist(), last.measured_s.tolist()])
            return loss

        def _record_step_end(self):
            self.records.append(dict(self.pending, step=int(self.state.global_step), end=time.perf_counter(),
                                     cpu_end=time.process_time(), forward_s=self.forward_clock.take()))
            if int(os.environ.get("RANK", "0")) == 0:
                rank_tick()

    return Recording


def _step_end_callback():
    from transformers import TrainerCallback

    from ..pipeline.runtime.launch import heartbeat

    class StepEnd(TrainerCallback):
        def __init__(self):
            self.trainer = None

        def on_step_end(self, args, state, control, **kwargs):
            self.trainer._record_step_end()
            heartbeat()
            return control

    return StepEnd()


def make_trainer(method: str, model_name: str, cfg: dict, paths: dict, rank: int, world: int, max_steps: int,
                 out: str):
    """The Trainer of ``method`` on a fresh ``model_name`` (weights from the run's seed; a resumed round
    loads the checkpoint's), training to ``max_steps``."""
    import transformers

    model = build_model(model_name, cfg["seed"])
    seq2seq = model_name == "t5"
    args = dict(output_dir=out, max_steps=max_steps, learning_rate=cfg["lr"], lr_scheduler_type="constant",
                warmup_steps=0, weight_decay=0.0, optim="adamw_torch", max_grad_norm=1.0, use_cpu=True, report_to=[],
                logging_steps=1, save_strategy="steps", save_steps=cfg["steps_per_round"], save_total_limit=1,
                disable_tqdm=True, seed=cfg["seed"], data_seed=cfg["seed"], dataloader_num_workers=0,
                # every parameter is used (no extra graph walk); no buffer broadcast before each forward (none changes)
                ddp_find_unused_parameters=False, ddp_broadcast_buffers=False)
    callback = _step_end_callback()
    if method == "dp":
        import dynabatch
        from dynabatch import Costing, FeedbackLoop, PlanOptions, Runtime, Tokenization

        from ..integrations.hf import DynabatchTrainer

        cost = cost_prior(model)
        loader = dynabatch.DataLoader(
            paths["train"], feedback=FeedbackLoop(cost, refit_every=cfg["refit_every"]),
            options=PlanOptions(global_batch_tokens=cfg["global_batch_tokens"], max_len=cfg["max_len"],
                                max_target_len=cfg["max_target_len"] if seq2seq else None, num_stages=1,
                                shuffle=True, seed=cfg["seed"]),
            tokenization=Tokenization(tokenizer="bytes", model=model), costing=Costing(cost_model=cost, collate="padded"),
            runtime=Runtime(rank=rank, world_size=world, plan_ahead=0))
        trainer = _recording(DynabatchTrainer)(model=model, args=transformers.TrainingArguments(**args),
                                               train_loader=loader, callbacks=[callback])
    else:
        import datasets

        if method == "trl_bfd":
            from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

            data, batch = paths["bfd_rows"], cfg["bfd_batch_size"][model_name]  # packed once per rank (bench_rank)
            collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
            args.update(remove_unused_columns=False)  # the collator needs seq_lengths, which the model does not take
        else:
            data, batch = datasets.Dataset.from_list(paths["samples"]), cfg["batch_size"][model_name]
            collator = (transformers.DataCollatorWithFlattening(separator_id=-100) if method == "flattening" else
                        transformers.DataCollatorForSeq2Seq(byte_tokenizer(), model=model if seq2seq else None,
                                                            label_pad_token_id=-100))
        args.update(per_device_train_batch_size=batch,
                    train_sampling_strategy=method if method in ("group_by_length", "batch_rebalance") else "random")
        trainer = _recording(transformers.Trainer)(model=model, args=transformers.TrainingArguments(**args),
                                                   train_dataset=data, data_collator=collator, callbacks=[callback])
    callback.trainer = trainer
    trainer.seq2seq, trainer.records, trainer.pending = seq2seq, [], {}
    trainer.forward_clock = ForwardClock(model)
    return trainer


def eval_loss(model, samples: list[dict], seq2seq: bool, batch: int = 8) -> float:
    """Mean loss per target token (nats) of ``model`` on held-out ``samples``, padded batches: the same
    normalization for every method, whatever its training loss averaged over."""
    from ..loader.token_loss import summed_cross_entropy

    collate = byte_tokenizer()
    total, tokens = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(samples), batch):
            import transformers

            b = transformers.DataCollatorForSeq2Seq(collate, model=model if seq2seq else None,
                                                    label_pad_token_id=-100)(samples[i:i + batch])
            logits = model(**b).logits
            s, n = summed_cross_entropy(logits, b["labels"], shift=not seq2seq)
            total, tokens = total + float(s), tokens + int(n)
    model.train()
    return total / tokens if tokens else math.nan


def bench_rank(rank: int, world: int, port: int, cfg: dict, paths: dict) -> dict:
    """One rank of the bench (`dynabatch.pipeline.launch_local` target): every supported (model,
    method) trained in interleaved rounds; their per-step records and final held-out loss."""
    from ..pipeline.runtime.launch import heartbeat

    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    runs = [(m, k) for m in cfg["models"] for k in cfg["methods"] if unsupported(m, k, cfg["trl_installed"]) is None]
    data = {m: {"train": paths[m]["train"], "samples": tokenize(paths[m]["train"], m, cfg["max_len"],
                                                                cfg["max_target_len"])} for m in cfg["models"]}
    for m in {m for m, k in runs if k == "trl_bfd"}:  # BFD packs the whole set: once, not every round
        data[m]["bfd_rows"] = bfd_rows(data[m]["samples"], cfg["max_len"])
    heartbeat()
    results = {f"{m}/{k}": {"records": [], "rounds": []} for m, k in runs}
    spr = cfg["steps_per_round"]
    for r in range(cfg["rounds"]):
        order = runs[r % len(runs):] + runs[:r % len(runs)]
        for model_name, method in order:
            out = os.path.join(paths["out"], model_name, method)
            resume = os.path.join(out, f"checkpoint-{r * spr}") if r else None
            trainer = make_trainer(method, model_name, cfg, data[model_name], rank, world, (r + 1) * spr, out)
            trainer.train(resume_from_checkpoint=resume)
            res = results[f"{model_name}/{method}"]
            res["records"] += [dict(rec, round=r, timed=i > 0) for i, rec in enumerate(trainer.records)]
            res["rounds"].append(r)
            if r == cfg["rounds"] - 1:
                res["eval_loss"] = eval_loss(trainer.model, tokenize(paths[model_name]["eval"], model_name,
                                                                     cfg["max_len"], cfg["max_target_len"]),
                                             model_name == "t5")
                res["train_loss"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            heartbeat()
    return {"results": results, "cpu_s": time.process_time()}


__all__ = ["METHODS", "MODELS", "bench_rank", "bfd_rows", "build_model", "counts", "eval_loss", "family", "make_trainer",
           "tokenize", "unsupported"]
