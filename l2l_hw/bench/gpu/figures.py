"""The GPU campaign's figures of merit: model FLOPs, the part's dense bf16 peak, spreads.

Model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B, with causal attention
counted as a causal model computes it):

    6 N  +  6 L H Q T      (causal: the default)
    6 N  + 12 L H Q T      (causal=False: the whole T x T score matrix, PaLM's count)

N: the parameters that take part in matrix products: every weight but the input
embedding tables (a lookup: the token and position tables), so the LM head counts.
6 N: 2 N multiply-adds forward, 4 N backward (activation and weight gradients).
Attention's two products, Q K^T and the scores times V, over the whole T x T score matrix are
2 T H Q FLOPs each per token and layer forward, x3 with the backward: 12 L H Q T; L layers,
H query heads of width Q (H Q is the model width, also with grouped KV heads, which share K
and V but not the products), T the context. A causal model's token t attends to t + 1
positions, T / 2 on average, and a causal kernel (flash attention) computes only those: half,
6 L H Q T. The campaign counts the half, the work done, so that no MFU is flattered by the
masked half (the published convention counts the whole; a test checks the whole against
torch's FlopCounterMode on the math kernel, which computes the whole matrix, and the half
as that less the masked half). Recomputation (activation checkpointing) is not counted: MFU
is model FLOPs per second over a peak, whatever a method spends on recompute.

Peaks: the measured bf16 matmul (8192^3, l2l bench gpu's matmul_peak: the best of its runs,
with their spread) and the part's dense bf16 figure from NVIDIA's datasheets
(DENSE_BF16_TFLOPS). An MFU is given against each.
"""
from __future__ import annotations

import statistics

# Dense bf16 tensor-core TFLOP/s by device name (torch.cuda.get_device_name), the datasheets'
# figures "with sparsity" halved: NVIDIA H100 Tensor Core GPU datasheet (SXM 1,979 / PCIe 1,513 /
# NVL 1,671 TFLOPS bf16 with sparsity) and NVIDIA H200 datasheet (SXM 1,979 / NVL 1,671). The
# first name contained in the device's name wins, so the longer names come first.
DENSE_BF16_TFLOPS = (
    ("H200 NVL", 835.5, "NVIDIA H200 datasheet, H200 NVL: 1,671 TFLOPS bf16 with sparsity, halved"),
    ("H200", 989.4, "NVIDIA H200 datasheet, H200 SXM: 1,979 TFLOPS bf16 with sparsity, halved"),
    ("H100 NVL", 835.5, "NVIDIA H100 datasheet, H100 NVL: 1,671 TFLOPS bf16 with sparsity, halved"),
    ("H100 PCIe", 756.0, "NVIDIA H100 datasheet, H100 PCIe: 1,513 TFLOPS bf16 with sparsity, halved"),
    ("H100", 989.4, "NVIDIA H100 datasheet, H100 SXM (80GB HBM3): 1,979 TFLOPS bf16 with sparsity, halved"),
    ("A100", 312.0, "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense"),
)


def dense_bf16_peak(device_name: str) -> dict:
    """{"tflops", "source"} of the part's dense bf16 figure; tflops None for a part not in the table."""
    for name, tflops, source in DENSE_BF16_TFLOPS:
        if name in device_name:
            return {"tflops": tflops, "source": source}
    return {"tflops": None, "source": f"{device_name!r} is not in l2l_hw/bench/gpu/figures.py's DENSE_BF16_TFLOPS"}


ATTENTION = "causal: half of the full T x T score matrix, 6 L H Q T a token (gpu/figures.py)"


def flops_per_token(matmul_params: int, layers: int, width: int, context: int, causal: bool = True) -> float:
    """Model FLOPs per trained token, 6 N + 6 L H Q T causal, 12 L H Q T over the whole matrix
    (module docstring; H Q = width)."""
    return 6 * matmul_params + (6 if causal else 12) * layers * width * context


def spread(values) -> dict:
    """min / median / max of a figure's runs (and how many there were)."""
    values = list(values)
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "runs": len(values)}


def rate_spread(amount: float, seconds) -> dict:
    """The spread of amount / seconds over runs: min from the slowest run, max from the fastest."""
    return spread(amount / s for s in seconds)


def mfu(tokens_per_s: float, per_token: float, measured_peak: float | None, dense_peak: float | None) -> dict:
    """Achieved TFLOP/s and the MFU against each peak (FLOP/s; None where a peak is unknown)."""
    achieved = tokens_per_s * per_token
    return {"tflops": achieved / 1e12,
            "mfu_measured_peak": achieved / measured_peak if measured_peak else None,
            "mfu_dense_peak": achieved / dense_peak if dense_peak else None}


def fmt_spread(s: dict, unit: str = "", digits: int = 0) -> str:
    """'74,450 tokens/s [73,900 - 75,010, 3 runs]'"""
    f = f"{{:,.{digits}f}}"
    return f"{f.format(s['median'])}{unit} [{f.format(s['min'])} - {f.format(s['max'])}, {s['runs']} runs]"
