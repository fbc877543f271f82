"""Where the kernels run: compiled on CUDA, or through Triton's interpreter on a CPU.

The interpreter is chosen by TRITON_INTERPRET=1, which Triton reads when it is imported, so this
module is the one place evalkit imports triton from.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs keep float32 products (TF32 would cost the 1e-3 accuracy); 16-bit ones use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


__all__ = ["INTERPRETED", "dot_precision", "tl", "triton"]
