"""Speed and memory of the generation loop, one measurement per fresh process.

A *cell* (`evalkit.bench.cells.BenchCell`) is one (loop, policy, budget, layout, length): the evalkit loop
under a policy, or HF `generate` as the baseline. `measure_cell` runs in a child process (see
`evalkit.bench.isolation`) and returns plain numbers; the parent never loads the model.

Time. On CPU, `time.perf_counter`; on CUDA, `torch.cuda.Event`s read after a synchronize. The
loop's `observe` hook marks the end of the prompt's forward, the end of compression and every
decode forward, so prefill, compression and each decode step are timed apart (generate's own
`timing` folds compression into prefill and, on CUDA, stops its clock without synchronizing; it
is kept in the raw repeats for comparison). One warm-up generation on a short prompt first, then
`repeats` timed ones; medians reported.

Memory. The peak resident set of a long-lived process never goes down, so each cell gets its own
process, and on a CPU memory is read in one more generation after the timed ones (on CUDA the timed
ones give the device's peak, below). Before it, the process
switches glibc to exact allocation (every block of 1 MiB or more its own mapping, returned to the
kernel when freed: with glibc's default, adaptive threshold, freed blocks linger in the heap, and
the same generation peaks at different heights in two processes; exact allocation gives the same peak
every time but slows the generation down, hence a separate generation: numbers in
docs/benchmarks-history.md), returns free heap pages (`malloc_trim`) and resets the kernel's high-water mark
(`/proc/self/clear_refs`, "5"). The peak (VmHWM, tracked by the kernel, no sampling) is then the
true peak of that generation, and `working` is the peak minus the resident set just before it (the
loaded, warmed-up model). Without clear_refs, `ru_maxrss` of the fresh process is used and the
method recorded. On CUDA, `torch.cuda.max_memory_allocated` after a reset as well.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from evalkit.bench.cells import EVALKIT_LOOP, FULL, HF_LOOP, BenchCell, BenchSettings
from evalkit.bench.isolation import Clock, PeakMemory
# Re-exported for tests/test_bench.py, which imports them from here.
from evalkit.bench.cells import grid_cells  # noqa: F401
from evalkit.bench.targets import compare_with_full, targets  # noqa: F401
from evalkit.errors import EvalkitError
from evalkit.loop import GenerationSettings, Request, generate
from evalkit.models import load_model, resolve_device, resolve_dtype
from evalkit.policies import make_policy
from evalkit.tasks.haystack import haystack_text

WARMUP_PROMPT_TOKENS = 128
QUESTION = "\nQuestion: What does the author think is the best way to find startup ideas?\nAnswer:"
_ROW_OFFSET = 1000  # haystack tokens between the starts of two prompts of a batch


# --- prompts ------------------------------------------------------------------------------------

@dataclass
class Prompt:
    context_ids: list[int]
    question_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.context_ids + self.question_ids


def bench_prompts(tokenizer, prompt_tokens: int, batch: int) -> list[Prompt]:
    """`batch` prompts of exactly `prompt_tokens` tokens: essay text (RULER's haystack), then a question."""
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    context_tokens = prompt_tokens - len(question)
    if context_tokens < 1:
        raise EvalkitError(f"a {prompt_tokens}-token prompt cannot hold the {len(question)}-token question: "
                           "use longer --lengths")
    # A word is at least one token, so this many words always give enough tokens.
    text = haystack_text(context_tokens + _ROW_OFFSET * batch)
    haystack = tokenizer(text, add_special_tokens=False, verbose=False).input_ids
    return [Prompt(haystack[b * _ROW_OFFSET:b * _ROW_OFFSET + context_tokens], question) for b in range(batch)]


def random_prompts(vocab_size: int, prompt_tokens: int, batch: int, seed: int) -> list[Prompt]:
    """`batch` prompts of `prompt_tokens` random token ids (seeded), for a model with random weights: no text,
    no tokenizer; no question (the whole prompt is compressed, as query-aware runs do)."""
    ids = torch.randint(0, vocab_size, (batch, prompt_tokens), generator=torch.Generator().manual_seed(seed))
    return [Prompt(row.tolist(), []) for row in ids]


def random_model(config, dtype: str = "auto", device: str = "auto", seed: int = 0):
    """A causal LM of `config`'s architecture with random weights, built on its device (an 8B model initialises
    there in seconds, not on the host) with SDPA attention. Seeded: every process on the same device builds the
    same weights, so cells measured in different processes run the same model."""
    target = resolve_device(device)
    torch.manual_seed(seed)
    with torch.device(target):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, target),
                                                 attn_implementation="sdpa")
    return model.to(target).eval()  # a no-op where the context placed everything


