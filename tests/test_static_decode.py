"""The static decode step (evalkit/loop/static_decode.py): nothing inside a step reads a tensor back to the
host, and it keeps and generates exactly what the eager step does."""

import contextlib

import pytest
import torch

from conftest import SHORT_PROMPT_ARGS, tiny_model
from evalkit.attention import evalkit_attention
from evalkit.cache import PoolExhausted
from evalkit.errors import EvalkitError
from evalkit.loop import GenerationSettings, Request, generate, score_rolling
from evalkit.loop.generate import start
from evalkit.loop.static_decode import StaticStep, policy_refusal, static_step
from evalkit.policies import PAGE_GRANULARITIES, make_policy
from evalkit.policies.names import POLICIES

MAX_NEW = 10


def requests() -> list[Request]:
    g = torch.Generator().manual_seed(0)
    return [Request(torch.randint(0, 128, (n,), generator=g).tolist(), [5, 6, 7], MAX_NEW) for n in (40, 33)]


def policy(name: str):
    return make_policy(name, args=SHORT_PROMPT_ARGS.get(name))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


# Every policy the static step takes. The fast tier keeps H2O and SnapKV at every granularity and the full cache;
# the others are `slow`: they run in `make test` only.
STATIC = [name if name.startswith(("h2o_", "snapkv_")) or name == "full" else pytest.param(name, marks=pytest.mark.slow)
          for name in POLICIES.names() if policy_refusal(policy(name)) is None]


# A read of a tensor's values by the host: each of these waits for the device (a sync) on a GPU.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
              "masked_select", "unique")


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Inside the block, any of HOST_READS, `torch.nonzero` / `masked_select` / `unique`, or indexing with a bool
    tensor (its result's shape depends on the values) fails the test."""
    def refuse(what):
        def read(*args, **kwargs):
            raise AssertionError(f"a static decode step read a tensor back to the host: {what}")
        return read

    def has_mask(index) -> bool:
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)

    getitem = torch.Tensor.__getitem__

    def checked_getitem(self, index):
        if has_mask(index):
            raise AssertionError("a static decode step indexed with a bool mask (a shape read from the values)")
        return getitem(self, index)

    with monkeypatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        for name in ("nonzero", "masked_select", "unique"):
            patch.setattr(torch, name, refuse(f"torch.{name}"))
        patch.setattr(torch.Tensor, "__getitem__", checked_getitem)
        yield


@pytest.mark.parametrize("name", STATIC)
def test_a_static_step_reads_nothing_back_to_the_host(model, monkeypatch, name):
    """Every policy the static step takes, on the paged layout with decode eviction: append, attention, statistic,
    scoring, selection and eviction of every step run with the guard on, and the step did evict."""
    steps, evicted = [], []
    step = StaticStep.step

    def guarded(self):
        live = sum(int((layer.pos >= 0).sum()) for layer in self.state.cache.layers)
        with no_host_reads(monkeypatch):
            step(self)
        steps.append(self)
        evicted.append(sum(int((layer.pos >= 0).sum()) for layer in self.state.cache.layers) <= live)

    monkeypatch.setattr(StaticStep, "step", guarded)
    settings = GenerationSettings(policy(name), budget=0.4, page_size=4, decode_step="static")
    generate(model, None, requests(), settings)
    assert len(steps) == MAX_NEW - 1
    if settings.policy.evicts:
        assert any(evicted), "no step evicted anything: the guard watched no eviction"


def _run(model, name: str, layout: str, budget: float, mode: str, kernels: str = "torch", **options):
    """(tokens fed, logits after each step, each head's positions after each step's eviction) of one generation;
    `options`: more GenerationSettings."""
    kept = []

    def observe(event, cache):
        if event == "compressed":
            kept.append([sorted(p for p in layer.gather(layer.pos, layer.slot_index())[b, h].tolist() if p >= 0)
                         for layer in cache.layers for b in range(layer.batch) for h in range(layer.kv_heads)])

    settings = GenerationSettings(policy(name), budget=budget, page_size=4, layout=layout, decode_step=mode,
                                  kernels=kernels, **options)
    fed, logits = [], []
    with torch.inference_mode(), evalkit_attention(model):
        run = start(model, None, requests(), settings, observe)
        run.static = static_step(run.state, run.caps, run.evict, MAX_NEW)
        assert (run.static is not None) == (mode == "static")
        kept.clear()
        while (tokens := run.next_tokens()) is not None:
            fed.append(tokens)
            run.feed(tokens)
            logits.append(run.logits.clone())
    return fed, logits, kept


