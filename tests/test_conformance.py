"""The conformance matrix of the data-parallel routes: every supported Hugging Face family, on every route a
user trains on in one process, with padded and packed micro-batches from a real `DataLoader`, against the
plain model's own logits (`conformance_ref.reference_step`: summed token cross-entropy written in the test,
divided by the step's target tokens, decoder inputs built from the config's ``decoder_start_token_id``).

Routes: ``plain`` (a hand loop: ``model(**model_inputs(mb)).logits``, the test's cross-entropy / ``step.
target_tokens``), ``step_backward`` (the default `model_loss`), ``accelerate`` (``Accelerator`` +
`step_backward`) and ``trainer`` (`DynabatchTrainer`, the gradient read before its optimizer step). The
pipeline routes (1-3 stages, every schedule) are tests/test_pipeline_hf_dist.py's matrix, against the same
kind of reference.

Tolerances (relative; float64 models): loss and every gradient within 1e-5. Float32 enters float64 models
in places: Hugging Face's causal-LM loss upcasts to float32 only, and Gemma's RMSNorm computes in float32,
so padding to another length rounds differently (measured gaps: <= 2e-7 loss, <= 3e-8 gradients). The wrong
routes this catches are off by factors (summed per-micro-batch means: 6x). One float32 cell (Llama) at 1e-4. Packed encoder-decoder micro-batches have no Hugging Face path (T5 and BART attend
across a packed row): the routes refuse them by name, which is checked too.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conformance_ref import grads_of, reference_step, relative_gap, summed_ce  # noqa: E402
from hf_tiny import bart_config, build, decoder_config, llava_config, t5_config  # noqa: E402

import dynabatch  # noqa: E402
from dynabatch import Costing, DataLoader, PlanOptions, Tokenization  # noqa: E402
from dynabatch.integrations import DynabatchTrainer, step_backward  # noqa: E402
from dynabatch.loader.collate import model_inputs  # noqa: E402

V = 260  # the bytes tokenizer's 259 ids and LLaVA's image placeholder 259
FAMILIES = ["llama", "llama-tied", "mistral", "qwen2", "gemma", "gemma2", "phi3", "t5", "bart", "llava"]
SEQ2SEQ = ("t5", "bart")
RTOL64, RTOL_F32 = 1e-5, 1e-4


def config_of(family: str):
    if family == "t5":
        return t5_config(vocab_size=V, decoder_start_token_id=0)
    if family == "bart":  # BART-style: pad 1, decoder start 2 (not the pad id)
        return bart_config(vocab_size=V)
    if family == "llava":
        cfg = llava_config(image_token_id=V - 1)
        cfg.text_config.vocab_size = V
        return cfg
    if family == "llama-tied":
        return decoder_config("llama", vocab_size=V, tie_word_embeddings=True)
    return decoder_config(family, vocab_size=V)


def _records(family: str, n: int = 24) -> list[dict]:
    rng = np.random.default_rng(3)
    if family == "llava":
        from dynabatch import datagen

        imgs = [{"bytes": data, "path": None} for _, _, data, _ in datagen.image_text_samples(6, seed=0)]
        rows = [{"inputs": f"describe {i}", "targets": "shapes " * (1 + i % 3), "image": imgs[i]} for i in range(6)]
        rows += [{"inputs": f"say {i}", "targets": "w " * (i + 1), "image": None} for i in range(6)]
        return rows
    rows = []
    for i in range(n):
        body = "".join(rng.choice(list("abcdefgh "), int(rng.integers(3, 40))))
        rows.append({"inputs": f"q{i} {body}", "targets": "y" * int(rng.integers(1, 10))})
    return rows


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Every family saved with ``save_pretrained`` (float64, seed 1): what a user's folder looks like."""
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(family.replace("-", "_"))
        build(config_of(family), seed=1).save_pretrained(d)
        out[family] = d
    return out


def _loader(folder, family: str, collate: str) -> DataLoader:
    """The user's loader: the model folder names the model (family, decoder start, vision, vocabulary)."""
    return DataLoader(_records(family), options=PlanOptions(global_batch_tokens=500 if family != "llava" else 900,
                                                            max_len=128, num_stages=2, shuffle=False),
                      tokenization=Tokenization(model=str(folder)),
                      costing=Costing(cost_model="gpt", device="cpu", collate=collate))