@contextlib.contextmanager
def eos_disabled(model):
    """No EOS in either loop: both generate exactly the asked number of tokens from the same logits.
    (HF's min_new_tokens would instead mask EOS's logit, which can change the argmax.)"""
    previous = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = previous


# --- one generation -----------------------------------------------------------------------------

def _evalkit_once(model, prompts: list[Prompt], settings: BenchSettings, cell: BenchCell, clock: Clock) -> dict:
    marks: list[tuple[str, object]] = []
    storage = {}

    def observe(event: str, cache) -> None:
        marks.append((event, clock.mark()))
        if event == "prefill":
            storage["bytes"] = sum(layer.num_real_slots * layer.token_bytes for layer in cache.layers)

    requests = [Request(p.context_ids, p.question_ids, settings.new_tokens) for p in prompts]
    policy = make_policy(cell.policy, cell.granularity, settings.policy_args if cell.policy != FULL else None)
    gen_settings = GenerationSettings.from_options(settings, policy, budget=cell.budget, layout=cell.layout)
    start = clock.mark()
    generations = generate(model, None, requests, gen_settings, observe=observe)
    stop = clock.mark()

    events = [event for event, _ in marks]
    at_prefill = events.index("prefill")
    prompt_forward_done = marks[events.index("forward")][1]  # the prompt's one forward (prefill is "full")
    prefill_done = marks[at_prefill][1]
    decoding = marks[at_prefill + 1:]
    # A decode step runs from one forward's end to the next's; with eviction "compressed" follows each forward.
    decode_marks = [prefill_done] + [mark for event, mark in decoding if event == "forward"]
    evictions = [clock.seconds(a, b) for (e, a), (f, b) in zip(decoding, decoding[1:])
                 if e == "forward" and f == "compressed"]
    first = generations[0]
    return {
        "prefill_seconds": clock.seconds(start, prompt_forward_done),
        "compression_seconds": clock.seconds(prompt_forward_done, prefill_done),
        "decode_seconds": clock.seconds(prefill_done, stop),
        "total_seconds": clock.seconds(start, stop),
        "decode_steps": [clock.seconds(a, b) for a, b in zip(decode_marks, decode_marks[1:])],
        "decode_evictions": evictions,
        "generate_timing": {k: v for k, v in first.timing.items() if k.endswith("seconds")},
        "token_ids": first.token_ids,
        "new_tokens": sum(len(g.token_ids) for g in generations),
        "prompt_tokens": sum(g.prompt_tokens for g in generations),
        "kept_tokens": statistics.fmean(g.kept_tokens for g in generations),
        "bytes_held": sum(g.bytes_held for g in generations),
        "bytes_ideal": sum(g.bytes_ideal for g in generations),
        "bytes_full": sum(g.bytes_full for g in generations),
        "storage_bytes": storage["bytes"],
    }


def _hf_once(model, prompts: list[Prompt], settings: BenchSettings, clock: Clock) -> dict:
    class MarkEachStep(LogitsProcessor):
        """Called once per generated token, right after the forward that produced its logits."""

        def __init__(self):
            self.marks = []

        def __call__(self, input_ids, scores):
            self.marks.append(clock.mark())
            return scores  # unchanged: greedy picks the same token

    ids = torch.tensor([p.ids for p in prompts], device=model.device)
    steps = MarkEachStep()
    pad = model.generation_config.pad_token_id
    start = clock.mark()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=settings.new_tokens,
                             do_sample=False, pad_token_id=0 if pad is None else pad,
                             logits_processor=LogitsProcessorList([steps]))
    stop = clock.mark()
    first_logits = steps.marks[0]
    new = out[:, ids.shape[1]:]
    return {
        "prefill_seconds": clock.seconds(start, first_logits),
        "compression_seconds": 0.0,
        "decode_seconds": clock.seconds(first_logits, stop),
        "total_seconds": clock.seconds(start, stop),
        "decode_steps": [clock.seconds(a, b) for a, b in zip(steps.marks, steps.marks[1:])],
        "token_ids": new[0].tolist(),
        "new_tokens": new.numel(),
        "prompt_tokens": ids.numel(),
    }


