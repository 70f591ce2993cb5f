"""``dynabatch bench gpu``: its settings, the Llama-style model every section trains, the data and a
one-stage pipeline context.

On CUDA the model is a Llama-style decoder of about 0.6 B parameters (`LLAMA_GPU`: 20 layers, hidden
1536, grouped-query attention, random weights, bf16); on a machine without CUDA a tiny one
(`LLAMA_CPU`, float32) so that every code path of the bench still runs (CPU figures say nothing about
a GPU). The model is built once per run (`ModelFactory`) and each arm trains its own copy of the
same initialization. Seconds, tokens, bytes.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.options import PlanOptions

#: what a GPU-only row says on a machine without CUDA
SKIP_NO_CUDA = "skipped: no CUDA"
#: Llama-style ~0.6 B parameters (embeddings untied, 32000-token vocabulary): the GPU run's model
LLAMA_GPU = dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=20,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096)
#: the same layout, tiny: the CPU run's model (the byte-level tokens of the bench data fit its vocabulary)
LLAMA_CPU = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


@dataclass(frozen=True)
class GpuBenchConfig:
    """One ``bench gpu`` run (tokens, seconds, bytes). `bench_config` gives the GPU, quick and CPU forms."""

    device: str  # "cuda:0" or "cpu"
    quick: bool
    llama: dict = field(default_factory=lambda: dict(LLAMA_GPU))
    global_batch_tokens: int = 32768
    max_len: int = 2048
    steps: int = 10  # training steps per method (the first `warmup` untimed)
    warmup: int = 2
    profile_rows: tuple = (1, 2, 4, 8)
    profile_lengths: tuple = (128, 256, 512, 1024, 2048)
    profile_repeats: int = 2
    cost_microbatches: int = 24  # FLAN-like micro-batches the cost model is scored on
    recompute_steps: int = 4
    recompute_fraction: float = 0.5  # device activation limit = this x dp's largest planned peak
    multimodel_steps: int = 3
    lr: float = 1e-4
    #: activation bytes one micro-batch may hold (the planner's ``memory_limit``): the device also holds every
    #: arm's weights and optimizer state, which the preset's default limit does not know of; None: the default
    microbatch_memory_bytes: float | None = 12 * 2**30
    loader_workers: int = 2  # DataLoader worker processes per training arm (tokenization off the step's path)
    seed: int = 0
    attn_implementation: str = "sdpa"  # the Hugging Face attention the model runs ("flex_attention", "eager")
    data: tuple = ()  # JSONL files; () = the shared FLAN sample where present, else generated
    generated_samples: int = 4000

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def options(self, method: str = "dp") -> PlanOptions:
        """The planning options of one arm: ``method`` on one stage, one rank, full steps only."""
        return PlanOptions(method=method, global_batch_tokens=self.global_batch_tokens, max_len=self.max_len,
                           num_stages=1, num_ranks=1, drop_last=True, seed=self.seed,
                           memory_limit=self.microbatch_memory_bytes)


def bench_config(device: str, *, quick: bool = False, data: tuple = (),
                 attn_implementation: str = "sdpa") -> GpuBenchConfig:
    """The settings for ``device``: the full GPU run (about 8 minutes on one H100), its ``quick`` form
    (about 3), or the tiny CPU run (the code path only; ``quick`` makes it tinier still); ``data`` and
    ``attn_implementation`` as `GpuBenchConfig` has them."""
    if device.startswith("cuda"):
        cfg = GpuBenchConfig(device, quick)
        if quick:
            cfg = replace(cfg, global_batch_tokens=16384, steps=4, warmup=1, profile_rows=(1, 4),
                          profile_lengths=(128, 512, 2048), profile_repeats=1, cost_microbatches=12,
                          recompute_steps=2, multimodel_steps=2)
    else:
        cfg = GpuBenchConfig(device, quick, llama=dict(LLAMA_CPU), global_batch_tokens=1024, max_len=128,
                             steps=3, warmup=1, profile_rows=(1, 8), profile_lengths=(32, 128), profile_repeats=1,
                             cost_microbatches=4, recompute_steps=2, multimodel_steps=2, lr=1e-3, loader_workers=0,
                             microbatch_memory_bytes=None,
                             generated_samples=300)
        if quick:
            cfg = replace(cfg, steps=2, generated_samples=120, global_batch_tokens=768)
    return replace(cfg, data=tuple(data), attn_implementation=attn_implementation)


def bench_loader(cfg: GpuBenchConfig, data, index: str, cost, *, options: PlanOptions | None = None,
                 num_workers: int = 0):
    """The one `dynabatch.DataLoader` form every section reads the bench data with: indexed mode over
    the length ``index`` (`prepare_data`), one rank, planned with the cost model ``cost`` and
    ``options`` (default: ``dp`` on one stage, `GpuBenchConfig.options`); ``num_workers`` tokenizing
    worker processes (0: in this process). Close it after use."""
    import dynabatch

    return dynabatch.DataLoader(list(data), options=options or cfg.options("dp"), num_workers=num_workers,
                                source=dynabatch.DataSource(index=index, mode="indexed"),
                                costing=dynabatch.Costing(cost_model=cost),
                                runtime=dynabatch.Runtime(world_size=1, rank=0))


def prepare_data(cfg: GpuBenchConfig, tmp: str) -> tuple[tuple, str]:
    """(data files, length index path): ``cfg.data``, else the shared FLAN sample on a GPU run, else
    generated FLAN-like records (`dynabatch.datagen`); the index built once for every arm."""
    from ..datagen import write_text_shards
    from .train import TrainBenchConfig, build_data, default_data

    data = tuple(cfg.data) or (default_data() if cfg.cuda else ())
    if not data:  # generated here: build_data would take the shared sample where present, also on CPU
        data = tuple(str(p) for p in write_text_shards(Path(tmp) / "data", cfg.generated_samples, seed=cfg.seed))
    opts = cfg.options().replace(num_stages=1)
    got = build_data(TrainBenchConfig(model="gpt-tiny", data=data, options=opts), tmp, cfg.generated_samples)
    return tuple(got.data), got.index


class ModelFactory:
    """The bench's Hugging Face Llama model, built once (seeded, random weights) on the device;
    `fresh` gives an independent `dynabatch.pipeline.models.hf.HFLayeredModel` copy of that initialization."""

    def __init__(self, cfg: GpuBenchConfig):
        import torch
        from transformers import LlamaConfig

        from ..pipeline.models.hf import build_model

        config = LlamaConfig(**cfg.llama)
        config._attn_implementation = cfg.attn_implementation  # sdpa by default: no flash-attn package assumed
        self.dtype = torch.bfloat16 if cfg.cuda else torch.float32
        torch.manual_seed(cfg.seed)
        with torch.device(cfg.device):  # initialized where it trains (0.6 B random draws are slow on a CPU)
            self.base = build_model(config, empty=False, dtype=self.dtype)
        self.attn_implementation = config._attn_implementation
        self.parameters = sum(p.numel() for p in self.base.parameters())

    def fresh(self):
        """A new `HFLayeredModel` with the same initial weights (its own parameters)."""
        from ..pipeline.models.hf import adapt

        return adapt(copy.deepcopy(self.base))


@contextlib.contextmanager
def one_stage(device: str):
    """A one-stage, one-rank `dynabatch.pipeline.runtime.DistContext` in this process (NCCL on CUDA, gloo on CPU)."""
    from ..pipeline import init_pipeline
    from ..pipeline.runtime import free_port

    os.environ.setdefault("LOCAL_RANK", "0")
    with init_pipeline(num_stages=1, rank=0, world_size=1, master_port=free_port(), device=device,
                       backend="nccl" if device.startswith("cuda") else "gloo") as ctx:
        yield ctx


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA), so that host clocks measure it."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def real_tokens(mbs) -> int:
    """Unpadded tokens of a loader step (its micro-batches' ``real_tokens``)."""
    return int(sum(int(b["real_tokens"]) for b in mbs))
