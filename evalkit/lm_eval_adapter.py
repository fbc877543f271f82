"""lm-evaluation-harness model `evalkit`: any lm-eval task, answered through evalkit's sparse KV cache.

Importing this module registers the model with lm-eval (`--model evalkit`). lm-eval's own CLI
does not import third-party models, so `main` imports this module and then runs that CLI.

How each request type reads the cache (budget, policy and layout as in `evalkit run`):
- `loglikelihood`: the context is prefilled and compressed under the policy, then the
  continuation is read through the sparse cache by teacher forcing: one token per forward with
  eviction after each, like decoding, when decode eviction is on (or a Quest-style read
  restriction applies); else in one forward. `score_continuations` in evalkit.generate.
- `loglikelihood_rolling`: lm-eval's rolling windows (first token predicted from the prefix
  token, windows of `max_length`); each window streamed in chunks of `chunk_size`, compressed
  after every chunk, loss on every token. `score_rolling` in evalkit.generate.
- `generate_until`: evalkit's generation loop (`generate`) with the request's stop sequences and
  `max_gen_toks`, prompts batched `batch_size` at a time.
At budget 1 all three equal lm-eval's own HF model (`--model hf`).

Query-agnostic (`query_aware=False`): an lm-eval context is one string, so its question is taken
to be the text after the last `question_marker` (default a newline); only what comes before is
compressed, and the budget is a fraction of it.

Policy hyper-parameters (`evalkit run --policy-arg KEY=VALUE`) go in one model arg, since lm-eval
splits model args at commas and equals signs: `policy_args=window:64;kernel:5`.

Nothing finished is lost: every model arg, `--out` and `--wandb` are checked before lm-eval indexes
its tasks, the tasks' data is loaded before the model, and results are written before W&B is told.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text,
                                  resolve_max_length)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from evalkit import models
from evalkit.assets import DEFAULT_MODEL
from evalkit.cache import LAYOUTS
from evalkit.config import DTYPES, SEED_LIMIT, WANDB_MODES, parse_budget
from evalkit.errors import EvalkitError
from evalkit.generate import GenerationSettings, Request, ScoreRequest, generate, score_continuations, score_rolling
from evalkit.kernels import KERNEL_MODES
from evalkit.policies import GRANULARITIES, POLICIES, make_policy
from evalkit.results import RunDir, check_writable_folder, package_versions, write_json_atomic
from evalkit.tracking import decide_wandb_mode, log_run

MODEL_NAME = "evalkit"
RESULTS_KEY = "evalkit"  # lm-eval puts get_model_info() into results["config"]: ours lives under this key
_IGNORED_ARGS = ("trust_remote_code", "max_batch_size")  # lm-eval hands these to every model
_PACKAGES = ("evalkit", "lm_eval", "torch", "transformers", "datasets")
log = logging.getLogger(__name__)


@dataclass
class AdapterConfig:
    """The model args of `--model evalkit`, validated before any model is loaded."""

    pretrained: str = DEFAULT_MODEL  # embedded default, a local folder or a hub id
    tokenizer: str | None = None  # default: the model's own
    policy: str = "h2o_head"
    budget: float | int = 0.2
    granularity: str | None = None
    policy_args: dict[str, str] = field(default_factory=dict)  # from "key:value;key:value", see the module doc
    block_size: int = 16
    layout: str = "paged"
    prefill: str = "full"
    chunk_size: int = 512  # chunked prefill, and the streaming chunk of loglikelihood_rolling
    query_aware: bool = True
    question_marker: str = "\n"  # query-agnostic: the question is what follows its last occurrence
    decode_eviction: bool = True
    pool_pages: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    batch_size: int = 1
    max_length: int | None = None  # default: the model's positions
    add_bos_token: bool | None = None  # default: the tokenizer's own behaviour (as lm-eval's hf model)
    seed: int = 0
    kernels: str = "auto"  # attention: auto (Triton on CUDA), triton, torch

    @classmethod
    def from_args(cls, **args) -> "AdapterConfig":
        known = [f.name for f in fields(cls)]
        for name in list(args):
            if name in _IGNORED_ARGS:
                args.pop(name)
            elif name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise EvalkitError(f"unknown model arg {name!r} for --model {MODEL_NAME}{hint}; "
                                   f"known: {', '.join(known)}")
        return cls(**{k: v for k, v in args.items() if v is not None}).validate()

    def validate(self) -> "AdapterConfig":
        self.policy = POLICIES.canonical(str(self.policy))
        self.budget = parse_budget(self.budget)
        _choice("granularity", self.granularity, GRANULARITIES, optional=True)
        _choice("layout", self.layout, LAYOUTS)
        _choice("prefill", self.prefill, ("full", "chunked"))
        _choice("dtype", self.dtype, DTYPES)
        _choice("kernels", self.kernels, KERNEL_MODES)
        if isinstance(self.batch_size, str) and self.batch_size.strip().isdigit():
            self.batch_size = int(self.batch_size)
        if isinstance(self.batch_size, str):
            raise EvalkitError(f"batch_size must be an integer >= 1 (evalkit does not size batches "
                               f"automatically), got {self.batch_size!r}")
        for name in ("block_size", "chunk_size", "batch_size", "max_length", "pool_pages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise EvalkitError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("query_aware", "decode_eviction", "add_bos_token"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise EvalkitError(f"{name} must be true or false, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT:
            raise EvalkitError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        self.policy_args = policy_args_from_model_arg(self.policy_args)
        make_policy(self.policy, self.granularity, self.policy_args)
        self.question_marker = str(self.question_marker).encode().decode("unicode_escape")  # "\\n" from a CLI
        if not self.question_marker:
            raise EvalkitError("question_marker must not be empty")
        self.device = str(self.device)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI passes device=cuda:0 unless told otherwise; its hf model falls back the same way.
            log.warning("device %s requested but CUDA is not available: using the CPU", self.device)
            self.device = "cpu"
        models.check_device(self.device)
        for name in ("pretrained", "tokenizer"):
            value = getattr(self, name)
            if isinstance(value, str) and value != DEFAULT_MODEL:
                models.model_source(value)  # a missing local folder is refused here, not after loading
        return self


def _choice(name: str, value, allowed, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in allowed:
        raise EvalkitError(f"unknown {name} {value!r}; choose from {', '.join(allowed)}")


def policy_args_from_model_arg(value) -> dict[str, str]:
    """`"window:64;kernel:5"` (or a mapping, from JSON model args) -> {"window": "64", "kernel": "5"}."""
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    args = {}
    for item in filter(None, (part.strip() for part in str(value).split(";"))):
        key, sep, text = item.partition(":")
        if not sep or not key.strip():
            raise EvalkitError(f"policy_args must be KEY:VALUE pairs separated by ';' (e.g. "
                               f"policy_args=window:64;kernel:5), got {item!r}")
        args[key.strip()] = text.strip()
    return args


@register_model(MODEL_NAME)
class EvalkitLM(TemplateLM):
    """lm-eval's LM interface over evalkit's generation loop and sparse KV cache.

    `pretrained` and `tokenizer` may also be an already-loaded transformers model and tokenizer.
    Every answered request is recorded (`records`) and reported through `get_model_info`, which
    lm-eval stores in `results["config"]["evalkit"]`; `save_run` writes it to runs/.
    """

    def __init__(self, pretrained=DEFAULT_MODEL, tokenizer=None, **model_args):
        super().__init__()
        loaded = not isinstance(pretrained, str)
        if loaded and tokenizer is None:
            raise EvalkitError("a loaded model needs its tokenizer: pass tokenizer=...")
        self.options = AdapterConfig.from_args(pretrained=None if loaded else pretrained,
                                               tokenizer=tokenizer if isinstance(tokenizer, str) else None,
                                               **model_args)
        if loaded:
            self.options.pretrained = getattr(pretrained.config, "_name_or_path", "") or type(pretrained).__name__
        self.policy = make_policy(self.options.policy, self.options.granularity, self.options.policy_args)
        # Everything above refuses bad input; only now is a model loaded.
        if loaded:
            self._model = pretrained.eval()
        else:
            self._model, tokenizer_loaded = models.load_model(self.options.pretrained, self.options.dtype,
                                                              self.options.device)
            tokenizer = tokenizer or tokenizer_loaded
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(models.model_source(tokenizer))
        self.tokenizer = tokenizer
        self._device = self._model.device
        self.records: list[dict] = []
        self.seconds = 0.0

    # -- lm-eval plumbing ------------------------------------------------------------------

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        # lm-eval adds its CLI defaults (batch_size=1, device=cuda:0) here; model args win over them.
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @property
    def model(self):
        return self._model

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.options.max_length or resolve_max_length(self._model.config, self.tokenizer)

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As lm-eval's hf model: the tokenizer's default special tokens unless told, none if the
        text already starts with the prefix token."""
        if add_special_tokens is None:
            add_special_tokens = self.options.add_bos_token
            if string.startswith(self.tokenizer.decode(self.prefix_token_id)):
                add_special_tokens = False
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def get_model_info(self) -> dict:
        """Called by lm-eval once evaluation is done; lands in results["config"]["evalkit"]."""
        return {RESULTS_KEY: {"args": asdict(self.options), "policy": repr(self.policy),
                              "model_class": type(self._model).__name__,
                              "summary": {**summarize(self.records), "seconds": self.seconds},
                              "predictions": list(self.records)}}

    def settings(self, temperature: float = 0.0) -> GenerationSettings:
        c = self.options
        return GenerationSettings(policy=self.policy, budget=c.budget, layout=c.layout, block_size=c.block_size,
                                  prefill=c.prefill, chunk_size=c.chunk_size, query_aware=c.query_aware,
                                  decode_eviction=c.decode_eviction, temperature=temperature, seed=c.seed,
                                  pool_pages=c.pool_pages, kernels=c.kernels)

    def _question_tokens(self, context: str, context_tokens: int) -> int:
        """Query-agnostic: how many trailing context tokens are the question (never compressed).

        Counted by tokenising the text after the last marker on its own: the tokens fed stay the
        context's own, only the split point may move by a token at the boundary.
        """
        if self.options.query_aware or self.options.question_marker not in context:
            return 0
        tail = context[context.rindex(self.options.question_marker):]
        return min(len(self.tok_encode(tail, add_special_tokens=False)), context_tokens - 1)

    def _record(self, kind: str, request, result, score) -> None:
        """One predictions.jsonl line: what was asked (hashed), answered, and how much cache it kept."""
        digest = hashlib.sha256(json.dumps(request.args, default=str).encode()).hexdigest()[:12]
        self.records.append({
            "type": kind, "task": request.task_name, "doc_id": request.doc_id, "idx": request.idx, "id": digest,
            "result": result, "prompt_tokens": score.prompt_tokens, "kept_tokens": score.kept_tokens,
            "bytes_held": score.bytes_held, "bytes_ideal": score.bytes_ideal, "bytes_full": score.bytes_full,
        })

    # -- the three request types ---------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        items = []
        for request in requests:
            context, continuation = request.args
            if context == "":
                cont = self.tok_encode(continuation, add_special_tokens=False)
                ctx, cont = ([self.prefix_token_id], cont) if cont[0] != self.prefix_token_id else (cont[:1], cont[1:])
            else:
                ctx, cont = self._encode_pair(context, continuation)
            if len(cont) > self.max_length:
                raise EvalkitError(f"a continuation of {len(cont)} tokens exceeds max_length {self.max_length}")
            ctx = (ctx + cont)[-(self.max_length + 1):][: -len(cont)]  # left-truncated as lm-eval's hf model
            split = len(ctx) - self._question_tokens(context, len(ctx))
            items.append(ScoreRequest(ctx[:split], ctx[split:], cont))
        scores = self._batched(items, lambda r: (tuple(r.context_ids + r.question_ids), tuple(r.continuation_ids[:-1])),
                               lambda batch: score_continuations(self._model, batch, self.settings()),
                               "loglikelihood", disable_tqdm)
        answers = []
        for request, score in zip(requests, scores):
            answer = (float(sum(score.logprobs)), score.greedy)
            self._record("loglikelihood", request, list(answer), score)
            self.cache_hook.add_partial("loglikelihood", request.args, answer)
            answers.append(answer)
        return answers

    def _loglikelihood_tokens(self, requests, **kwargs):
        """lm-eval's token-level entry: ((context, continuation), context ids, continuation ids)."""
        items = [ScoreRequest(list(ctx), [], list(cont)) for _, ctx, cont in requests]
        scores = score_continuations(self._model, items, self.settings())
        return [(float(sum(s.logprobs)), s.greedy) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows = []  # (request index, window tokens, tokens scored)
        for index, request in enumerate(requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(request.args[0]), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((index, ctx + cont, len(cont)))
        scores = self._batched(windows, lambda w: (tuple(w[1]), w[2]),
                               lambda batch: score_rolling(self._model, [w[1] for w in batch], [w[2] for w in batch],
                                                           self.settings()),
                               "loglikelihood_rolling", disable_tqdm)
        totals = [0.0] * len(requests)
        per_request: list[list] = [[] for _ in requests]
        for (index, _, _), score in zip(windows, scores):
            totals[index] += float(sum(score.logprobs))
            per_request[index].append(score)
        for request, total, window_scores in zip(requests, totals, per_request):
            self._record("loglikelihood_rolling", request, total, _mean_score(window_scores))
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            by_kwargs.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        for indices in by_kwargs.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = kwargs.pop("max_gen_toks")
            sampling = kwargs.pop("do_sample", False)
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            temperature = temperature if sampling else 0.0
            if kwargs:
                log.warning("evalkit ignores generation kwargs %s", sorted(kwargs))
            room = self.max_length - max_gen
            if room < 1:
                raise EvalkitError(f"max_gen_toks {max_gen} leaves no room for a prompt in max_length "
                                   f"{self.max_length}")
            items = []
            for index in indices:
                context = requests[index].args[0]
                ids = self.tok_encode(context)[-room:]
                split = len(ids) - self._question_tokens(context, len(ids))
                items.append(Request(ids[:split], ids[split:], max_gen, tuple(s for s in until if s)))
            settings = self.settings(temperature)
            gens = self._batched(items, None, lambda batch: generate(self._model, self.tokenizer, batch, settings),
                                 "generate_until", disable_tqdm)
            for index, gen in zip(indices, gens):
                text = postprocess_generated_text(gen.text, until, None)
                results[index] = text
                self._record("generate_until", requests[index], text, gen)
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
        return results

    def _batched(self, items: list, key, run, kind: str, disable_tqdm: bool) -> list:
        """Run `items` longest first, `batch_size` distinct `key`s per batch (items sharing a key share
        one pass, as multiple-choice answers do); results in the original order."""
        def size(item):
            if isinstance(item, tuple):
                return len(item[1])
            return sum(len(getattr(item, name, ())) for name in ("context_ids", "question_ids", "continuation_ids"))

        order = sorted(range(len(items)), key=lambda i: -size(items[i]))
        if key is not None:  # members of one key adjacent, in first-seen order
            first: dict = {}
            for i in order:
                first.setdefault(key(items[i]), len(first))
            order.sort(key=lambda i: first[key(items[i])])
        results: list = [None] * len(items)
        batch: list[int] = []
        keys: set = set()
        bar = tqdm(total=len(items), desc=f"evalkit {kind}", disable=disable_tqdm)

        def flush():
            start = time.perf_counter()
            for i, result in zip(batch, run([items[i] for i in batch])):
                results[i] = result
            self.seconds += time.perf_counter() - start
            bar.update(len(batch))
            batch.clear()
            keys.clear()

        for i in order:
            k = key(items[i]) if key is not None else i
            if k not in keys and len(keys) == self.options.batch_size:
                flush()
            batch.append(i)
            keys.add(k)
        if batch:
            flush()
        bar.close()
        return results


@dataclass
class _Stats:
    prompt_tokens: float
    kept_tokens: float
    bytes_held: float
    bytes_ideal: float
    bytes_full: float


def _mean_score(scores) -> _Stats:
    """Per-window statistics of a rolling request, averaged over its windows."""
    n = max(1, len(scores))
    return _Stats(*(sum(getattr(s, name) for s in scores) / n
                    for name in ("prompt_tokens", "kept_tokens", "bytes_held", "bytes_ideal", "bytes_full")))


def summarize(records: list[dict]) -> dict:
    """Kept-token and KV-byte statistics over every answered request."""
    n = len(records)
    if not n:
        return {"requests": 0}

    def total(key):
        return sum(r[key] for r in records)

    return {
        "requests": n,
        **{f"requests_{kind}": sum(r["type"] == kind for r in records)
           for kind in ("loglikelihood", "loglikelihood_rolling", "generate_until")},
        "prompt_tokens": total("prompt_tokens") / n,
        "kept_tokens": total("kept_tokens") / n,
        "kept_over_prompt": total("kept_tokens") / max(1e-9, total("prompt_tokens")),
        "bytes_held": total("bytes_held") / n,
        "bytes_ideal": total("bytes_ideal") / n,
        "bytes_full": total("bytes_full") / n,
        "held_over_full": total("bytes_held") / max(1, total("bytes_full")),
        "held_over_ideal": total("bytes_held") / max(1, total("bytes_ideal")),
    }


# -- results in runs/ ----------------------------------------------------------------------

def save_run(results: dict, out: str | Path = "runs", wandb_mode: str | None = None,
             warn: Callable[[str], None] = log.warning) -> Path:
    """Write lm-eval's results of a `--model evalkit` evaluation to `out/<run_id>/`, then mirror them to
    W&B (`wandb_mode`, decided beforehand; None: decided now as `--wandb auto`); W&B trouble is one `warn`.

    config.json: the adapter's resolved args, tasks, lm-eval settings and package versions;
    metrics.json: lm-eval's per-task numbers flattened as "<task>/<metric>,<filter>", plus the
    kept-token and KV-byte statistics; predictions.jsonl: one line per request. An existing folder
    of the same run id is replaced (metrics.json, the completion mark, goes first and comes last).
    """
    info = (results or {}).get("config", {}).get(RESULTS_KEY)
    if info is None:
        raise EvalkitError("these lm-eval results do not come from --model evalkit: nothing to save")
    tasks = sorted(results.get("configs") or results.get("results", {}))
    lm_config = results["config"]
    # Without hyper-parameters the id is what it was before policy_args existed.
    left_out = ("batch_size",) + (() if info["args"].get("policy_args") else ("policy_args",))
    identity = {**{k: v for k, v in info["args"].items() if k not in left_out}, "tasks": tasks,
                "limit": lm_config.get("limit"), "n-shot": results.get("n-shot"),
                "gen_kwargs": lm_config.get("gen_kwargs")}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:8]
    label = tasks[0] if len(tasks) == 1 else f"{tasks[0]}+{len(tasks) - 1}" if tasks else "none"
    run_id = f"lm_eval-{label}-{info['args']['policy']}-{info['args']['budget']}-{digest}"
    versions = package_versions(_PACKAGES)
    config = {
        "config": {**info["args"], "task": "lm_eval:" + ",".join(tasks)},
        "kind": "lm_eval", "run_id": run_id, "tasks": tasks, "policy": info["policy"],
        "model_class": info.get("model_class"), "model_args": lm_config.get("model_args"),
        "lm_eval": {"limit": lm_config.get("limit"), "n-shot": results.get("n-shot"),
                    "gen_kwargs": lm_config.get("gen_kwargs"), "versions": results.get("versions"),
                    "random_seed": lm_config.get("random_seed")},
        "versions": versions, "python": platform.python_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    metrics = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for name, value in values.items():
                if name not in ("alias", "name"):
                    metrics[f"{task}/{name}"] = value.item() if hasattr(value, "item") else value
    metrics.update(info["summary"])

    run_dir = RunDir(out, run_id)
    with run_dir.locked():
        run_dir.metrics_path.unlink(missing_ok=True)
        run_dir.start(config)
        tmp = run_dir.predictions_path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as file:  # one write and one fsync: lm-eval runs have thousands of requests
            file.writelines(json.dumps(record, sort_keys=True, default=str) + "\n" for record in info["predictions"])
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, run_dir.predictions_path)
        write_json_atomic(run_dir.metrics_path, metrics)
    mode = wandb_mode or decide_wandb_mode("auto", warn)
    log_run(mode, run_dir.path, run_id, config, metrics, info["predictions"], warn)
    return run_dir.path


@contextlib.contextmanager
def _saving_runs(out: str | Path, wandb_mode: str, warn: Callable[[str], None]):
    """While lm-eval's CLI runs, save every evalkit result it computes to `out` as soon as it has it,
    then drop the per-request records from it (lm-eval's own output files stay their usual size).
    The tasks' data is loaded before the model, so a task that cannot load costs no model load.
    The CLI looks `simple_evaluate` up on the `lm_eval` package at call time: wrapped there, restored after.
    Yields (run folders saved, a list that is non-empty once lm-eval's own input checks have passed)."""
    import lm_eval
    from lm_eval import evaluator

    saved: list[Path] = []
    started: list[bool] = []
    real = evaluator.simple_evaluate

    def simple_evaluate(*args, **kwargs):
        started.append(True)
        if kwargs.get("model") == MODEL_NAME and kwargs.get("tasks") and kwargs.get("task_manager") is not None:
            kwargs["tasks"] = _load_tasks(kwargs["tasks"], kwargs["task_manager"])
        results = real(*args, **kwargs)
        if results is not None and RESULTS_KEY in results.get("config", {}):
            saved.append(save_run(results, out, wandb_mode, warn))
            results["config"][RESULTS_KEY].pop("predictions", None)
        return results

    previous = vars(lm_eval).get("simple_evaluate")
    lm_eval.simple_evaluate = simple_evaluate
    try:
        yield saved, started
    finally:
        if previous is None:
            del lm_eval.simple_evaluate  # back to the package's lazy lookup
        else:
            lm_eval.simple_evaluate = previous


def _load_tasks(tasks: list, task_manager) -> list:
    """The requested tasks and groups, built (data included) now rather than after the model is loaded;
    lm-eval takes the built objects as they are."""
    try:
        loaded = task_manager.load(tasks)
    except Exception as error:  # datasets and lm-eval raise many types; all mean "this task cannot load"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise EvalkitError(f"cannot load lm-eval tasks {_names(tasks)}: {type(error).__name__}"
                           + (f": {reason}" if reason else "")) from None
    members = {name for children in loaded["group_map"].values() for name in children}
    return [built for name, built in {**loaded["groups"], **loaded["tasks"]}.items() if name not in members]


