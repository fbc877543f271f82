"""Triton kernels for attention over the per-head paged cache; each file holds kernel, launcher and reference.

`use_triton` decides per call: "auto" runs them on CUDA tensors and the torch reference elsewhere,
"triton" forces them (on a CPU only through Triton's interpreter, TRITON_INTERPRET=1), "torch" never.
Triton itself is imported only when a kernel runs.
"""

from __future__ import annotations

import os

import torch

from evalkit.errors import EvalkitError

KERNEL_MODES = ("auto", "triton", "torch")


def use_triton(mode: str, tensor: torch.Tensor) -> bool:
    if mode == "torch":
        return False
    if mode == "auto":
        return tensor.is_cuda
    if mode == "triton":
        if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise EvalkitError("kernels=triton on a CPU needs Triton's interpreter: set TRITON_INTERPRET=1")
        return True
    raise EvalkitError(f"unknown kernels mode {mode!r}; choose from {', '.join(KERNEL_MODES)}")