@pytest.mark.parametrize("layout", ["paged", "dense"])
@pytest.mark.parametrize("name", STATIC)
def test_the_static_step_keeps_and_generates_what_the_eager_step_does(model, name, layout):
    """Same tokens, and after every step the same positions in every (layer, sequence, KV head). The logits are
    the same bits wherever both steps attend over the same slots in the same order: on the dense layout, and on
    the paged one where single tokens are evicted. Where whole pages go (or nothing does), an eager head returns
    an emptied page and reads only the pages it holds, a frozen one refills it and reads all it owns, so
    attention sums the same terms in another order."""
    budgets = (0.4, 1.0) if name in ("full", "h2o_head", "snapkv_head_page") else (0.4,)
    for budget in budgets:
        eager = _run(model, name, layout, budget, "eager")
        static = _run(model, name, layout, budget, "static")
        assert static[0] == eager[0], f"{name} at {budget}: the static step generated other tokens"
        assert static[2] == eager[2], f"{name} at {budget}: the static step kept other tokens"
        p = policy(name)
        same_order = layout == "dense" or (p.evicts and budget < 1 and p.granularity not in PAGE_GRANULARITIES)
        for e, s in zip(eager[1], static[1]):
            if same_order:
                assert torch.equal(e, s), f"{name} at {budget}: logits differ in their bits"
            else:
                torch.testing.assert_close(s, e, rtol=0, atol=1e-5)


def _token_by_token(model, name: str, layout: str, mode: str):
    """(Scores, each (layer, sequence, KV head)'s kept positions at the end) of `score_rolling` over two
    80-token sequences in chunks of one token, at budget 0.3."""
    sequences = torch.randint(0, 128, (2, 80), generator=torch.Generator().manual_seed(1)).tolist()
    kept = []

    def observe(event, cache):
        if event == "prefill":
            kept.extend(sorted(p for p in layer.gather(layer.pos, layer.slot_index())[b, h].tolist() if p >= 0)
                        for layer in cache.layers for b in range(layer.batch) for h in range(layer.kv_heads))

    settings = GenerationSettings(policy(name), budget=0.3, page_size=4, layout=layout, chunk_size=1,
                                  decode_step=mode)
    return score_rolling(model, sequences, [79, 79], settings, observe), kept


@pytest.mark.fast_tier_keeps_one_in(2)
@pytest.mark.parametrize("layout", ["paged", "dense"])
@pytest.mark.parametrize("name", ["h2o_head", "h2o_page", "h2o_head_page", "snapkv_head_page", "streaming_llm",
                                  "tova_token"])
def test_token_by_token_perplexity_through_the_static_step_equals_the_eager_path(model, monkeypatch, name, layout):
    """Teacher forcing one token a step (`ppl --chunk-size 1`) through the static step, its tokens given rather
    than picked, nothing read back to the host: the same tokens kept, the same bytes held (a frozen head's
    reserved pages are not counted) and greedy flags as the eager path, and the same log-probabilities but for
    rounding: until a head reaches its cap the static step also attends over its empty slots, masked, so the
    sums run over more terms (measured: at most 6e-6 apart)."""
    eager, eager_kept = _token_by_token(model, name, layout, "eager")
    steps = []
    step = StaticStep.step

    def guarded(self):
        with no_host_reads(monkeypatch):
            step(self)
        steps.append(self)

    monkeypatch.setattr(StaticStep, "step", guarded)
    static, static_kept = _token_by_token(model, name, layout, "static")
    assert len(steps) == 79  # every token through the static step
    assert static_kept == eager_kept
    for e, s in zip(eager, static):
        assert e.kept_tokens < 79  # the budget evicted
        assert (s.kept_tokens, s.bytes_held, s.bytes_ideal, s.greedy) == (e.kept_tokens, e.bytes_held,
                                                                           e.bytes_ideal, e.greedy)
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(e.logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name, budget, options", [
    ("full", 1.0, {}), ("full", 1.0, dict(decode_eviction=False)), ("h2o_head", 0.1, {}),
    ("h2o_head", 0.4, dict(decode_eviction=False, layout="dense")), ("h2o_token", 0.4, dict(sliding_layers="window")),
    ("snapkv_head_page", 0.1, {})])