def _names(tasks: list) -> str:
    """Task names as lm-eval's CLI resolved them: names, or the configs of YAML files."""
    return ", ".join(str(t.get("task", t)) if isinstance(t, dict) else str(t) for t in tasks)


@contextlib.contextmanager
def _argv(argv: list[str]):
    previous = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = previous


def lm_eval_argv(argv: list[str]) -> tuple[list[str], bool]:
    """lm-eval's CLI arguments with `--model evalkit` implied and its model args checked now, before
    lm-eval indexes its tasks; and whether they evaluate `--model evalkit`. For the embedded default
    model, its tokenizer folder is added as `tokenizer=`: tasks that build their own data (RULER) load
    the tokenizer by that name, and the default's short name is not a hub id."""
    import argparse

    from lm_eval._cli.utils import MergeDictAction

    argv = list(argv)
    if argv[:1] in (["ls"], ["validate"]):
        return argv, False
    head, argv = (argv[:1], argv[1:]) if argv[:1] == ["run"] else ([], argv)
    # The options that matter here, read by lm-eval's own rules for --model_args (key=val or JSON).
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    peek.add_argument("--model", "-M")
    peek.add_argument("--config", "-C")
    peek.add_argument("--model_args", "-a", nargs="+", action=MergeDictAction)
    peek.add_argument("--tasks", "-t", nargs="+")
    peek.add_argument("--help", "-h", action="store_true")
    try:
        known, _ = peek.parse_known_args(argv)
    except argparse.ArgumentError as error:
        raise EvalkitError(f"lm-eval: {error}") from None
    if known.model is None and known.config is None:
        argv = ["--model", MODEL_NAME, *argv]
        known.model = MODEL_NAME
    if known.model != MODEL_NAME or known.help:
        return head + argv, False
    if not known.tasks and known.config is None:
        raise EvalkitError("lm-eval needs --tasks NAME[,NAME...] (`evalkit lm-eval ls tasks` lists them)")
    model_args = dict(known.model_args or {})
    AdapterConfig.from_args(**model_args)
    if model_args.get("pretrained", DEFAULT_MODEL) == DEFAULT_MODEL and "tokenizer" not in model_args:
        from evalkit.assets import default_model_dir

        argv += ["--model_args", f"tokenizer={default_model_dir()}"]
    return head + argv, True


