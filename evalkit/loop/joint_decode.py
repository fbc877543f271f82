"""Branches decoding together: one forward per step for every branch.

A *branch* is one `GenerationSettings` (policy, budget, ...) continuing a shared prefill
(`shared_prefill`): a sweep's runs on the same prompts decode from their own caches. Their weights are
the same, so `generate_branches` feeds every branch's next tokens through one forward: each branch's
rows attend over its own cache with its own plan (`attention.JointForwardPlan`), and every linear layer
(`F.linear`, which `nn.Linear` calls) computes a branch's rows as one entry of a batched matmul, or for a few
branches as its own product (`BranchwiseLinears`, a torch function mode: no module is patched) — bit for bit
what the branch's own forward computes, where one matmul over all branches' rows would not be (a row's result
depends on how many rows the kernel is given: 25 rows at once differ from one at a time in the last bits). Before branches decode together, probes check
exactly that on this model, device and shapes (`model_rows_apart`, `linears_apart`); where they fail
(rows that meet outside `nn.Linear`, a device whose batched kernels differ) branches decode one by one.
"""

from __future__ import annotations

import time
import weakref
from typing import Callable, Iterator, TypeVar

import psutil
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from evalkit.attention import JointForwardPlan, evalkit_attention
from evalkit.loop.generate import Decoding, start
from evalkit.loop.shared_prefill import SharedPrefill
from evalkit.loop.state import Generation, GenerationSettings, Request, fed, forward_inputs

# model -> {("model", rows per branch) or ("linears", branches, rows per branch): bool}, probed once each
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Branches decode together only as many as their caches fit in this share of the memory free at the start.
_MEMORY_SHARE = 0.5
T = TypeVar("T")


@torch.inference_mode()
def generate_branches(model, tokenizer, requests: list[Request], branches: list[GenerationSettings],
                      shared: SharedPrefill) -> list[list[Generation]]:
    """`generate(model, tokenizer, requests, settings, shared=shared)` for every settings in `branches`,
    the same generations, decoded together: all of them, or as many at a time as their caches fit in
    half the free memory. A branch's `decode_seconds` is the time of its own work (token choice,
    attention, eviction) plus an even share of each joint forward's rest."""
    joint_possible = len(branches) > 1 and model_rows_apart(model, len(requests))
    generations: list[list[Generation]] = []
    with evalkit_attention(model):
        for runs in branch_groups(model, branches, lambda settings: start(model, tokenizer, requests, settings,
                                                                          shared=shared)):
            generations += _decode_together(runs, joint_possible, len(requests))
    return generations


