"""The decode step with fixed shapes and nothing read back to the host, so that a CUDA graph can capture it.

The eager step (`Decoding` in loop/generate.py) asks the host questions as it goes (how many tokens does each
head hold, which page is free, is any head over its cap): free on a CPU, a synchronisation per layer per
step on a GPU. Here, before the first step, every head is given the slots its whole decode can need
(`SlotLayer.freeze`: its cap plus the token a step adds, or everything it will ever hold where it is not
evicted) and keeps exactly those to the end. A step then appends each head's token into its lowest free
slot, attends, collects the statistic, and evicts what the policy drops (`keep_mask(span=...)`: at most one
token per head over its cap, or whole pages), with tensors of fixed shape on the model's device. The host
only copies the fed tokens in and reads the sampled ones out.

Which slot a token lands in can differ from the eager step's (a frozen head refills a page it emptied where
the eager one returned the page and took a new one), so attention may sum the same terms in another order;
the tokens kept and generated are the same (tests/test_static_decode.py).

`GenerationSettings.decode_step`: "graph" captures this step once in a CUDA graph and replays it (CUDA only);
"static" runs it without a graph; "eager" never runs it; "auto" (the default) is "graph" on CUDA wherever
`refusal` allows and "eager" elsewhere: on a CPU a read back to the host costs nothing, and the eager step
reads only the slots each head holds.
"""

from __future__ import annotations

import torch

from evalkit.attention import ForwardPlan
from evalkit.cache import PoolExhausted, SlotView
from evalkit.errors import EvalkitError
from evalkit.loop.compression import protected_recent, score_input, sliding_caps
from evalkit.loop.state import NO_LIMIT, LoopState, advance
from evalkit.policies import Policy

DECODE_STEPS = ("auto", "graph", "static", "eager")
WARMUP_STEPS = 1  # eager steps before the capture (Triton's compilation, cuBLAS's workspace)


def refusal(state: LoopState) -> str | None:
    """Why this generation cannot decode with the static step (None: it can)."""
    if state.settings.temperature > 0:
        return "sampling draws from a generator on the host"
    if state.cache is None or state.record is not None:
        return "a shared prefill's branches decode together (loop/joint_decode.py)"
    return policy_refusal(state.policy)


def policy_refusal(policy: Policy) -> str | None:
    """Why `policy` cannot decode with the static step (None: it can)."""
    if policy.restricts_reads:
        return f"{policy.name} chooses the pages each query reads, a host-side step"
    if policy.selects_across_layers:
        return f"{policy.name} selects every layer's slots at once, not one layer's with `keep_mask`"
    return policy.not_static or None


def decode_slots_needed(state: LoopState, caps: torch.Tensor, evict: bool, max_new: int) -> list[torch.Tensor]:
    """Per layer, [B, H_kv] the most tokens each head holds during the decode: its cap plus the token a step
    adds where it is evicted, else what it holds now plus every token still to come; in a sliding layer of
    window W never more than W (its W - 1 and the new token)."""
    grown = []
    for layer, cap, sliding_window in zip(state.cache.layers, caps, state.sliding_windows or [None] * len(caps)):
        live = layer.live_counts()
        ceiling = live + max_new
        if evict:
            ceiling = torch.where(cap[:, None] < NO_LIMIT, torch.minimum(ceiling, torch.maximum(live, cap[:, None]) + 1),
                                  ceiling)
        if sliding_window is not None:
            ceiling = ceiling.clamp(max=sliding_window)
        grown.append(ceiling)
    return grown


