"""Compile, check and time every Triton kernel against a baseline measured in the same run.

    python scripts/bench_kernels.py            # on a GPU: correctness at small sizes, then timings
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --check-only   # on a CPU: correctness only

Shapes are Llama-3.1-8B's (32 query heads, 8 KV heads, head dim 128, bf16, block size 16). Decode:
a paged cache keeping `budget` of a `context`-token prompt per KV head, pages scattered through the
pool as eviction leaves them, against `scaled_dot_product_attention` over the full dense cache.
Bandwidth is bytes the kernel must read (kept K, V and positions) over its median time, against
the device's copy bandwidth measured here (bytes read + written by a large device-to-device copy).
Prefill statistics: H2O's column sums over a fresh `n`-token prompt, against one causal SDPA
(flash) forward at the same shape; the extra memory it allocates is compared with one n x n matrix.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from evalkit.kernels.attention_stats import attention_stats, attention_stats_reference  # noqa: E402
from evalkit.kernels.paged_attention import paged_attention, paged_attention_reference  # noqa: E402
from evalkit.policies.budget import tokens_of  # noqa: E402

H_Q, H_KV, D, S = 32, 8, 128, 16


def paged_cache(batch, kept, context, dtype, device, seed=0, scatter=True):
    """Per head `kept` tokens at sorted random positions below `context`, in pages of S slots."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_head = math.ceil(kept / S)
    num_pages = batch * H_KV * pages_per_head
    order = torch.randperm(num_pages, generator=gen) if scatter else torch.arange(num_pages)
    table = order.view(batch, H_KV, pages_per_head).to(torch.int32)
    slots = (num_pages + 1) * S
    slot_pos = torch.full((slots,), -1, dtype=torch.int64)
    positions = torch.sort(torch.randperm(context, generator=gen)[:kept]).values if kept < context \
        else torch.arange(context)
    n = torch.arange(kept)
    for b in range(batch):
        for h in range(H_KV):
            slot_pos[table[b, h, n // S].long() * S + n % S] = positions
    k = torch.randn(slots, D, dtype=dtype, device=device)
    v = torch.randn(slots, D, dtype=dtype, device=device)
    head_tokens = torch.full((batch, H_KV), pages_per_head * S, dtype=torch.int32)
    return k, v, slot_pos.to(device), table.to(device), head_tokens.to(device)


def check(device, dtype, launches=None):
    """Kernels vs float64 references on small random caches; returns the worst relative errors."""
    launches = launches or {}
    worst = {}
    for batch, context, kept, T, window in ((2, 300, 300, 1, 0), (1, 700, 150, 1, 0), (1, 96, 96, 96, 0),
                                            (2, 200, 120, 17, 64)):
        k, v, slot_pos, table, head_tokens = paged_cache(batch, kept, context, dtype, device, seed=kept)
        q = torch.randn(batch, H_Q, T, D, dtype=dtype, device=device)
        q_pos = (context - T + torch.arange(T, device=device)).expand(batch, T).contiguous()
        scale = D ** -0.5
        out, lse = paged_attention(q, q_pos, k, v, slot_pos, table, head_tokens, S, scale, window,
                                   launch=launches.get("decode" if T == 1 else "chunk"))
        ref, _ = paged_attention_reference(q, q_pos, k, v, slot_pos, table, head_tokens, S, scale, window)
        counted = torch.ones(batch, T, dtype=torch.bool, device=device)
        stats = attention_stats(q, q_pos, counted, k, slot_pos, table, head_tokens, S, scale, lse, window,
                                launch=launches.get("stats"))
        ref_stats = attention_stats_reference(q, q_pos, counted, k, slot_pos, table, head_tokens, S, scale, window)
        for name, got, want in (("attention", out, ref), ("statistics", stats, ref_stats)):
            assert not torch.isnan(got).any(), name
            error = float((got.double() - want).abs().max() / want.abs().max())
            worst[name] = max(worst.get(name, 0.0), error)
    return worst


def bench_decode(device, batch, contexts, budgets, dtype, launches):
    from triton.testing import do_bench

    rows = []
    for context in contexts:
        q = torch.randn(batch, H_Q, 1, D, dtype=dtype, device=device)
        q_pos = torch.full((batch, 1), context, device=device)
        k_full = torch.randn(batch, H_KV, context, D, dtype=dtype, device=device)
        v_full = torch.randn_like(k_full)
        sdpa_ms = do_bench(lambda: F.scaled_dot_product_attention(q, k_full, v_full, enable_gqa=True))
        for budget in budgets:
            kept = max(S, tokens_of(budget, context))  # at least one page
            k, v, slot_pos, table, head_tokens = paged_cache(batch, kept, context, dtype, device)
            scale = D ** -0.5
            ms = do_bench(lambda: paged_attention(q, q_pos, k, v, slot_pos, table, head_tokens, S, scale,
                                                  launch=launches["decode"]))
            _, lse = paged_attention(q, q_pos, k, v, slot_pos, table, head_tokens, S, scale)
            counted = torch.ones(batch, 1, dtype=torch.bool, device=device)
            stats_ms = do_bench(lambda: attention_stats(q, q_pos, counted, k, slot_pos, table, head_tokens, S,
                                                        scale, lse, launch=launches["stats"]))
            read = batch * H_KV * table.shape[2] * S * (2 * D * k.element_size() + slot_pos.element_size())
            rows.append(dict(context=context, budget=budget, kept=kept, batch=batch, decode_ms=ms,
                             stats_ms=stats_ms, sdpa_full_ms=sdpa_ms, gbytes=read / 1e9,
                             bandwidth_tbs=read / ms / 1e9, speedup_vs_sdpa=sdpa_ms / ms))
    return rows


def bench_prefill_stats(device, lengths, dtype, launches):
    from triton.testing import do_bench

    rows = []
    for n in lengths:
        k, v, slot_pos, table, head_tokens = paged_cache(1, n, n, dtype, device, scatter=False)
        q = torch.randn(1, H_Q, n, D, dtype=dtype, device=device)
        q_pos = torch.arange(n, device=device)[None]
        counted = torch.ones(1, n, dtype=torch.bool, device=device)
        scale = D ** -0.5
        # The same tokens as a dense [1, H_kv, n, D] cache for flash attention (pages are in order here).
        kd = k[:H_KV * table.shape[2] * S].view(1, H_KV, -1, D)[:, :, :n]
        vd = v[:H_KV * table.shape[2] * S].view(1, H_KV, -1, D)[:, :, :n]
        flash_ms = do_bench(lambda: F.scaled_dot_product_attention(q, kd, vd, is_causal=True, scale=scale,
                                                                   enable_gqa=True))
        attention_ms = do_bench(lambda: paged_attention(q, q_pos, k, v, slot_pos, table, head_tokens, S, scale,
                                                        launch=launches["chunk"]))
        _, lse = paged_attention(q, q_pos, k, v, slot_pos, table, head_tokens, S, scale)
        stats_ms = do_bench(lambda: attention_stats(q, q_pos, counted, k, slot_pos, table, head_tokens, S,
                                                    scale, lse, launch=launches["stats"]))
        torch.cuda.synchronize()  # one call on its own: do_bench allocates a buffer to flush the L2
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        attention_stats(q, q_pos, counted, k, slot_pos, table, head_tokens, S, scale, lse, launch=launches["stats"])
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        rows.append(dict(length=n, flash_forward_ms=flash_ms, paged_attention_ms=attention_ms,
                         stats_ms=stats_ms, stats_over_flash=stats_ms / flash_ms,
                         attention_and_stats_over_flash=(attention_ms + stats_ms) / flash_ms,
                         stats_extra_bytes=extra, n_by_n_bytes=n * n * 4))
    return rows


def sweep(device, dtype, batch, context, prefill_length):
    """Median time of each tile/schedule choice: decode at one long context, chunk attention and
    statistics over one fresh prompt. Returns every timing and the fastest choice of each kernel."""
    import itertools

    from triton.testing import do_bench

    scale = D ** -0.5
    k, v, slot_pos, table, head_tokens = paged_cache(batch, context // 2, context, dtype, device)
    q = torch.randn(batch, H_Q, 1, D, dtype=dtype, device=device)
    q_pos = torch.full((batch, 1), context, device=device)
    n = prefill_length
    pk, pv, p_pos, p_table, p_tokens = paged_cache(1, n, n, dtype, device, scatter=False)
    pq = torch.randn(1, H_Q, n, D, dtype=dtype, device=device)
    pq_pos = torch.arange(n, device=device)[None]
    counted = torch.ones(1, n, dtype=torch.bool, device=device)
    _, p_lse = paged_attention(pq, pq_pos, pk, pv, p_pos, p_table, p_tokens, S, scale)
    runs = {
        "decode": (lambda launch: paged_attention(q, q_pos, k, v, slot_pos, table, head_tokens, S, scale,
                                                  launch=launch),
                   dict(block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 4), programs_per_sm=(8, 16, 32))),
        "chunk": (lambda launch: paged_attention(pq, pq_pos, pk, pv, p_pos, p_table, p_tokens, S, scale,
                                                 launch=launch),
                  dict(block_m=(64, 128), block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3),
                       skip_future=(True, False))),
        "stats": (lambda launch: attention_stats(pq, pq_pos, counted, pk, p_pos, p_table, p_tokens, S, scale, p_lse,
                                                 launch=launch),
                  dict(block_m=(64, 128), block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3))),
    }
    timings, best = {}, {}
    for kernel, (call, grid) in runs.items():
        timings[kernel] = []
        for values in itertools.product(*grid.values()):
            launch = dict(zip(grid, values))
            try:
                ms = do_bench(lambda: call(launch), warmup=10, rep=40)
            except Exception as error:  # a tile too large for shared memory, say
                timings[kernel].append(dict(launch=launch, error=type(error).__name__))
                continue
            timings[kernel].append(dict(launch=launch, ms=ms))
            if kernel not in best or ms < best[kernel][1]:
                best[kernel] = (launch, ms)
    return timings, {kernel: launch for kernel, (launch, _) in best.items()}


