"""``dynabatch bench gpu``, environment section: the device, the software versions and which attention
kernels run here, each probed by one small forward+backward call and reported as ``works`` or
``fails: <reason>`` (never assumed from the versions).

Probed kernels (on the bench's device; bf16 on CUDA, float32 on CPU):

* each ``torch.nn.attention.SDPBackend`` forced alone with ``torch.nn.attention.sdpa_kernel``
  (math, flash, memory-efficient, cuDNN), causal, 2 x 4 heads x 256 tokens (64 on CPU) x 64;
* flex attention (``torch.nn.attention.flex_attention``) with a block-diagonal causal ``BlockMask``
  of two packed samples, compiled with ``torch.compile`` on CUDA (what makes it fast), eager on CPU;
* torch's varlen attention (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10) on two packed
  samples given by ``cu_seqlens``, where the module exists.
"""

from __future__ import annotations

import platform
import sys
import time

from .gpu_setup import SKIP_NO_CUDA

#: (heads, tokens, head dim) of the probe tensors
PROBE_HEADS, PROBE_TOKENS, PROBE_DIM = 4, 256, 64


def _reason(e: BaseException) -> str:
    """A one-line reason from an exception (its type and the first line of its message, <= 200 chars)."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"fails: {type(e).__name__}: {first}"[:200]


def environment(device: str) -> dict:
    """Device, memory (bytes) and versions (torch, CUDA, cuDNN, transformers, Python) of this process."""
    import numpy as np
    import torch

    info = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "cuda": torch.version.cuda, "platform": platform.platform()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError as e:
        info["transformers"] = _reason(e)
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), gpu_memory_bytes=int(props.total_memory),
                    multiprocessors=int(props.multi_processor_count), capability=f"{props.major}.{props.minor}",
                    cudnn=torch.backends.cudnn.version())
    else:
        info["gpu"] = SKIP_NO_CUDA
    return info


def _tokens(device: str) -> int:
    """Probe length: `PROBE_TOKENS` on CUDA, a quarter of it on CPU (the code path, not the speed)."""
    return PROBE_TOKENS if device.startswith("cuda") else PROBE_TOKENS // 4


def _qkv(device: str, dtype, batch: int = 2):
    import torch

    tokens = _tokens(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn(batch, PROBE_HEADS, tokens, PROBE_DIM, generator=g).to(device, dtype).requires_grad_()
            for _ in range(3)]


def _run(fn) -> tuple[str, float | None]:
    """(``works`` or ``fails: ...``, seconds of the call after one warm-up) of ``fn`` (forward+backward)."""
    import torch

    try:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return "works", time.perf_counter() - t0
    except Exception as e:  # a kernel that cannot run here is the result, not an error of the bench
        return _reason(e), None


def _sdpa(backend, device, dtype):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def fn():
        q, k, v = _qkv(device, dtype)
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return fn


def _flex(device, dtype):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = _tokens(device)
    half = n // 2
    doc = (torch.arange(n, device=device) >= half).int()  # two packed samples of `half` tokens

    def causal_in_doc(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    attn = torch.compile(flex_attention) if device.startswith("cuda") else flex_attention

    def fn():
        q, k, v = _qkv(device, dtype, batch=1)
        mask = create_block_mask(causal_in_doc, None, None, n, n, device=device)
        attn(q, k, v, block_mask=mask).sum().backward()
    return fn


def _varlen(device, dtype):
    import torch
    from torch.nn.attention.varlen import varlen_attn

    n = _tokens(device)
    half = n // 2
    cu = torch.tensor([0, half, n], dtype=torch.int32, device=device)

    def fn():  # [tokens, heads, dim]: the packed layout
        q, k, v = (t[0].transpose(0, 1).contiguous().detach().requires_grad_() for t in _qkv(device, dtype, batch=1))
        varlen_attn(q, k, v, cu, cu, half, half).sum().backward()
    return fn


def attention_kernels(device: str) -> dict:
    """``{kernel: {"status": "works" | "fails: ...", "seconds": float | None}}`` for every SDPA backend,
    flex attention and torch's varlen attention on ``device`` (module docstring)."""
    import torch
    from torch.nn.attention import SDPBackend

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    probes = {}
    for name in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        probes[f"sdpa_{name.lower()}"] = (lambda b=backend: _sdpa(b, device, dtype)) if backend is not None else None
    probes["flex_attention"] = lambda: _flex(device, dtype)
    probes["varlen_attn"] = lambda: _varlen(device, dtype)
    out = {}
    for name, make in probes.items():
        if make is None:
            out[name] = {"status": f"fails: torch {torch.__version__} has no such SDPA backend", "seconds": None}
            continue
        try:
            fn = make()
        except ImportError as e:  # the module is not in this torch
            out[name] = {"status": _reason(e), "seconds": None}
            continue
        status, secs = _run(fn)
        out[name] = {"status": status, "seconds": secs}
    return out


def environment_section(device: str) -> dict:
    """The environment section's result: `environment` plus ``attention`` (`attention_kernels`)."""
    return {**environment(device), "attention": attention_kernels(device), "argv": sys.argv[1:]}