# --- one cell, in its own process ---------------------------------------------------------------

def measure_cell(settings: BenchSettings, cell: BenchCell, config=None) -> dict:
    """Warm up, time `settings.repeats` generations of `cell`, then on a CPU one more for its peak memory (on
    CUDA the timed ones give it: the device counts its peak itself); medians, peaks and bytes. Run it
    isolated: it changes how the process allocates.

    `config`: a transformers config to build the model from (`random_model`: random weights seeded by
    `settings.seed`, prompts of random ids) instead of loading `settings.model`, which then only names it."""
    prompt_tokens = cell.length - settings.new_tokens
    if config is None:
        model, tokenizer = load_model(settings.model, settings.dtype, settings.device)
        prompts = bench_prompts(tokenizer, prompt_tokens, settings.batch)
    else:
        model = random_model(config, settings.dtype, settings.device, settings.seed)
        prompts = random_prompts(config.vocab_size, prompt_tokens, settings.batch, settings.seed)
    clock, memory = Clock(model.device), PeakMemory(model.device)
    short = [Prompt(p.context_ids[-max(1, WARMUP_PROMPT_TOKENS - len(p.question_ids)):], p.question_ids)
             for p in prompts]

    def once(batch: list[Prompt]) -> dict:
        if cell.loop == HF_LOOP:
            return _hf_once(model, batch, settings, clock)
        return _evalkit_once(model, batch, settings, cell, clock)

    with eos_disabled(model):
        once(short)  # warm-up: first calls pay for thread pools, kernels, lazy imports and weight pages
        if model.device.type == "cuda":  # the device counts its own peak: read over the timed generations
            memory.reset()
            runs = [once(prompts) for _ in range(settings.repeats)]
        else:
            runs = [once(prompts) for _ in range(settings.repeats)]
            memory.reset()
            once(prompts)  # memory only: exact allocation slows it down
    return summarise(cell, runs, memory.read(), str(model.device), torch.get_num_threads())


def summarise(cell: BenchCell, runs: list[dict], memory: dict, device: str, threads: int) -> dict:
    """One row: medians over the repeats (decode step: over every step of every repeat), bytes, peaks."""
    last = runs[-1]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    total = median("total_seconds")
    decode = median("decode_seconds")
    steps = [step for r in runs for step in r["decode_steps"]]
    row = {
        **asdict(cell), "key": cell.key, "label": cell.label, "device": device, "threads": threads,
        "prompt_tokens": last["prompt_tokens"], "new_tokens": last["new_tokens"],
        "prefill_seconds": median("prefill_seconds"), "compression_seconds": median("compression_seconds"),
        "decode_seconds": decode, "total_seconds": total,
        "decode_step_seconds": statistics.median(steps),  # new tokens >= 2: at least one step
        "tokens_per_s": last["new_tokens"] / total,
        "decode_tokens_per_s": last["new_tokens"] / decode,
        "prefill_tokens_per_s": last["prompt_tokens"] / median("prefill_seconds"),
        **memory,
        "token_ids": last["token_ids"],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "repeats": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
    }
    if cell.loop == EVALKIT_LOOP:
        row.update({key: last[key] for key in ("kept_tokens", "bytes_held", "bytes_ideal", "bytes_full",
                                                "storage_bytes")})
        evictions = [e for r in runs for e in r["decode_evictions"]]
        row["decode_eviction_seconds"] = statistics.median(evictions) if evictions else 0.0
        row["held_over_ideal"] = last["bytes_held"] / last["bytes_ideal"]
        row["held_over_full"] = last["bytes_held"] / last["bytes_full"]
    return row
