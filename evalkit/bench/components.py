"""How each piece of the loop scales: microbenchmarks of one layer's work, with fitted exponents.

- a fresh prompt's attention with statistics (`prompt_attention`, collect None / "attention" / "window"), by
  each prefill route the device has (`prefill_route`: the loop's own, and on CUDA the torch one it passes over)
  over n prompt tokens: time and working memory. Exact attention does n²/2 query-key products, so
  its time grows ~n² whatever the statistics; what must stay linear is the memory (the statistics
  are [B, H_kv, n] and queries go in blocks, never an n × n matrix) and the statistics' overhead
  over plain attention (a constant factor, not a higher power).
- selection (a policy's `score` then `select`, as `compress` runs them) over n slots at a budget.
- decode attention over a cache of k kept tokens: one layer's `read()` of a compacted paged cache
  and one query's attention, swept over the prompt length n at fixed k (should be flat) and over k
  at fixed n (should grow with k).

Every point runs in its own process (see `evalkit.bench.isolation.Isolated`), so its peak memory is its own;
memory is read in one more call after the timed ones (see `evalkit.bench.isolation.PeakMemory`).
Fits are least squares of log(value) on log(size): value ∝ size^exponent, and per_doubling =
2^exponent = value(2n) / value(n).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from evalkit.attention_ops import attention_reference, prefill_route, prompt_attention, statistic_queries
from evalkit.bench.isolation import Clock, PeakMemory
from evalkit.cache import PagedLayer, model_kv_shape
from evalkit.cache.kept_per_slot import key_norms_of
from evalkit.kernels import use_triton
from evalkit.policies import ScoreInput, make_policy, tokens_for

PREFILL_COLLECTS = (None, "attention", "window")
SNAPKV_WINDOW = 32
KEPT_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)  # of the longest prompt, for the decode sweep over k
FIXED_KEPT_FRACTION = 0.2  # of the shortest prompt, for the decode sweep over n


@dataclass(frozen=True)
class HeadShape:
    """One attention layer of the benchmarked model."""

    query_heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # "float32", ...
    device: str

    @classmethod
    def of(cls, config, dtype: torch.dtype, device: torch.device) -> "HeadShape":
        _, kv_heads, head_dim = model_kv_shape(config)
        return cls(config.num_attention_heads, kv_heads, head_dim, str(dtype).removeprefix("torch."), str(device))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def time_call(fn, clock: Clock, min_repeats: int = 3, max_repeats: int = 200, seconds: float = 0.2) -> float:
    """Median seconds of `fn()` after one warm-up call, repeated until `seconds` have passed (bounded)."""
    fn()
    times = []
    while len(times) < min_repeats or (len(times) < max_repeats and sum(times) < seconds):
        start = clock.mark()
        fn()
        times.append(clock.seconds(start, clock.mark()))
    return statistics.median(times)


def fit_power(sizes: list[float], values: list[float]) -> dict | None:
    """value ≈ c · size^exponent by least squares in log space; None without two distinct sizes."""
    pairs = sorted((s, v) for s, v in zip(sizes, values) if s > 0 and v > 0)
    if len({s for s, _ in pairs}) < 2:
        return None
    xs = [math.log(s) for s, _ in pairs]
    ys = [math.log(v) for _, v in pairs]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    exponent = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    ratios = [{"from": a, "to": b, "ratio": vb / va} for (a, va), (b, vb) in zip(pairs, pairs[1:]) if b != a]
    return {"exponent": exponent, "per_doubling": 2 ** exponent, "ratios": ratios}


# --- the points (each runs isolated) ------------------------------------------------------------

def _qkv(shape: HeadShape, queries: int, keys: int, generator: torch.Generator):
    """q: [1, H_q, queries, D]; k, v: [1, H_kv, keys, D]."""
    def randn(*size):
        return torch.randn(*size, generator=generator).to(shape.device, shape.torch_dtype)

    return (randn(1, shape.query_heads, queries, shape.head_dim), randn(1, shape.kv_heads, keys, shape.head_dim),
            randn(1, shape.kv_heads, keys, shape.head_dim))


def prefill_statistics_point(shape: HeadShape, n: int, collect: str | None, route: str) -> dict:
    """One layer's prefill attention over n fresh tokens, gathering `collect`, by prefill `route`
    (`evalkit.attention_ops.prefill_route`: the loop's choice on this device, or the one it passes over); seconds
    and working memory."""
    device = torch.device(shape.device)
    q, k, v = _qkv(shape, n, n, torch.Generator().manual_seed(n))
    positions = torch.arange(n, device=device)[None]  # [1, n]
    valid = torch.ones(1, n, dtype=torch.bool, device=device)
    counted = [statistic_queries(collect, SNAPKV_WINDOW, positions, valid)] if collect else []
    kernels = "triton" if route == "flash+kernel" else "torch"
    if prefill_route(q, kernels) != route:
        raise ValueError(f"prefill route {route!r} does not run on {device.type}")
    scaling = shape.head_dim ** -0.5

    def call():
        prompt_attention(q, positions, valid, k, v, scaling, None, counted, kernels)

    seconds = time_call(call, Clock(device), min_repeats=1 if n >= 4096 else 3)
    memory = PeakMemory(device)
    memory.reset()
    call()  # memory only, after the timing (see PeakMemory)
    return {"n": n, "collect": f"{collect or 'none'} ({route})", "route": route, "seconds": seconds, **memory.read()}


def prefill_routes(device: torch.device) -> tuple[str, ...]:
    """The prefill routes the components time on `device`: the loop's own first (`prefill_route`), then on CUDA
    the torch route it passes over, so the rule's reason is in the same table."""
    return ("flash+kernel", "sdpa") if device.type == "cuda" else ("flash+tiles",)


def selection_point(shape: HeadShape, policy_name: str, n: int, budget: float) -> dict:
    """A policy's `score` and `select` over n slots of one layer, as `compress` runs them."""
    device = torch.device(shape.device)
    generator = torch.Generator().manual_seed(n)
    policy = make_policy(policy_name)
    keys = torch.randn(1, shape.kv_heads, n, shape.head_dim, generator=generator).to(device, shape.torch_dtype)
    attention = torch.rand(1, shape.kv_heads, n, generator=generator).to(device)
    positions = torch.arange(n, device=device).expand(1, shape.kv_heads, n)
    seen = torch.tensor([n])
    tokens = tokens_for(budget, seen)
    recent = torch.minimum(policy.recent_count(tokens), tokens)
    key_norms = key_norms_of(keys)  # kept by the storage (`SlotLayer.key_norms`), not part of a step

    def call():
        scores = policy.score(ScoreInput(keys, positions, attention, 0, 0, seen, key_norms))
        policy.select(scores.cpu(), positions.cpu(), seen, tokens, 16, recent)

    return {"policy": policy_name, "n": n, "budget": budget, "kept": int(tokens),
            "seconds": time_call(call, Clock(device))}


def decode_attention_point(shape: HeadShape, n: int, kept: int, page_size: int) -> dict:
    """One decode query's attention over a paged layer that saw n tokens and keeps `kept` per KV head
    (a different random set per head, then compacted): on CUDA the Triton kernel reading the pages in
    place, elsewhere the layer's `read()` of its pages and the torch reference, as the loop dispatches."""
    device = torch.device(shape.device)
    generator = torch.Generator().manual_seed(n + kept)
    q, k, v = _qkv(shape, 1, n, generator)
    layer = PagedLayer(1, shape.kv_heads, shape.head_dim, shape.kv_heads * math.ceil(n / page_size), page_size,
                       shape.torch_dtype, device)
    layer.append(k, v, torch.arange(n, device=device)[None], torch.ones(1, n, dtype=torch.bool, device=device))
    view = layer.read()
    rank = torch.rand(view.pos.shape, generator=generator).to(device).argsort(-1).argsort(-1)  # random per head
    layer.evict(view.index, (rank < kept) & (view.pos >= 0))
    layer.compact()
    q_pos = torch.tensor([[n]], device=device)
    q_valid = torch.ones(1, 1, dtype=torch.bool, device=device)
    scaling = shape.head_dim ** -0.5

    triton = use_triton("auto", q)

    def call():
        if triton:
            # Triton is optional (CPU installs lack it): its kernels' module loads only where they run.
            from evalkit.kernels.paged_attention import paged_attention

            table, size, head_tokens = layer.page_table()
            paged_attention(q, q_pos, layer.k, layer.v, layer.pos, table, head_tokens, size, scaling)
        else:
            view = layer.read()
            attention_reference(q, q_pos, q_valid, view.k, view.v, view.pos, scaling)

    held = int(layer.held_slots()[0]) // shape.kv_heads
    return {"n": n, "kept": kept, "slots_read": held, "path": "triton" if triton else "torch",
            "seconds": time_call(call, Clock(device))}


# --- the whole set ------------------------------------------------------------------------------

def measurement_points(sizes: list[int], policies: list[str], budget: float, page_size: int,
                       routes: tuple[str, ...] = ("flash+tiles",)) -> list[tuple]:
    """(component, function, args) for every point, given the prompt sizes, the evicting policies and the prefill
    routes to time (`prefill_routes`)."""
    sizes = sorted(set(sizes))
    points = [("prefill_statistics", prefill_statistics_point, (n, collect, route))
              for route in routes for collect in PREFILL_COLLECTS for n in sizes]
    points += [("selection", selection_point, (policy, n, budget)) for policy in policies for n in sizes]
    fixed_kept = _fixed_kept(sizes)
    points += [("decode_attention", decode_attention_point, (n, fixed_kept, page_size)) for n in sizes]
    longest = sizes[-1]
    points += [("decode_attention", decode_attention_point, (longest, kept, page_size))
               for kept in sorted({max(1, round(f * longest)) for f in KEPT_FRACTIONS} - {fixed_kept})]
    return points


def _fixed_kept(sizes: list[int]) -> int:
    return max(1, round(FIXED_KEPT_FRACTION * min(sizes)))


def summarise(results: dict[str, list[dict]], sizes: list[int]) -> dict:
    """Points grouped per component, with fitted exponents."""
    prefill = results.get("prefill_statistics", [])
    selection = results.get("selection", [])
    decode = results.get("decode_attention", [])
    summary = {"sizes": sorted(set(sizes)), "prefill_statistics": {"points": prefill, "fits": {}},
               "selection": {"points": selection, "fits": {}}, "decode_attention": {"points": decode, "fits": {}}}
    for collect in {p["collect"] for p in prefill}:
        mine = [p for p in prefill if p["collect"] == collect]
        summary["prefill_statistics"]["fits"][collect] = {
            "time": fit_power([p["n"] for p in mine], [p["seconds"] for p in mine]),
            "working_memory": fit_power([p["n"] for p in mine], [p["working_bytes"] for p in mine]),
            "time_per_query": fit_power([p["n"] for p in mine], [p["seconds"] / p["n"] for p in mine]),
        }
    plain = {(p["n"], p["route"]): p["seconds"] for p in prefill if p["collect"].startswith("none")}
    summary["prefill_statistics"]["overhead_over_plain"] = [
        {"n": p["n"], "collect": p["collect"], "ratio": p["seconds"] / plain[p["n"], p["route"]]}
        for p in prefill if not p["collect"].startswith("none") and (p["n"], p["route"]) in plain]
    for policy in {p["policy"] for p in selection}:
        mine = [p for p in selection if p["policy"] == policy]
        summary["selection"]["fits"][policy] = fit_power([p["n"] for p in mine], [p["seconds"] for p in mine])
    if decode:
        fixed_kept = _fixed_kept(sizes)
        over_n = [p for p in decode if p["kept"] == fixed_kept]
        longest = max(p["n"] for p in decode)
        over_k = [p for p in decode if p["n"] == longest]
        summary["decode_attention"]["fits"] = {
            "over_length_at_fixed_kept": fit_power([p["n"] for p in over_n], [p["seconds"] for p in over_n]),
            "over_kept_at_fixed_length": fit_power([p["kept"] for p in over_k], [p["seconds"] for p in over_k]),
            "fixed_kept": fixed_kept, "fixed_length": longest,
        }
    return summary