def branch_groups(model, branches: list[GenerationSettings],
                  opened: Callable[[GenerationSettings], T]) -> Iterator[list[T]]:
    """The branches, opened (`opened(settings)`: a prefill forked, ready to decode; anything with the branch's
    loop `state`), in groups whose caches fit in half the free memory; the first branch's cache sizes them, and
    a group's caches go before the next group's come."""
    allowance = _MEMORY_SHARE * _free_memory(model.device)
    group = [opened(branches[0])]
    size = max(1, int(allowance // max(1, group[0].state.cache.storage_bytes())))
    for first in range(0, len(branches), size):
        group += [opened(settings) for settings in branches[first + len(group):first + size]]
        yield group
        group = []


def _decode_together(runs: list[Decoding], joint_possible: bool, batch: int) -> list[list[Generation]]:
    seconds = [0.0] * len(runs)
    active = list(range(len(runs)))
    while active:
        tokens = {}
        for i in active:
            begun = time.perf_counter()
            tokens[i] = runs[i].next_tokens()
            seconds[i] += time.perf_counter() - begun
        active = [i for i in active if tokens[i] is not None]
        spent = step_together([runs[i] for i in active], [tokens[i] for i in active], joint_possible, batch)
        for i, step_seconds in zip(active, spent):
            seconds[i] += step_seconds
    return [run.generations(s) for run, s in zip(runs, seconds)]


def step_together(runs: list[Decoding], tokens: list[list[list[int]]], joint_possible: bool,
                  batch: int) -> list[float]:
    """One decode step, each run fed its `tokens`: through one forward where the probes allow it (each run's own
    otherwise). Each run's seconds: its own work plus an even share of the joint forward's rest."""
    if joint_possible and len(runs) > 1 and linears_apart(runs[0].state.model, len(runs), batch):
        begun = time.perf_counter()
        logits, own = forward_branches([run.state for run in runs], tokens)
        rest = (time.perf_counter() - begun - sum(own)) / len(runs)
        seconds = []
        for run, branch_logits, own_seconds in zip(runs, logits, own):
            begun = time.perf_counter()
            run.advance(branch_logits)
            seconds.append(own_seconds + rest + time.perf_counter() - begun)
        return seconds
    seconds = []
    for run, chosen in zip(runs, tokens):
        begun = time.perf_counter()
        run.feed(chosen)
        seconds.append(time.perf_counter() - begun)
    return seconds


def _free_memory(device: torch.device) -> int:
    """Bytes free for new tensors: the GPU's free memory, or the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


@torch.no_grad()  # not inference mode: what it writes into the branches' caches stays usable outside it
def forward_branches(states, tokens: list[list[list[int]]]) -> tuple[list[torch.Tensor], list[float]]:
    """One forward feeding branch i (`states[i]`) its rows `tokens[i]`, one token each: each branch's
    last-token logits [B, V] as its own `forward` gives them, and the seconds each spent in its
    own attention."""
    inputs = [forward_inputs(state, rows) for state, rows in zip(states, tokens)]
    joint = JointForwardPlan.of([plan for _, _, plan, _ in inputs], [len(rows) for rows in tokens])
    model = states[0].model
    with BranchwiseLinears(len(states)):
        out = model(input_ids=torch.cat([ids for ids, _, _, _ in inputs]),
                    position_ids=torch.cat([positions for _, positions, _, _ in inputs]),
                    use_cache=False, logits_to_keep=1, evalkit_plan=joint)
    for state, (_, _, _, counts) in zip(states, inputs):
        fed(state, counts)
    logits = out.logits[:, -1].float().cpu()
    return [logits[rows] for rows, _ in joint.parts], joint.seconds


def _linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


class BranchwiseLinears(TorchFunctionMode):
    """Inside the block, every `F.linear` (what `nn.Linear` computes) splits its input's rows into `branches`
    equal groups, in order, and computes each group as one entry of a batched matmul (each on its own for up
    to `_OWN_PRODUCTS_UP_TO` branches). A torch function mode: nothing of the model is touched, and it ends
    with the block."""

    def __init__(self, branches: int):
        super().__init__()
        self.branches = branches

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            return _branchwise_linear(self.branches, *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


# Both thresholds were chosen by timing them (docs/benchmarks-history.md).
# A weight larger than this (the default model's output head) is read in chunks of `_CHUNK_OUTPUTS` output
# features: each chunk stays in the core's cache while every branch reads it, instead of the whole weight
# being read from memory once per branch.
_CACHED_WEIGHT_BYTES = 16 << 20
_CHUNK_OUTPUTS = 512
# Up to this many branches, each branch's own product (`F.linear` of its rows: what its own forward
# computes) is faster than one batched matmul on a 2-core CPU; from 4 branches on the batched matmul
# breaks even or wins.
_OWN_PRODUCTS_UP_TO = 3


def _branchwise_linear(branches: int, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(branches, -1, x.shape[-1])  # [branches, rows of a branch, in]
    weight = weight.t()  # [in, out], a view
    outputs = weight.shape[1]
    chunk = _CHUNK_OUTPUTS if weight.numel() * weight.element_size() > _CACHED_WEIGHT_BYTES else outputs
    if branches <= _OWN_PRODUCTS_UP_TO:  # F.linear's own products (mm, or addmm with a bias), written in place
        out = x.new_empty(branches, rows.shape[1], outputs)
        for first in range(0, outputs, chunk):  # a large weight read once, a chunk at a time, for every branch
            cols = slice(first, first + chunk)
            for branch in range(branches):
                if bias is None:
                    torch.mm(rows[branch], weight[:, cols], out=out[branch, :, cols])
                else:
                    torch.addmm(bias[cols], rows[branch], weight[:, cols], out=out[branch, :, cols])
        return out.view(*x.shape[:-1], -1)
    parts = []
    for first in range(0, outputs, chunk):
        part = weight[:, first:first + chunk].expand(branches, -1, -1)  # [branches, in, chunk], never copied
        if bias is None:
            parts.append(torch.bmm(rows, part))
        else:
            parts.append(torch.baddbmm(bias[first:first + chunk].expand(branches, rows.shape[1], -1), rows,
                                       part))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
    return out.view(*x.shape[:-1], -1)


def model_rows_apart(model, batch: int) -> bool:
    """Probe (once per model and batch): two branches' one-token rows, through the model's own attention,
    jointly and one branch at a time. Fails where rows meet outside `F.linear` (GPT-2's Conv1D: `addmm`);
    a model whose linears are wrapped by hooks (accelerate's) is left alone."""
    verdicts = _VERDICTS.setdefault(model, {})
    key = ("model", batch)
    if key not in verdicts:
        if any("forward" in vars(linear) for linear in _linears(model)):
            verdicts[key] = False  # a forward already wrapped (accelerate's hooks): leave it alone
        else:
            ids = (torch.arange(2 * batch) * 7919 % model.config.vocab_size)[:, None].to(model.device)
            with torch.inference_mode():
                with BranchwiseLinears(2):
                    joint = model(input_ids=ids, use_cache=False).logits
                own = torch.cat([model(input_ids=ids[:batch], use_cache=False).logits,
                                 model(input_ids=ids[batch:], use_cache=False).logits])
            verdicts[key] = torch.equal(joint, own)
    return verdicts[key]


def linears_apart(model, branches: int, batch: int) -> bool:
    """Probe (once per model, branch count and batch): each linear shape's batched matmul against its own
    per-branch product, on random rows."""
    verdicts = _VERDICTS.setdefault(model, {})
    key = ("linears", branches, batch)
    if key not in verdicts:
        shapes = {(tuple(m.weight.shape), m.weight.dtype, m.bias is not None): m for m in _linears(model)}
        generator = torch.Generator().manual_seed(0)
        verdicts[key] = all(_linear_apart(linear, branches, batch, generator) for linear in shapes.values())
    return verdicts[key]


def _linear_apart(linear: torch.nn.Linear, branches: int, batch: int, generator: torch.Generator) -> bool:
    x = torch.randn(branches, batch, linear.in_features, generator=generator).to(linear.weight)
    with torch.inference_mode():
        own = torch.stack([torch.nn.functional.linear(x[b], linear.weight, linear.bias) for b in range(branches)])
        joint = _branchwise_linear(branches, x.view(branches * batch, 1, -1), linear.weight,
                                   linear.bias).view(branches, batch, -1)
    return torch.equal(own, joint)
