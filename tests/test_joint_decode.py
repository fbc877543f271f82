"""A sweep's cells decoding together (docs/sweeps.md, "Cells decode together"): one forward per step
for every cell gives each cell, bit for bit, the logits its own forward gives; `generate_branches` gives
every cell the generations `generate` gives it; where the probes say rows would not stay apart, the
cells decode one by one.
"""

from __future__ import annotations

import pytest
import torch

import evalkit.loop.joint_decode as joint_decode
from evalkit.attention import evalkit_attention
from evalkit.loop import GenerationSettings, Request, generate, start
from evalkit.loop.state import forward
from evalkit.loop.joint_decode import forward_branches, generate_branches
from evalkit.policies import make_policy
from evalkit.loop.shared_prefill import prefill_statistics, share_prefill

POLICIES = ["full", "h2o_head", "snapkv_head", "tova_token", "knorm_head_page", "streaming_llm", "h2o_page",
            "pyramidkv_head", "adakv_snapkv", "quest", "random",
            "expected_attention_head", "adakv_expected_attention", "critical_snapkv_head", "keydiff_page", "lagkv_token"]


def wide_model(arch: str):
    """A 2-layer random model as wide as the default one (576): at the tiny test models' width a matmul's
    rows may come out the same however many are batched, and the test could not tell."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config

    config = tiny_config(arch)
    config.hidden_size, config.intermediate_size, config.num_attention_heads = 576, 1536, 9
    config.num_key_value_heads, config.vocab_size = 3, 2048
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def batch_of(size: int, gen: torch.Generator) -> list[Request]:
    return [Request(torch.randint(0, 2048, (60 + 17 * b,), generator=gen).tolist(),
                    torch.randint(0, 2048, (5,), generator=gen).tolist(), 8) for b in range(size)]


def cells_of(query_aware: bool) -> list[GenerationSettings]:
    return [GenerationSettings(policy=make_policy(name), budget=budget, layout=layout, page_size=4,
                               query_aware=query_aware)
            for name in POLICIES for budget in (0.25, 0.5) for layout in ("paged", "dense")]


def shared_prefill(model, batch, cells, query_aware):
    return share_prefill(model, batch, query_aware,
                         set().union(*(prefill_statistics(c.policy) for c in cells)))


@pytest.mark.fast_tier_keeps_one_in(2)
@pytest.mark.parametrize("arch", ["llama", "qwen2"], ids=["llama", "qwen2 (biased projections)"])
@pytest.mark.parametrize("count", [3, 12], ids=["3 cells (own products)", "12 cells (batched matmul)"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole weights", "weights over 1 MiB in chunks"])
def test_a_joint_forward_gives_each_cell_its_own_forwards_logits_bit_for_bit(arch, count, chunked, monkeypatch):
    assert (count <= joint_decode._OWN_PRODUCTS_UP_TO) == (count == 3)  # each linear path once
    if chunked:  # as a real model's output head is read: a chunk of outputs at a time, by every cell
        monkeypatch.setattr(joint_decode, "_CACHED_WEIGHT_BYTES", 1 << 20)
    model = wide_model(arch)
    batch = batch_of(2, torch.Generator().manual_seed(0))
    cells = cells_of(query_aware=True)[2:2 + count]
    shared = shared_prefill(model, batch, cells, True)
    with evalkit_attention(model):
        together = [start(model, None, batch, c, shared=shared) for c in cells]
        alone = [start(model, None, batch, c, shared=shared) for c in cells]
        for _ in range(4):  # each step after the previous one's eviction
            tokens = [d.next_tokens() for d in together]
            assert tokens == [d.next_tokens() for d in alone]
            joint, _ = forward_branches([d.state for d in together], tokens)
            for d, rows, logits in zip(alone, tokens, joint):
                own, _ = forward(d.state, rows)
                assert torch.equal(own, logits)
                d.advance(own)
            for d, logits in zip(together, joint):
                d.advance(logits)


def test_one_matmul_over_every_cells_rows_would_not_be_exact():
    """Why the linears go cell by cell: one plain matmul over 8 cells' decode rows changes a cell's bits
    (against the one-row product its own forward computes; 8 rows against 2 can agree on some CPUs)."""
    model = wide_model("llama")
    linear = model.model.layers[0].mlp.down_proj
    x = torch.randn(8, 1, linear.in_features, generator=torch.Generator().manual_seed(0))
    own = torch.stack([torch.nn.functional.linear(row, linear.weight) for row in x])  # each cell alone
    assert not torch.equal(linear(x), own)
    with joint_decode.BranchwiseLinears(8):
        assert torch.equal(linear(x), own)


@pytest.mark.slow  # a run's worth of cells, decoded together and one by one
@pytest.mark.parametrize("size", [1, 2], ids=["batch 1", "batch 2"])
@pytest.mark.parametrize("query_aware", [True, False], ids=["query-aware", "query-agnostic"])
def test_cells_decoded_together_generate_what_each_generates_alone(query_aware, size, monkeypatch):
    model = wide_model("qwen2")
    batch = batch_of(size, torch.Generator().manual_seed(1))
    cells = cells_of(query_aware)
    shared = shared_prefill(model, batch, cells, query_aware)
    joint_steps = []
    monkeypatch.setattr(joint_decode, "forward_branches",
                        lambda *a: joint_steps.append(len(a[0])) or forward_branches(*a))
    together = generate_branches(model, None, batch, cells, shared)
    assert joint_steps and joint_steps[0] == len(cells)  # the joint path ran
    for settings, cell in zip(cells, together):
        for a, b in zip(generate(model, None, batch, settings, shared=shared), cell):
            assert (a.token_ids, a.text, a.prompt_tokens, a.kept_tokens, a.bytes_held, a.bytes_ideal, a.bytes_full,
                    a.attended_fraction) == (b.token_ids, b.text, b.prompt_tokens, b.kept_tokens, b.bytes_held,
                                             b.bytes_ideal, b.bytes_full, b.attended_fraction), settings.policy.name


def test_a_cells_decode_seconds_are_its_own_work_plus_a_share_of_the_rest():
    import time

    model = wide_model("llama")
    batch = batch_of(1, torch.Generator().manual_seed(2))
    cells = cells_of(True)[:6]
    shared = shared_prefill(model, batch, cells, True)
    begun = time.perf_counter()
    together = generate_branches(model, None, batch, cells, shared)
    wall = time.perf_counter() - begun
    decode = [cell[0].timing["decode_seconds"] for cell in together]
    assert all(s > 0 for s in decode) and sum(decode) <= wall


def test_a_model_whose_rows_meet_outside_its_linears_decodes_cells_one_by_one(monkeypatch):
    """A batch-wide operation (here: the final norm nudged by the batch mean) fails the model probe."""
    model = wide_model("llama")
    norm = model.model.norm

    class BatchMeanNorm(torch.nn.Module):
        def forward(self, x):
            return norm(x) + 1e-3 * x.mean(0, keepdim=True)

    model.model.norm = BatchMeanNorm()
    batch = batch_of(1, torch.Generator().manual_seed(3))
    cells = cells_of(True)[:6]
    shared = shared_prefill(model, batch, cells, True)
    monkeypatch.setattr(joint_decode, "forward_branches", lambda *a: pytest.fail("cells decoded together"))
    together = generate_branches(model, None, batch, cells, shared)
    assert joint_decode._VERDICTS[model][("model", 1)] is False
    for settings, cell in zip(cells, together):
        assert [g.token_ids for g in generate(model, None, batch, settings, shared=shared)] == \
            [g.token_ids for g in cell]


def test_linears_whose_batched_kernel_differs_decode_cells_one_by_one(monkeypatch):
    model = wide_model("llama")
    exact = joint_decode._branchwise_linear
    monkeypatch.setattr(joint_decode, "_branchwise_linear", lambda *args: exact(*args) * (1 + 1e-6))
    assert not joint_decode.linears_apart(model, 3, 1)
    monkeypatch.setattr(joint_decode, "_branchwise_linear", exact)
    assert joint_decode.linears_apart(model, 4, 1)


def test_cells_whose_caches_do_not_fit_together_decode_in_groups_that_do(monkeypatch):
    """Every cell holds its whole prompt until compressed: at most as many as fit in half the free memory
    decode together (here, memory for 2.5 caches: groups of 2), with the same generations."""
    model = wide_model("llama")
    batch = batch_of(1, torch.Generator().manual_seed(4))
    cells = cells_of(True)[:5]
    shared = shared_prefill(model, batch, cells, True)
    with evalkit_attention(model):
        cache_bytes = start(model, None, batch, cells[0], shared=shared).state.cache.storage_bytes()
    monkeypatch.setattr(joint_decode, "_free_memory", lambda device: int(2.5 * cache_bytes / joint_decode._MEMORY_SHARE))
    joint_steps = []
    monkeypatch.setattr(joint_decode, "forward_branches",
                        lambda *a: joint_steps.append(len(a[0])) or forward_branches(*a))
    together = generate_branches(model, None, batch, cells, shared)
    assert max(joint_steps) == 2
    for settings, cell in zip(cells, together):
        assert [g.token_ids for g in generate(model, None, batch, settings, shared=shared)] == \
            [g.token_ids for g in cell]


def test_a_joint_forward_touches_no_module_of_the_model(monkeypatch):
    """The branches' linears are split by a torch function mode (`BranchwiseLinears`), not by replacing any
    `nn.Linear.forward`: every linear runs its own forward, and the model is left as it was."""
    model = wide_model("llama")
    batch = batch_of(1, torch.Generator().manual_seed(6))
    cells = cells_of(True)[:2]  # `evalkit run`'s two branches: the run and its baseline
    shared = shared_prefill(model, batch, cells, True)
    joint_steps, calls = [], []

    def untouched(module, args):
        assert "forward" not in vars(module)
        calls.append(module)

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [linear.register_forward_pre_hook(untouched) for linear in linears]
    monkeypatch.setattr(joint_decode, "forward_branches",
                        lambda *a: joint_steps.append(len(a[0])) or forward_branches(*a))
    together = generate_branches(model, None, batch, cells, shared)
    for hook in hooks:
        hook.remove()
    assert joint_steps and max(joint_steps) == 2 and len(calls) >= len(linears) * len(joint_steps)
    for settings, cell in zip(cells, together):
        assert [g.token_ids for g in generate(model, None, batch, settings, shared=shared)] == \
            [g.token_ids for g in cell]


def test_each_cells_attention_in_a_joint_forward_runs_outside_the_torch_function_mode(monkeypatch):
    """The mode is there for the linears; a cell's attention (append, read, attention, statistic) is its own
    computation, and the mode's Python call on each of its operators cost about a sixth of a decode step
    (docs/benchmarks-history.md). The joint forward still gives each cell its own forward's logits."""
    import evalkit.attention as attention

    model = wide_model("llama")
    batch = batch_of(1, torch.Generator().manual_seed(7))
    cells = cells_of(query_aware=True)[2:5]
    shared = shared_prefill(model, batch, cells, True)
    modes_on = []
    own_attention = attention._evalkit_attention

    def recorded(*args, **kwargs):
        if kwargs.get("evalkit_plan") is not None and not isinstance(kwargs["evalkit_plan"], attention.JointForwardPlan):
            modes_on.append(torch._C._is_torch_function_enabled())
        return own_attention(*args, **kwargs)

    with evalkit_attention(model):
        together = [start(model, None, batch, c, shared=shared) for c in cells]
        alone = [start(model, None, batch, c, shared=shared) for c in cells]
        tokens = [d.next_tokens() for d in together]
        monkeypatch.setattr(attention, "_evalkit_attention", recorded)
        joint, _ = forward_branches([d.state for d in together], tokens)
        assert modes_on and not any(modes_on)  # every cell's attention in every layer, none inside the mode
        monkeypatch.setattr(attention, "_evalkit_attention", own_attention)
        for d, rows, logits in zip(alone, tokens, joint):
            own, _ = forward(d.state, rows)
            assert torch.equal(own, logits)