@functools.lru_cache(maxsize=None)
def _step(folder, family: str, collate: str):
    """The step with the most micro-batches of the family's data (one per family and collation: every route
    reads the same step, which none of them changes)."""
    loader = _loader(folder, family, collate)
    step = max((s for s in loader), key=len)  # the step with the most micro-batches
    loader.close()
    assert len(step) >= 2, "the matrix needs a step of several micro-batches"
    return step


def _model(folder, dtype=torch.float64):
    from dynabatch.pipeline.models.hf.build import model_class

    cfg = transformers.AutoConfig.from_pretrained(folder)
    return model_class(cfg).from_pretrained(folder, dtype=dtype).train()


def _pixels(mb: dict) -> dict:
    return {"pixel_values": mb["pixel_values"]} if "pixel_values" in mb and mb["image_tiles"].sum() else {}


@functools.lru_cache(maxsize=None)
def _step_reference(folder, family: str, collate: str, dtype=torch.float64):
    """`_reference` of `_step`'s step, computed once per family, collation and dtype."""
    return _reference(folder, family, _step(folder, family, collate), dtype)


def _reference(folder, family: str, step, dtype=torch.float64):
    ref = _model(folder, dtype)
    loss, tokens = reference_step(ref, step, extra=_pixels if family == "llava" else None)
    assert tokens == step.target_tokens, (tokens, step.target_tokens)
    return loss, grads_of(ref)


def _plain(model, step, family):
    """A hand loop: the model's logits on model_inputs(mb), the test's cross-entropy / step.target_tokens."""
    total = 0.0
    seq2seq = family in SEQ2SEQ
    for mb in step:
        inputs = {k: v for k, v in model_inputs(mb).items() if k != "labels"}
        s, _ = summed_ce(model(**inputs).logits, mb["labels"], shift=not seq2seq)
        loss = s / step.target_tokens
        loss.backward()
        total += float(loss.detach())
    return total


def _trainer(model, step, loader_folder, family, collate, tmp_path):
    """One DynabatchTrainer step on the loader's first step; the gradients read just before the optimizer."""
    seen = {}

    class Grab(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            seen["grads"] = grads_of(model)

    loader = _loader(loader_folder, family, collate)
    first = next(iter(loader))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, learning_rate=0.0, report_to=[],
                                          save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True,
                                          max_grad_norm=0.0)  # the raw gradient, not clipped
    trainer = DynabatchTrainer(model=model, args=args, train_loader=loader, callbacks=[Grab()])
    out = trainer.train()
    loader.close()
    return first, out.training_loss, seen["grads"]


ROUTES = ["plain", "step_backward", "accelerate", "trainer"]
# every family on the plain loop and step_backward, padded and packed (packed encoder-decoder: refused; LLaVA
# takes padded rows). accelerate and the Trainer add their own wrapping around step_backward's loss (prepare,
# backward, no_sync; compute_loss, the Trainer's step): one family of each loss kind (Llama: the model's own,
# T5: from the logits) and, for the Trainer, LLaVA (pixel values through _prepare_inputs). Dropped as adding
# no coverage: BART and LLaVA under accelerate, BART and packed Llama under the Trainer (the same loss route
# and collation as cells kept).
CELLS = ([(f, r, c) for f in FAMILIES for r in ("plain", "step_backward") for c in ("padded", "packed")
          if not (f == "llava" and c == "packed")]
         + [(f, "accelerate", "padded") for f in ("llama", "t5")]
         + [(f, "trainer", "padded") for f in ("llama", "t5", "llava")])


