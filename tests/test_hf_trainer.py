"""dynabatch steps as optimizer steps in ``transformers.Trainer`` (`DynabatchTrainer`) and in
``accelerate`` loops (`step_backward`): the gradient of a step equals that of one big padded batch
of the step's samples with the loss averaged over all its target tokens (not per micro-batch);
Trainer's step and epoch counters follow the loader's steps (epochs of different lengths
included); a run resumed from a checkpoint continues exactly where the loader stopped."""

import copy
import json
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="needs transformers (Hugging Face Trainer)")
accelerate = pytest.importorskip("accelerate", reason="needs accelerate (Hugging Face Trainer)")

import dynabatch
from dynabatch.integrations import LOADER_STATE_NAME, DynabatchTrainer, step_backward
from dynabatch.loader.settings import records_from_keywords

GBT = 400  # global batch in tokens: the data below gives 4 steps in epoch 0 and 5 in epoch 1
LR = 0.1


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    rows = []
    for i in range(40):
        body = "".join(rng.choice(list("abcdefgh "), int(rng.integers(3, 60))))
        rows.append({"inputs": f"q{i} {body}", "targets": "" if i % 5 == 4 else "y" * int(rng.integers(1, 12))})
    path = tmp_path_factory.mktemp("hf") / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def make_loader(path, collate="padded", **kw):
    return dynabatch.DataLoader(path,
                                **records_from_keywords(dict(tokenizer="bytes", global_batch_tokens=GBT, device="cpu",
                                                        collate=collate, cost_model="gpt", num_stages=2, max_len=128,
                                                        **kw)))


def tiny_llama(seed=0):
    """Random 1-layer Llama (hidden 32, vocab 260 for the bytes tokenizer), float64."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).to(torch.float64)


def f64_loss(model, inputs, num_items):
    """Summed shifted cross-entropy in float64 / num_items (HF's loss upcasts to float32 only)."""
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    labels = inputs["labels"]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                           reduction="sum") / num_items


def sample_rows(mb):
    """(input_ids, labels) of every sample of a padded or packed micro-batch, unpadded."""
    if "cu_seqlens" in mb:
        cu = mb["cu_seqlens"].tolist()
        return [(mb["input_ids"][0, a:b], mb["labels"][0, a:b]) for a, b in zip(cu[:-1], cu[1:])]
    n = mb["attention_mask"].sum(1).tolist()
    return [(mb["input_ids"][r, :k], mb["labels"][r, :k]) for r, k in enumerate(n)]


def big_batch(step):
    """One padded batch holding every sample of the step."""
    rows = [r for mb in step for r in sample_rows(mb)]
    L = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for r, (i, lab) in enumerate(rows):
        ids[r, :len(i)], labels[r, :len(i)], mask[r, :len(i)] = i, lab, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rel(a, b):
    return float((a - b).norm() / b.norm())


def reference_grad(model, step, loss_fn):
    """Gradient of one big padded batch of the step's samples, loss = mean over all target tokens."""
    model.zero_grad()
    batch = big_batch(step)
    assert int((batch["labels"][:, 1:] != -100).sum()) == step.target_tokens
    loss_fn(model, batch, step.target_tokens).backward()
    return grads(model)


