"""Tile sizes of the fused selective log-softmax kernels (``logprobs_triton``): block sizes, warps and stages per
kernel and operand dtype on CUDA, the interpreter's small tiles, and the width of the backward's vocabulary chunks.
Imports neither the kernels nor their launchers.
"""

from __future__ import annotations

import torch
import triton

__all__ = ["CUDA_CONFIGS", "CHUNK_V_MIN", "SHIPPED_CONFIGS", "SLS_CUDA_CONFIG"]

# Shipped block sizes on CUDA, per kernel and operand dtype (bf16 and fp16 share tiles; fp32 operands use 3xTF32
# dots and smaller tiles). Chosen on the builds that run (runtime divisibility attributes, sm_80 and sm_90): no spills,
# checked by tests/ops/test_logprobs_triton_aot.py, whose printout is docs/kernels.md's resource table. Not timed (no GPU here):
# the bf16 choices rest on registers and shared memory per SM (65536 registers; 163 / 227 KB shared on sm_80 / sm_90).
# fwd (64 x 128 x 32, 2 stages) sits at 127-128 registers, the limit for 2 CTAs of 8 warps per SM: BLOCK_H=64 or a
# third stage gives 141-174 (one CTA), so it keeps its tile. The d_logits kernel stays at 128 registers with BLOCK_H=64
# and 3 stages (half the K iterations, a deeper pipeline, 2 CTAs still fit in shared memory). The d_hidden GEMM needs
# 186-196 registers (one CTA per SM either way), so it takes a 4th stage into the otherwise idle shared memory; the
# d_weight GEMM keeps 3 stages, which lets 2 CTAs per SM share sm_90's shared memory at its 107 registers.
# 128 x 256 output tiles (Triton's H100 matmul tile) build without spills too (202-246 registers) but were not taken
# untimed. GROUP: output-tile grouping of the launch order (L2 reuse of operand panels). The CPU interpreter uses
# small tiles (tl.dot needs every dimension >= 16) and narrow vocabulary chunks, so that the test shapes cross every
# block and chunk boundary.
CUDA_CONFIGS = {
    "lowp": {
        "linear_logprobs_fwd": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=32, num_warps=8, num_stages=2),
        "linear_logprobs_bwd_dlogits": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, GROUP=8, num_warps=8, num_stages=3),
        "linear_logprobs_bwd_dh": dict(BLOCK_N=128, BLOCK_V=64, BLOCK_H=128, GROUP=8, num_warps=8, num_stages=4),
        "linear_logprobs_bwd_dw": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=128, GROUP=8, num_warps=8, num_stages=3),
    },
    "fp32": {
        "linear_logprobs_fwd": dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=16, num_warps=4, num_stages=2),
        "linear_logprobs_bwd_dlogits": dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=16, GROUP=8, num_warps=4, num_stages=2),
        "linear_logprobs_bwd_dh": dict(BLOCK_N=64, BLOCK_V=32, BLOCK_H=64, GROUP=8, num_warps=4, num_stages=2),
        "linear_logprobs_bwd_dw": dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=64, GROUP=8, num_warps=4, num_stages=2),
    },
}


INTERPRET_CONFIG = dict(BLOCK_N=32, BLOCK_V=64, BLOCK_H=32, GROUP=2, num_warps=4, num_stages=1)


# Vocabulary chunks of the backward (columns of the (N, chunk) d_logits buffer): on CUDA, V is cut into the fewest equal
# chunks (multiples of 64 columns) no wider than max(V * H / N, CHUNK_V_MIN) + 63: the buffer about the size of the
# weight at most, and at least CHUNK_V_MIN wide so that the fp32 d_hidden accumulator, read and written once per chunk
# (8 * N * H bytes), stays small against the chunk's GEMMs (6 * N * chunk * H FLOP): at 4096 that is 8 / (6 * 4096) =
# 3.3e-4 B/FLOP, about 1/10 of an H100's 3.35 TB/s / 989 TFLOP/s = 3.4e-3. Equal chunks: a narrow remainder chunk
# would launch too few d_weight programs (each reducing over all N rows), e.g. 112 for a 512-column remainder at
# N = 131072.
CHUNK_V_MIN = 4096


INTERPRET_CHUNK_V = 128


SLS_CUDA_CONFIG = dict(BLOCK_V=2048, num_warps=8, num_stages=1)


SLS_INTERPRET_CONFIG = dict(BLOCK_V=128, num_warps=4, num_stages=1)


def _config(device: torch.device, dtype: torch.dtype, name: str) -> dict:
    """Launch configuration of head kernel ``name`` (a key of ``logprobs_triton.KERNELS``) for operands of ``dtype``
    on ``device``."""
    if device.type != "cuda":
        return dict(INTERPRET_CONFIG)
    return dict(CUDA_CONFIGS["fp32" if dtype == torch.float32 else "lowp"][name])


def _vocab_chunk(n_tok: int, vocab: int, hid: int, device: torch.device) -> int:
    """Width of the backward's vocabulary chunks (see CHUNK_V_MIN); the last chunk may be narrower."""
    if device.type != "cuda":
        return INTERPRET_CHUNK_V
    widest = max(vocab * hid // max(n_tok, 1), CHUNK_V_MIN)
    return triton.cdiv(triton.cdiv(vocab, triton.cdiv(vocab, widest)), 64) * 64


SHIPPED_CONFIGS = {
    (name, dtype): (
        dict(SLS_CUDA_CONFIG)
        if name.startswith("selective")
        else dict(CUDA_CONFIGS["fp32" if dtype == torch.float32 else "lowp"][name])
    )
    for name in (*CUDA_CONFIGS["lowp"], "selective_log_softmax_fwd", "selective_log_softmax_bwd")
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
}