@pytest.mark.parametrize("family,route,collate", CELLS, ids=["-".join(c) for c in CELLS])
def test_route_equals_the_plain_model(folders, family, route, collate, tmp_path):
    """Loss and every gradient of one step on the route equal the independent reference."""
    folder = folders[family]
    if family in SEQ2SEQ and collate == "packed":
        step = _step(folder, family, collate)
        model = _model(folder)
        if route == "plain":
            pytest.skip("a hand loop over packed encoder-decoder rows is the user's own choice; "
                        "the library's routes refuse it (step_backward cell)")
        with pytest.raises(ValueError, match="encoder-decoder and this micro-batch is packed"):
            step_backward(model, step)
        return
    model = _model(folder)
    if route == "trainer":
        step, loss, grads = _trainer(model, None, folder, family, collate, tmp_path)
    else:
        step = _step(folder, family, collate)
        if route == "plain":
            loss = _plain(model, step, family)
        elif route == "step_backward":
            loss = float(step_backward(model, step))
        else:
            from accelerate import Accelerator

            acc = Accelerator(cpu=True)
            prepared = acc.prepare(model)
            loss = float(step_backward(prepared, step, accelerator=acc))
        grads = grads_of(model)
    ref_loss, ref_grads = (_reference(folder, family, step) if route == "trainer"
                           else _step_reference(folder, family, collate))
    gap = relative_gap(grads, ref_grads)
    print(f"conformance {family} {route} {collate}: loss gap {abs(loss - ref_loss) / ref_loss:.1e} grad gap {gap:.1e}")
    assert loss == pytest.approx(ref_loss, rel=RTOL64), (loss, ref_loss)
    assert gap <= RTOL64, gap


def test_float32_llama_packed_step_backward(folders):
    """A float32 model: the same check at the float32 tolerance."""
    step = _step(folders["llama"], "llama", "packed")
    model = _model(folders["llama"], torch.float32)
    loss = float(step_backward(model, step))
    ref_loss, ref_grads = _reference(folders["llama"], "llama", step, torch.float32)
    assert loss == pytest.approx(ref_loss, rel=RTOL_F32)
    assert relative_gap(grads_of(model), ref_grads) <= RTOL_F32


def test_both_loss_kinds_are_decided_by_behaviour_not_by_name(folders):
    """The loss route is read off the model: a causal LM honours num_items_in_batch (its own loss is used),
    T5 and BART return a per-micro-batch mean (the loss comes from their logits); a model that says
    ``accepts_loss_kwargs`` is believed; a loss that is neither is an error asking for loss_fn."""
    from dynabatch.integrations import loss_route

    for family, want in [("llama", "model"), ("t5", "logits"), ("bart", "logits")]:
        step = _step(folders[family], family, "padded")
        model = _model(folders[family])
        assert loss_route(model) is None
        step_backward(model, step)
        assert loss_route(model) == want, family
    model = _model(folders["t5"])
    model.accepts_loss_kwargs = False
    assert loss_route(model) == "logits"

    class Smoothed(torch.nn.Module):  # a loss of its own: twice the honest one
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, **kw):
            out = self.inner(**kw)
            out.loss = out.loss * 2
            return out

    step = _step(folders["llama"], "llama", "padded")
    with pytest.raises(ValueError, match="neither its summed token cross-entropy"):
        step_backward(Smoothed(_model(folders["llama"])), step)


def test_the_loss_does_not_depend_on_how_a_step_is_split(folders):
    """The T5 step of several micro-batches gives the loss of one micro-batch of all its samples (the summed
    means of the old route were ~6x too large)."""
    step = _step(folders["t5"], "t5", "padded")
    merged = dynabatch.loader.step.Step([_merge(step)], step=0, epoch=0, rank=0, target_tokens=step.target_tokens)
    a = float(step_backward(_model(folders["t5"]), step))
    b = float(step_backward(_model(folders["t5"]), merged))
    assert a == pytest.approx(b, rel=1e-9)


def _merge(step) -> dict:
    rows = [mb for mb in step if not mb.get("is_padding")]
    width = {k: max(mb[k].shape[1] for mb in rows) for k in ("input_ids", "decoder_input_ids")}
    out = {}
    for k, fill in [("input_ids", 0), ("attention_mask", 0), ("labels", -100), ("decoder_input_ids", 0),
                    ("decoder_attention_mask", 0)]:
        w = width["decoder_input_ids" if k.startswith("decoder") or k == "labels" else "input_ids"]
        out[k] = torch.cat([torch.nn.functional.pad(mb[k], (0, w - mb[k].shape[1]), value=fill) for mb in rows])
    return out