def defaults(kernel):
    from evalkit.kernels.attention_stats import STATS_LAUNCH
    from evalkit.kernels.paged_attention import CHUNK_LAUNCH, DECODE_LAUNCH

    chosen = {"decode": DECODE_LAUNCH, "chunk": CHUNK_LAUNCH, "stats": STATS_LAUNCH}[kernel]
    return chosen


def copy_bandwidth(device):
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)  # 1 GiB, far past the L2
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e9  # TB/s, bytes read + written


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--contexts", default="4096,16384,32768,65536,131072")
    parser.add_argument("--budgets", default="0.1,0.2,0.5,1.0")
    parser.add_argument("--prefill-lengths", default="8192,32768")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"}
    for dtype in (torch.float32, torch.bfloat16):
        result[f"max_relative_error_{str(dtype)[6:]}"] = check(device, dtype)
    print(json.dumps(result, indent=1))
    if args.check_only or device != "cuda":
        return
    result["copy_bandwidth_tbs"] = copy_bandwidth(device)
    contexts = [int(c) for c in args.contexts.split(",")]
    budgets = [float(b) for b in args.budgets.split(",")]
    result["sweep"], launches = sweep(device, torch.bfloat16, args.batch, contexts[-1], 8192)
    result["launches"] = launches
    print("fastest launches:", json.dumps(launches))
    for dtype in (torch.float32, torch.bfloat16):
        result[f"max_relative_error_{str(dtype)[6:]}_fastest"] = check(device, dtype, launches)
    result["decode"] = bench_decode(device, args.batch, contexts, budgets, torch.bfloat16, launches)
    result["prefill_stats"] = bench_prefill_stats(device, [int(n) for n in args.prefill_lengths.split(",")],
                                                  torch.bfloat16, launches)
    print(f"device {result['device']}, copy bandwidth {result['copy_bandwidth_tbs']:.2f} TB/s")
    print(f"{'context':>8} {'budget':>6} {'kept':>7} {'decode us':>10} {'TB/s':>6} {'of copy':>7} "
          f"{'SDPA full us':>12} {'speedup':>7} {'stats us':>8}")
    for r in result["decode"]:
        print(f"{r['context']:>8} {r['budget']:>6} {r['kept']:>7} {1e3 * r['decode_ms']:>10.1f} "
              f"{r['bandwidth_tbs']:>6.2f} {r['bandwidth_tbs'] / result['copy_bandwidth_tbs']:>7.0%} "
              f"{1e3 * r['sdpa_full_ms']:>12.1f} {r['speedup_vs_sdpa']:>7.2f} {1e3 * r['stats_ms']:>8.1f}")
    print(f"{'length':>8} {'flash ms':>9} {'paged attn ms':>13} {'stats ms':>9} {'stats/flash':>11} "
          f"{'(attn+stats)/flash':>18} {'stats extra MiB':>15} {'n*n MiB':>8}")
    for r in result["prefill_stats"]:
        print(f"{r['length']:>8} {r['flash_forward_ms']:>9.2f} {r['paged_attention_ms']:>13.2f} "
              f"{r['stats_ms']:>9.2f} {r['stats_over_flash']:>11.2f} {r['attention_and_stats_over_flash']:>18.2f} "
              f"{r['stats_extra_bytes'] / 2**20:>15.1f} {r['n_by_n_bytes'] / 2**20:>8.0f}")
    for kernel, rows in result["sweep"].items():
        timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        print(kernel, "fastest 3:", [(round(r["ms"], 4), r["launch"]) for r in timed[:3]],
              "slowest:", (round(timed[-1]["ms"], 4), timed[-1]["launch"]),
              "default:", [round(r["ms"], 4) for r in rows
                           if "ms" in r and all(defaults(kernel)[k] == value for k, value in r["launch"].items())])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