def test_the_static_step_drops_what_a_sliding_window_lost_as_the_eager_step_does(monkeypatch, name, budget, options):
    """A tiny Gemma 3 (layer 0 slides with a window of 8): the static step drops each step's token that left the
    window, evicting or not, with nothing read back to the host, and keeps and generates what the eager step
    does."""
    model = tiny_model("gemma3")
    options = {"layout": "paged", **options}
    layout = options.pop("layout")
    eager = _run(model, name, layout, budget, "eager", **options)
    step = StaticStep.step

    def guarded(self):
        with no_host_reads(monkeypatch):
            step(self)

    monkeypatch.setattr(StaticStep, "step", guarded)
    static = _run(model, name, layout, budget, "static", **options)
    assert static[0] == eager[0] and static[2] == eager[2]
    assert len(eager[2]) == MAX_NEW - 1  # every step dropped what left the window, and said so
    for e, s in zip(eager[1], static[1]):
        torch.testing.assert_close(s, e, rtol=0, atol=1e-5)


@pytest.mark.slow  # whole generations through the Triton interpreter
@pytest.mark.parametrize("name", ["h2o_head", "h2o_head_page", "snapkv_head_page", "tova_token", "full"])
def test_the_static_step_on_the_kernels_keeps_and_generates_what_the_eager_step_does(model, name):
    """The static step's Triton path (its frozen block tables, in Triton's interpreter here) against the eager step
    on the same kernels: the same tokens, the same kept positions after every step."""
    runs = {mode: _run(model, name, "paged", 0.4, mode, kernels="triton") for mode in ("eager", "static")}
    assert runs["static"][0] == runs["eager"][0]
    assert runs["static"][2] == runs["eager"][2]
    for e, s in zip(runs["eager"][1], runs["static"][1]):
        torch.testing.assert_close(s, e, rtol=0, atol=1e-5)


def test_auto_steps_eagerly_on_a_cpu_and_refusals_are_one_line(model):
    with torch.inference_mode(), evalkit_attention(model):
        state = start(model, None, requests(), GenerationSettings(policy("h2o_head"), budget=0.4)).state
        assert static_step(state, torch.zeros(2, 2, dtype=torch.long), True, MAX_NEW) is None
        for name, mode, message in [("h2o_head", "graph", "needs CUDA"), ("h2o_head", "warp", "unknown decode step"),
                                    ("quest", "static", "quest chooses the pages"),
                                    ("random", "static", "host's generator")]:
            settings = GenerationSettings(policy(name), budget=0.4, decode_step=mode)
            state = start(model, None, requests(), settings).state
            with pytest.raises(EvalkitError, match=message):
                static_step(state, torch.zeros(2, 2, dtype=torch.long), True, MAX_NEW)


def test_a_pool_too_small_for_the_whole_decode_is_refused_before_anything_is_reserved(model):
    """The static step reserves every head's whole decode up front (the eager step takes pages as it goes, and
    needs none it never reaches): a pool that holds the prompts (40 pages of 4 tokens) but not every new token
    is refused with one line, nothing taken from it."""
    settings = GenerationSettings(policy("full"), page_size=4, pool_pages=40, decode_step="static")
    with torch.inference_mode(), evalkit_attention(model):
        run = start(model, None, requests(), settings)
        free = [layer.pool.num_free for layer in run.state.cache.layers]
        with pytest.raises(PoolExhausted, match="reserves it up front"):
            static_step(run.state, run.caps, run.evict, MAX_NEW)
        assert [layer.pool.num_free for layer in run.state.cache.layers] == free
        assert not any(layer.frozen for layer in run.state.cache.layers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("name", ["full", "h2o_head", "h2o_token", "h2o_page", "h2o_head_page", "snapkv_head_page"])
def test_the_cuda_graph_replays_the_static_step_bit_for_bit(name):
    model = tiny_model().cuda()
    runs = {}
    for mode in ("static", "graph"):
        settings = GenerationSettings(policy(name), budget=0.4, page_size=4, decode_step=mode)
        runs[mode] = [g.token_ids for g in generate(model, None, requests(), settings)]
    assert runs["graph"] == runs["static"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("name", ["full", "h2o_head", "h2o_page", "snapkv_head_page"])
def test_token_by_token_perplexity_in_a_cuda_graph_scores_what_the_static_step_scores(name):
    """`ppl --chunk-size 1` on CUDA takes the graph by default: the same tokens kept and bytes held, and the same
    log-probabilities, to 1e-5 rather than the bit: cuBLAS may pick other kernels for the capture."""
    model = tiny_model().cuda()
    runs = {mode: _token_by_token(model, name, "paged", mode) for mode in ("static", "graph")}
    assert runs["graph"][1] == runs["static"][1]
    for s, g in zip(*(runs[mode][0] for mode in ("static", "graph"))):
        assert (g.kept_tokens, g.bytes_held, g.bytes_ideal) == (s.kept_tokens, s.bytes_held, s.bytes_ideal)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(s.logprobs), rtol=0, atol=1e-5)