def _take_option(argv: list[str], flag: str, default: str) -> tuple[str, list[str]]:
    """(value of `flag VALUE` or `flag=VALUE`, argv without it): evalkit's options, unknown to lm-eval."""
    for i, arg in enumerate(argv):
        if arg == flag:
            if i + 1 == len(argv):
                raise EvalkitError(f"{flag} needs a value")
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return default, argv


def main(argv: list[str]) -> int:
    """`evalkit lm-eval ARGS`: lm-eval's own CLI (`lm_eval ARGS`) with `--model evalkit` registered and
    implied, plus `--out DIR` (default runs), where each evaluation's run folder is written, and
    `--wandb MODE` (as `evalkit run`'s, default auto)."""
    from lm_eval.__main__ import cli_evaluate

    def say(line: str) -> None:
        print(line, file=sys.stderr)

    started: list[bool] = []
    try:
        out, argv = _take_option(list(argv), "--out", "runs")
        wandb, argv = _take_option(argv, "--wandb", "auto")
        _choice("wandb", wandb, WANDB_MODES)
        lm_argv, ours = lm_eval_argv(argv)
        mode = "off"
        if ours:
            check_writable_folder(out, "--out")
            mode = decide_wandb_mode(wandb, lambda line: say(f"note: {line}"))
        with _argv(["lm-eval", *lm_argv]), _saving_runs(out, mode, lambda line: say(f"warning: {line}")) \
                as (saved, started):
            cli_evaluate()
    except EvalkitError as error:
        say(f"error: {error}")
        return 2
    except SystemExit as done:  # argparse: --help, usage errors
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except (ValueError, TypeError, OSError) as error:
        if started:  # past lm-eval's input checks: a fault, not bad input
            raise
        # lm-eval's own checks of its arguments (no --tasks, unknown tasks, a bad --config file) raise these.
        say(f"error: lm-eval: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}")
        return 2
    for path in saved:
        print(f"evalkit results: {path}")
    return 0
