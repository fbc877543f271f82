"""Attention with each query row's log-sum-exp (`attention_with_lse`), as torch functions of tensors: the
flash kernels torch ships where they apply, else its torch reference (`attention_with_lse_reference`).
Partial attentions over disjoint keys are merged by their log-sum-exp (`evalkit.reconstruction_ops`), and
a fresh prompt's statistics are worked out from it in a second pass (`evalkit.attention_ops`).
"""

from __future__ import annotations

import torch

_ELEMENTS_PER_BLOCK = 1 << 23  # the reference's query block: 32 MiB of float32 scores, as attention_ops' blocks


def attention_with_lse(q, k, v, scaling, allowed=None, causal=False):
    """Attention of q [B, H_q, T, D] over k, v [B, H_kv, N, D] with each row's log-sum-exp: out [B, H_q, T, D],
    lse [B, H_q, T] (natural log; -inf, with out 0, for a row that sees no key). `allowed`: bool
    [B, H_kv or 1, T or 1, N], the keys each query may read (None: all); `causal`: query i reads keys 0..i
    (T == N). On a CPU the flash kernel SDPA itself runs (query head h reads KV head h // G, no copy; a bool
    mask as the additive one SDPA makes: the same bits as SDPA); on CUDA a causal unmasked prompt takes the
    flash kernel in half precision, else the memory-efficient one, K and V repeated per query head;
    anything else `attention_with_lse_reference`."""
    if q.device.type == "cpu":
        mask = None
        if allowed is not None:  # a KV head's row for each of its query heads
            allowed = allowed.repeat_interleave(q.shape[1] // allowed.shape[1], 1) if allowed.shape[1] > 1 else allowed
            mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                              scale=scaling)[:2]
        if allowed is not None:  # the kernel gives a row that sees nothing lse 0; no key means -inf
            lse = lse.masked_fill(~allowed.any(-1), float("-inf"))
        return out, lse
    if allowed is not None or not causal:
        return attention_with_lse_reference(q, k, v, scaling, allowed, causal)
    G = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(G, dim=1) if G > 1 else x for x in (k, v))
    if q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scaling)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True,
                                                                          scale=scaling)[:2]
    return out, lse[..., :q.shape[2]].float()


def attention_with_lse_reference(q, k, v, scaling, allowed=None, causal=False):
    """`attention_with_lse` in plain torch: a softmax per query block, K and V never repeated."""
    B, H_q, T, D = q.shape
    H_kv, N = k.shape[1], k.shape[2]
    G = H_q // H_kv
    if causal:
        allowed = torch.ones(T, N, dtype=torch.bool, device=q.device).tril()[None, None]
    out = torch.zeros(B, H_kv, G, T, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H_kv, G, T, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    q = q.view(B, H_kv, G, T, D)
    block = max(1, _ELEMENTS_PER_BLOCK // max(1, B * H_q * N))
    for start in range(0, T, block):
        rows = slice(start, min(T, start + block))
        t = rows.stop - rows.start
        scores = torch.matmul(q[:, :, :, rows].reshape(B, H_kv, G * t, D), k.transpose(-1, -2))
        scores = scores.view(B, H_kv, G, t, N).to(lse.dtype) * scaling
        if allowed is not None:
            seen = allowed[:, :, rows] if allowed.shape[2] > 1 else allowed
            scores = scores.masked_fill(~seen[:, :, None], float("-inf"))
        lse[:, :, :, rows] = scores.logsumexp(-1)
        probs = (scores - lse[:, :, :, rows, None]).exp().nan_to_num(0.0)  # a row that sees nothing: zeros
        out[:, :, :, rows] = torch.matmul(probs.to(v.dtype).view(B, H_kv, G * t, N), v).view(B, H_kv, G, t, D)
    return out.view(B, H_q, T, D), lse.view(B, H_q, T)