@pytest.mark.parametrize("collate", ["padded", "packed"])
def test_step_gradient_equals_one_big_batch(data_path, collate):
    step = next(iter(make_loader(data_path, collate)))
    assert len(step) > 1 and len({int((mb["labels"] != -100).sum()) for mb in step}) > 1
    model = tiny_llama()
    ref = reference_grad(model, step, f64_loss)

    model.zero_grad()
    loss = step_backward(model, step, loss_fn=f64_loss)
    assert rel(grads(model), ref) < 1e-10
    with torch.no_grad():
        assert abs(float(loss) - float(f64_loss(model, big_batch(step), step.target_tokens))) < 1e-10

    # what the test guards against: each micro-batch normalized by its own tokens (the mean loss of
    # each micro-batch, averaged over the step's micro-batches, as plain gradient accumulation does)
    model.zero_grad()
    for mb in step:
        inputs = dynabatch.model_inputs(mb)
        (f64_loss(model, inputs, int((mb["labels"][:, 1:] != -100).sum())) / len(step)).backward()
    assert rel(grads(model), ref) > 1e-3

    # the default loss: the model's own, model(**inputs, num_items_in_batch=...).loss (float32 softmax)
    ref_hf = reference_grad(model, step, lambda m, b, n: m(**b, num_items_in_batch=n).loss)
    model.zero_grad()
    step_backward(model, step)
    assert rel(grads(model), ref_hf) < 1e-5


def test_placeholders_add_nothing_and_world_size_scales(data_path):
    step = next(iter(make_loader(data_path)))
    mb = step[0]
    blank = {**mb, "labels": torch.full_like(mb["labels"], -100), "is_padding": True}
    model = tiny_llama()
    alone = dynabatch.Step([mb], step=0, epoch=0, rank=0, target_tokens=step.target_tokens)
    padded = dynabatch.Step([blank, mb, blank], step=0, epoch=0, rank=0, target_tokens=step.target_tokens)
    model.zero_grad()
    step_backward(model, alone, loss_fn=f64_loss)
    g1 = grads(model)
    model.zero_grad()
    loss = step_backward(model, padded, loss_fn=f64_loss, world_size=2)
    assert rel(grads(model), 2 * g1) < 1e-12 and float(loss) > 0
    # a per-micro-batch mean is 0/0 on a placeholder: refused rather than a NaN gradient
    mean_loss = lambda m, b, n: m(**b).loss  # noqa: E731
    with pytest.raises(ValueError, match="placeholder"):
        step_backward(model, padded, loss_fn=mean_loss)


