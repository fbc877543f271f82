"""The generation loop on the Triton kernels keeps the torch path's tokens and statistics.

On a CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so models and
prompts stay tiny; on a GPU the same tests run them compiled.
"""

import pytest
import torch

from conftest import tiny_model
from evalkit.errors import EvalkitError
from evalkit.kernels import use_triton
from evalkit.policies import POLICIES
from test_generate import hf_greedy, prompts, run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.slow  # whole generations through the Triton interpreter (2-4 s a case on a CPU)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: the kernels' sliding window, its tokens dropped
@pytest.mark.parametrize("layout", ["paged", "dense"])
def test_kernels_at_full_budget_match_hf_greedy(layout, arch):
    model = tiny_model(arch, kv_heads=2)  # G = 3 query heads per KV head
    batch = prompts(lengths=(17, 30, 5))
    expected = [hf_greedy(model, p) for p in batch]
    model.to(DEVICE)
    for policy, settings in (("full", {}), ("h2o_head", dict(prefill="chunked", chunk_size=8))):
        got = run(model, batch, policy, 1.0, layout=layout, page_size=4, kernels="triton", **settings)
        assert [g.token_ids for g in got] == expected, (policy, settings)


# Every policy where a GPU compiles the kernels (this also runs the whole loop on CUDA tensors);
# the interpreter on a CPU takes one policy per statistic kind and allocator.
POLICIES_UNDER_TEST = POLICIES.names() if DEVICE == "cuda" else ["h2o_head", "snapkv", "tova", "adakv"]


@pytest.mark.slow  # whole generations through the Triton interpreter (2-4 s a case on a CPU)
@pytest.mark.parametrize("policy", POLICIES_UNDER_TEST)
@pytest.mark.parametrize("layout", ["paged", "dense"])
def test_kernels_keep_the_same_tokens_and_statistics_as_torch(policy, layout):
    """Eviction driven by the kernels' statistics matches eviction driven by the reference's."""
    model = tiny_model("qwen2", kv_heads=2).to(DEVICE)
    batch = prompts(lengths=(40, 23))
    kept = {}
    for kernels in ("torch", "triton"):
        snapshots = []

        def observe(event, cache):
            if event == "prefill":
                snapshots.append([(layer.pos.clone(), layer.stats.clone()) for layer in cache.layers])

        got = run(model, batch, policy, 0.5, layout=layout, page_size=4, prefill="chunked", chunk_size=16,
                  kernels=kernels, observe=observe)
        kept[kernels] = ([g.token_ids for g in got], snapshots[0])
    assert kept["triton"][0] == kept["torch"][0]
    for (pos_t, stats_t), (pos_k, stats_k) in zip(kept["torch"][1], kept["triton"][1]):
        assert torch.equal(pos_t, pos_k), "the same slots are kept"
        assert torch.allclose(stats_t, stats_k, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # whole generations through the Triton interpreter (2-4 s a case on a CPU)
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
def test_a_fresh_prompt_takes_its_statistics_from_the_kernel_beside_flash_attention(heads):
    """Where the kernels run, a fresh prompt's statistics come from the Triton pass over the forward's own K with
    flash attention's log-sum-exp ("flash+kernel"), never from the chunk kernel: the same output bits as the
    torch route, and the same statistics (H2O's every query, SnapKV's window of 5) within the kernels' bound."""
    from evalkit.attention_ops import prefill_route, prompt_attention, window_queries

    H_q, H_kv = heads
    g = torch.Generator().manual_seed(H_q)
    B, T, D = 2, 37, 16
    q, k, v = (torch.randn(B, h, T, D, generator=g).to(DEVICE) for h in (H_q, H_kv, H_kv))
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    valid = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    counted = [valid, window_queries(pos, valid, 5)]
    assert prefill_route(q, "triton") == "flash+kernel"
    assert prefill_route(q, "torch") == ("flash+tiles" if DEVICE == "cpu" else "sdpa")
    out_torch, stats_torch = prompt_attention(q, pos, valid, k, v, 0.25, None, counted, "torch")
    out_kernel, stats_kernel = prompt_attention(q, pos, valid, k, v, 0.25, None, counted, "triton")
    if DEVICE == "cpu":
        assert torch.equal(out_kernel, out_torch)
    else:
        torch.testing.assert_close(out_kernel, out_torch, rtol=1e-3, atol=1e-5)
    for kernel, reference in zip(stats_kernel, stats_torch):
        torch.testing.assert_close(kernel, reference, rtol=1e-3, atol=1e-5)


def test_kernel_mode_is_checked(monkeypatch):
    cpu = torch.zeros(1)
    assert not use_triton("torch", cpu) and not use_triton("auto", cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(EvalkitError, match="TRITON_INTERPRET=1"):
        use_triton("triton", cpu)
    with pytest.raises(EvalkitError, match="unknown kernels mode 'cuda'"):
        use_triton("cuda", cpu)