class StaticStep:
    """A decode step over frozen layers: `__call__(tokens)` feeds one token per sequence and returns the next
    logits [B, V] float32 (on the model's device), evicting down to `caps` [L, B] when `evict`."""

    def __init__(self, state: LoopState, caps: torch.Tensor, evict: bool, max_new: int, capture: bool):
        model, device = state.model, state.model.device
        B = len(state.seen)
        self.state, self.evict, self.capture = state, evict, capture
        # Sliding-window layers drop what their window lost at every step, evicting or not.
        self.sliding_windows = state.sliding_windows or [None] * len(state.cache.layers)
        self.drops = evict or bool(state.sliding_windows)
        needed = decode_slots_needed(state, caps, evict, max_new)
        if not all(layer.room_for(most) for layer, most in zip(state.cache.layers, needed)):
            raise PoolExhausted("the KV page pool cannot hold every head's decode at once (the static step reserves "
                                "it up front): raise --pool-pages, or decode eagerly")
        self.slots = [layer.freeze(most) for layer, most in zip(state.cache.layers, needed)]
        self.span = int(state.seen.max()) + max_new + 1  # every position of the decode is below it
        # The step's own buffers (`.to` alone would share the host's tensors on a CPU).
        self.caps = sliding_caps(state, caps).to(device, copy=True)
        self.seen = state.seen.to(device, copy=True)  # [B] tokens fed so far: the next token's position
        self.stat_end = state.stat_end.to(device, copy=True)
        self.tokens = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.logits = torch.zeros(B, model.config.vocab_size, dtype=torch.float32, device=device)
        # A 4D mask is passed through untouched: transformers builds none (and reads nothing back to find out).
        self.no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        self.plan = ForwardPlan(state.cache, self.seen[:, None], torch.ones(B, 1, dtype=torch.bool, device=device),
                                state.collect, state.policy.observation_window, kernels=state.settings.kernels,
                                decode_slots=self.slots)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.steps = 0

    def __call__(self, tokens: list[list[int]]) -> torch.Tensor:
        self.tokens.copy_(torch.tensor(tokens, dtype=torch.long))
        if not self.capture:
            self.step()
        elif self.steps < WARMUP_STEPS:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.step()  # recorded, not run
            self.graph.replay()
        self.steps += 1
        self._mirror_on_host()
        return self.logits

    def step(self) -> None:
        """Feed `tokens`, keep the logits, evict: every shape fixed, nothing read back to the host."""
        state = self.state
        out = state.model(input_ids=self.tokens, position_ids=self.seen[:, None], attention_mask=self.no_mask,
                          use_cache=False, logits_to_keep=1, evalkit_plan=self.plan)
        self.logits.copy_(out.logits[:, -1])
        advance(self.seen, self.stat_end, None, scored=state.collect is not None)
        if self.drops:
            self._evict()

    def _evict(self) -> None:
        """`compression.slots_to_keep` for frozen layers: every layer scored and selected (when evicting), the
        rows within their caps left alone; a sliding layer's tokens out of its window dropped first
        (`compression.in_window`)."""
        state, policy = self.state, self.state.policy
        recents = protected_recent(policy, self.caps, self.seen, self.stat_end)  # [L, B]
        layers = zip(state.cache.layers, self.slots, self.sliding_windows)
        for layer_idx, (layer, slots, sliding_window) in enumerate(layers):
            stored = layer.gather(layer.pos, slots.index)  # [B, H_kv, N]
            # A sliding layer's stale tokens as empty slots: fixed shapes, nothing read back.
            pos = stored if sliding_window is None else \
                stored.masked_fill(stored <= (self.seen - sliding_window)[:, None, None], -1)
            live = pos >= 0
            if not self.evict:  # only what the window lost
                if sliding_window is not None:
                    layer.evict_static(slots.index, live, stored)
                continue
            view = SlotView(layer, slots.index, pos)
            caps = self.caps[layer_idx]
            scores = policy.score(score_input(state, view, layer_idx, caps, self.stat_end, self.span))
            keep = policy.select(scores, view.pos, self.seen, caps, state.settings.page_size, recents[layer_idx],
                                 span=self.span)
            within = (live.sum(-1) <= caps[:, None]).all(-1)  # [B]
            layer.evict_static(slots.index, torch.where(within[:, None, None], live, keep), stored)

    def _mirror_on_host(self) -> None:
        """The host's copy of the loop's counters, kept without reading the device."""
        state = self.state
        advance(state.seen, state.stat_end, None, scored=state.collect is not None)
        if state.observe:
            state.observe("forward", state.cache)
            if self.drops:
                state.observe("compressed", state.cache)


def static_step(state: LoopState, caps: torch.Tensor, evict: bool, max_new: int) -> StaticStep | None:
    """The static step this generation decodes with under `settings.decode_step`, or None (the eager step)."""
    mode = state.settings.decode_step
    if mode not in DECODE_STEPS:
        raise EvalkitError(f"unknown decode step {mode!r}; choose from {', '.join(DECODE_STEPS)}")
    on_cuda = state.model.device.type == "cuda"
    if mode == "graph" and not on_cuda:
        raise EvalkitError("decode step 'graph' needs CUDA (CUDA graphs); use 'static' to run the same step here")
    if mode == "eager" or (mode == "auto" and not on_cuda):
        return None
    why = refusal(state)
    if why is not None:
        if mode != "auto":
            raise EvalkitError(f"the static decode step cannot run here: {why}")
        return None
    try:
        return StaticStep(state, caps, evict, max_new, capture=mode != "static")
    except PoolExhausted:
        if mode != "auto":
            raise
        return None