class RecordingTrainer(DynabatchTrainer):
    """Keeps the sample ids and step numbers of every step it trains."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append((inputs.step, [mb["sample_ids"].tolist() for mb in inputs]))
        return super().training_step(model, inputs, num_items_in_batch)


class Counter(transformers.TrainerCallback):
    def __init__(self, capture_first_grad=False):
        self.steps, self.epochs, self.first_grad = 0, 0, None
        self.capture = capture_first_grad

    def on_epoch_begin(self, args, state, control, **kw):
        self.epochs += 1

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if self.capture and self.first_grad is None:
            self.first_grad = grads(model).clone()

    def on_step_end(self, args, state, control, **kw):
        self.steps += 1


def train(data_path, out, model, *, callbacks=(), resume=None, **args):
    opts = dict(output_dir=str(out), per_device_train_batch_size=1, num_train_epochs=2, report_to=[],
                save_strategy="no", logging_steps=1, use_cpu=True, max_grad_norm=0.0, disable_tqdm=True,
                lr_scheduler_type="constant", learning_rate=LR)
    opts.update(args)
    trainer = RecordingTrainer(model=model, args=transformers.TrainingArguments(**opts),
                               train_loader=make_loader(data_path), callbacks=list(callbacks),
                               optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None))
    trainer.seen = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture(scope="module")
def full_run(data_path, tmp_path_factory):
    """An uninterrupted 2-epoch Trainer run (plain SGD, constant LR) and its initial model."""
    model = tiny_llama()
    initial = copy.deepcopy(model)
    counter = Counter(capture_first_grad=True)
    trainer = train(data_path, tmp_path_factory.mktemp("full"), model, callbacks=[counter],
                    include_num_input_tokens_seen="non_padding")
    return trainer, counter, initial


def test_trainer_counts_loader_steps(data_path, full_run):
    trainer, counter, _ = full_run
    loader = make_loader(data_path)
    per_epoch, tokens = [], 0
    for e in range(2):
        loader.set_epoch(e)
        n = len(loader)
        steps = list(loader)
        per_epoch.append((n, [[mb["sample_ids"].tolist() for mb in step] for step in steps]))
        tokens += sum(int(mb["attention_mask"].sum()) for step in steps for mb in step)
    assert [n for n, _ in per_epoch] == [4, 5]  # epochs differ in length: not 2 * len(loader)
    total = sum(n for n, _ in per_epoch)
    assert trainer.state.global_step == trainer.state.max_steps == counter.steps == total
    assert trainer.state.epoch == 2.0 and counter.epochs == 2
    assert [s for s, _ in trainer.seen] == list(range(total))
    assert [ids for _, ids in trainer.seen] == [ids for _, steps in per_epoch for ids in steps]
    for _, steps in per_epoch:  # every sample once per epoch
        assert sorted(i for step in steps for mb in step for i in mb) == list(range(40))
    assert trainer.state.num_input_tokens_seen == tokens and trainer.state.total_flos > 0
    losses = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert len(losses) == total and losses[-1]["epoch"] == 2.0 and losses[3]["epoch"] == 1.0


def test_trainer_gradient_and_logged_loss_are_the_big_batch_ones(data_path, full_run):
    trainer, counter, initial = full_run
    step = next(iter(make_loader(data_path)))
    hf_loss = lambda m, b, n: m(**b, num_items_in_batch=n).loss  # noqa: E731
    ref = reference_grad(initial, step, hf_loss)
    assert rel(counter.first_grad, ref) < 1e-5
    with torch.no_grad():
        mean = float(hf_loss(initial, big_batch(step), step.target_tokens))
    assert abs(trainer.state.log_history[0]["loss"] - mean) < 1e-5 * mean


def test_accelerate_loop_matches_trainer(data_path, full_run):
    trainer, _, initial = full_run
    accelerator = accelerate.Accelerator(cpu=True)
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = accelerator.prepare(model, opt)  # not the dynabatch loader: it is sharded already
    loader = make_loader(data_path)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for step in loader:
            step_backward(model, step, accelerator=accelerator)
            opt.step()
            opt.zero_grad()
    assert rel(params(model), params(trainer.model)) < 1e-12
    assert rel(params(model), params(initial)) > 1e-4  # it trained
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        step_backward(model, step, accelerator=accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2))


class StopAt(transformers.TrainerCallback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            control.should_training_stop = True


def test_resume_continues_exactly(data_path, full_run, tmp_path):
    full, _, initial = full_run
    # 6 steps = all 4 of epoch 0 and 2 of the 5 of epoch 1; checkpoint there and stop
    first = train(data_path, tmp_path, copy.deepcopy(initial), callbacks=[StopAt(6)], save_strategy="steps",
                  save_steps=6)
    ckpt = tmp_path / "checkpoint-6"
    assert (ckpt / LOADER_STATE_NAME.format(rank=0)).exists() and first.state.global_step == 6
    model = tiny_llama(seed=1)  # other weights: the checkpoint's are loaded
    counter = Counter()
    rest = train(data_path, tmp_path, model, callbacks=[counter], resume=str(ckpt), save_steps=6)
    assert [s for s, _ in rest.seen] == [6, 7, 8] and counter.steps == 3
    assert first.seen + rest.seen == full.seen  # nothing repeated, nothing skipped
    assert rest.state.global_step == 9 and rest.state.epoch == 2.0
    epochs = [h["epoch"] for h in rest.state.log_history if "loss" in h and "train_loss" not in h]
    assert np.allclose(epochs, [0.25, 0.5, 0.75, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0])  # the checkpoint's history, then ours
    assert rel(params(rest.model), params(full.model)) < 1e-12

    os.remove(ckpt / LOADER_STATE_NAME.format(rank=0))  # a checkpoint without the loader's state
    with pytest.raises(FileNotFoundError, match="no dynabatch loader state"):
        train(data_path, tmp_path, tiny_llama(), resume=str(ckpt))


def test_streaming_loader_needs_max_steps(data_path, tmp_path):
    import pyarrow.parquet as pq

    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in pq.read_table(data_path).to_pylist()))
    loader = make_loader(str(jsonl))
    assert loader.mode == "streaming"
    args = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True, logging_strategy="no")
    with pytest.raises(ValueError, match="max_steps"):
        DynabatchTrainer(model=tiny_llama(), args=transformers.TrainingArguments(**args), train_loader=loader)
    trainer = RecordingTrainer(model=tiny_llama(), args=transformers.TrainingArguments(max_steps=3, **args),
                               train_loader=loader)
    trainer.seen = []
    trainer.train()
    assert trainer.state.global_step == 3 and [s for s, _ in trainer.seen] == [0, 1, 2]


def test_refuses_gradient_accumulation_and_train_dataset(data_path, tmp_path):
    loader = make_loader(data_path)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2, use_cpu=True,
                                          report_to=[])
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        DynabatchTrainer(model=tiny_llama(), args=args, train_loader=loader)
    with pytest.raises(ValueError, match="train_loader"):
        DynabatchTrainer(model=tiny_llama(), args=args, train_loader=loader, train_dataset=[1])



def test_deepspeed_is_refused_with_the_reason(data_path, tmp_path, monkeypatch):
    """A Trainer whose accelerator runs DeepSpeed (deepspeed is not installed here: the Trainer's own
    flag is set as its accelerator setup sets it) is refused at construction, naming why and what works."""
    setup = transformers.Trainer.create_accelerator_and_postprocess

    def with_deepspeed(self):
        setup(self)
        self.is_deepspeed_enabled = True

    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", with_deepspeed)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(NotImplementedError, match="does not support DeepSpeed: its engine owns the accumulation"):
        DynabatchTrainer(model=tiny_llama(), args=args, train_loader=make_loader(data_path))
    monkeypatch.undo()
    DynabatchTrainer(model=tiny_llama(), args=args, train_loader=make_loader(data_path))  # the same, without it


def test_a_transformers_without_the_overridden_hooks_is_refused(data_path, tmp_path, monkeypatch):
    monkeypatch.delattr(transformers.Trainer, "_run_epoch")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ImportError, match="_run_epoch.*transformers>=5.0"):
        DynabatchTrainer(model=tiny_llama(), args=args, train_loader=make_loader(data_path))


def fork(fn, *args, log):
    """Start ``fn(*args)`` in a fork of this process (torch and the Trainer are imported here already; a
    fresh interpreter would import them again, ~15 s of CPU each); its pid, for `fork_result`. A
    traceback goes to the file ``log``. Nothing of pytest runs in the child: it leaves with ``os._exit``."""
    import traceback

    with open(log, "w") as f:
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 in a fresh child
                fn(*args)
                code = 0
            except BaseException:  # noqa: BLE001 - reported through the exit code and the log
                traceback.print_exc(file=f)
                f.flush()
            finally:
                os._exit(code)
    return pid


def fork_result(pid, log, cap_s=600.0):
    """The exit code (``-signal`` when killed) and log of the child ``pid`` once it ended. ``cap_s`` is
    the cap the child subprocesses had (a last resort, not a wall clock of the check)."""
    import signal
    import time

    deadline = time.monotonic() + cap_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"child {pid} still running after {cap_s:g} s")
        time.sleep(0.05)
    with open(log) as f:
        return os.waitstatus_to_exitcode(status), f.read()


def ddp_child(data_path, out, rank, port):
    """One rank of a 2-process gloo DDP Trainer run (in a fork: accelerate's process state, set here by
    the earlier single-process runs, is reset so that the Trainer reads the rank from the environment)."""
    from accelerate.state import AcceleratorState, GradientState
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    calls = []

    def f64_loss_func(outputs, labels, num_items_in_batch):
        logits = outputs.logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                               reduction="sum") / num_items_in_batch

    class Spy(transformers.TrainerCallback):
        grad = None

        def on_train_begin(self, args, state, control, **kw):
            ddp = trainer.model_wrapped
            assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
            ddp.register_comm_hook(None, lambda s, bucket: (calls.append(1), allreduce_hook(None, bucket))[1])

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            self.grad = grads(model).clone()

    spy = Spy()
    args = transformers.TrainingArguments(output_dir=out, max_steps=1, use_cpu=True, report_to=[],
                                          save_strategy="no", logging_steps=1, max_grad_norm=0.0, disable_tqdm=True)
    assert args.world_size == 2, args.world_size
    trainer = RecordingTrainer(model=tiny_llama(), args=args, callbacks=[spy], compute_loss_func=f64_loss_func,
                               train_loader=make_loader(data_path, rank=rank, world_size=2))
    trainer.seen = []
    trainer.train()
    torch.save({"grad": spy.grad, "calls": len(calls), "seen": trainer.seen, "loss": trainer.state.log_history[0]["loss"]},
               os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed (gloo)")
def test_trainer_under_ddp_two_ranks(data_path, tmp_path):
    """Two CPU processes (gloo DDP through the Trainer's accelerator): each rank trains its share of
    the global step; the all-reduced gradient is the big batch's of the whole step (the world-size
    factor), gradients are all-reduced once per step (no_sync on all but the last micro-batch)."""
    from dynabatch.pipeline.runtime import free_port

    port = free_port()
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    pids = [fork(ddp_child, data_path, str(tmp_path), r, port, log=logs[r]) for r in range(2)]  # both at once
    for code, log in [fork_result(pid, log) for pid, log in zip(pids, logs)]:
        assert code == 0, log[-3000:]
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    step = next(iter(make_loader(data_path)))  # the same global step on one rank
    mine = [sorted(i for mb in r["seen"][0][1] for i in mb) for r in res]
    assert sorted(mine[0] + mine[1]) == sorted(i for mb in step for i in mb["sample_ids"].tolist())
    assert mine[0] and mine[1] and not set(mine[0]) & set(mine[1])
    nmb = len(res[0]["seen"][0][1])
    assert nmb == len(res[1]["seen"][0][1]) > 1 and res[0]["calls"] == res[1]["calls"] == 1
    ref = reference_grad(tiny_llama(), step, f64_loss)
    for r in res:
        assert rel(r["grad"], ref) < 1e-10
    with torch.no_grad():
        mean = float(f64_loss(tiny_llama(), big_batch(step), step.target_tokens))
    assert abs(res[0]["loss"] - mean) < 1e-6 * mean


def test_streaming_run_resumes_under_the_trainer(data_path, tmp_path):
    """A streaming loader's checkpoints resume under the Trainer (issue 25.1: the state of a whole
    step was read as one step short): a chain of runs stopped at step 5 (the last step of the
    loader's epoch 0) and at step 7 (mid-epoch 1) trains exactly the steps of an unbroken run and
    ends with its weights."""
    import pyarrow.parquet as pq

    jsonl = tmp_path / "own.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in pq.read_table(data_path).to_pylist()))

    def run(out, model, resume=None, stop=None):
        args = transformers.TrainingArguments(output_dir=str(out), max_steps=12, save_strategy="steps",
                                              save_steps=1, use_cpu=True, report_to=[], disable_tqdm=True,
                                              logging_strategy="no", max_grad_norm=0.0, lr_scheduler_type="constant",
                                              learning_rate=LR)
        trainer = RecordingTrainer(model=model, args=args, train_loader=make_loader(str(jsonl)),
                                   callbacks=[StopAt(stop)] if stop else [],
                                   optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None))
        trainer.seen = []
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full", tiny_llama())
    assert full.train_loader.mode == "streaming" and [s for s, _ in full.seen] == list(range(12))
    out = tmp_path / "broken"
    first = run(out, tiny_llama(), stop=5)
    state = json.loads((out / "checkpoint-5" / LOADER_STATE_NAME.format(rank=0)).read_text())
    assert (state["mode"], state["streaming"]["epoch"]) == ("streaming", 0)  # epoch 0 holds steps 0-4
    second = run(out, tiny_llama(seed=1), resume=str(out / "checkpoint-5"), stop=7)
    state = json.loads((out / "checkpoint-7" / LOADER_STATE_NAME.format(rank=0)).read_text())
    assert state["streaming"]["epoch"] == 1 and state["streaming"]["step_in_epoch"] == 1  # mid-epoch
    rest = run(out, tiny_llama(seed=2), resume=str(out / "checkpoint-7"))
    assert [s for s, _ in second.seen] == [5, 6] and [s for s, _ in rest.seen] == list(range(7, 12))
    assert first.seen + second.seen + rest.seen == full.seen  # nothing repeated, nothing skipped
    assert rest.state.global_step == 12
    assert rel(params(rest.model), params(full.model)) < 1e-12


def kill_child(data_path, out, kill_at):
    """Train 4 steps with a checkpoint every 2 (in a fork); SIGKILL this process just before the
    kill_at-th file-system write of the save of step 4 (anything under a 'checkpoint-4' path); with
    kill_at 0, write the list of those writes to events.json."""
    import signal

    events = []
    writes_of = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR))
        else:
            path, writes = (args[0] if args else ""), event in writes_of
        if writes and "checkpoint-4" in str(path):
            events.append(f"{event} {path}")
            if len(events) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)  # this child's only: it ends with os._exit
    train(data_path, out, tiny_llama(), save_strategy="steps", save_steps=2, max_steps=4)
    with open(os.path.join(out, "events.json"), "w") as f:
        json.dump(events, f)


def test_checkpoints_are_complete_or_absent_after_a_kill(data_path, tmp_path):
    """SIGKILL at every file-system write of a checkpoint save (issue 27.6: the loader state was
    written first, so a kill left a folder without the model that get_last_checkpoint picked):
    the last checkpoint is then the previous one or the whole new one, and resuming from it ends
    with the weights of an unbroken run."""
    import signal
    import subprocess

    from transformers.trainer_utils import get_last_checkpoint

    def child(out, kill_at):
        log = f"{out}.log"
        code, text = fork_result(fork(kill_child, data_path, str(out), kill_at, log=log), log)
        return subprocess.CompletedProcess([kill_at], code, text)

    count = child(tmp_path / "count", 0)
    assert count.returncode == 0, count.stdout[-3000:]
    events = json.loads((tmp_path / "count" / "events.json").read_text())
    assert len(events) >= 4, events  # the save's folders, files and the rename
    full = train(data_path, tmp_path / "full", tiny_llama(), max_steps=6)
    for k in sorted({2, len(events) // 2, len(events) - 1, len(events)}):  # staging, mid-way, rename, after
        out = tmp_path / f"kill{k}"
        run = child(out, k)
        assert run.returncode == -signal.SIGKILL, (k, events[k - 1], run.stdout[-3000:])
        last = get_last_checkpoint(str(out))
        assert os.path.basename(last) in ("checkpoint-2", "checkpoint-4"), (k, events[k - 1], last)
        rest = train(data_path, out, tiny_llama(seed=1), resume=last, max_steps=6, save_strategy="steps", save_steps=2)
        assert [s for s, _ in rest.seen] == list(range(int(last.rsplit("-", 1)[1]), 6)), (k, events[k - 1])
        assert rel(params(rest.model), params(full.model)) < 1e-12, (k, events[k - 1])
        assert get_last_checkpoint(str(out)).endswith("checkpoint-6") and not list(out.glob("tmp-*"))
