"""lm-evaluation-harness model `evalkit`: any lm-eval task, answered through evalkit's sparse KV cache.

Importing this module registers the model with lm-eval (`--model evalkit`). lm-eval's own CLI
does not import third-party models, so `evalkit lm-eval` (`lm_eval_command.main`) imports this module
and then runs that CLI. Model args: `lm_eval_options`.

How each request type reads the cache (budget, policy and layout as in `evalkit run`):
- `loglikelihood`: the context is prefilled and compressed under the policy, then the
  continuation is read through the sparse cache by teacher forcing: one token per forward with
  eviction after each, like decoding, when decode eviction is on (or a Quest-style read
  restriction applies); else in one forward. `score_continuations` in evalkit.loop.teacher_forcing.
- `loglikelihood_rolling`: lm-eval's rolling windows (first token predicted from the prefix
  token, windows of `max_length`); each window streamed in chunks of `chunk_size`, compressed
  after every chunk, loss on every token. `score_rolling` in evalkit.loop.teacher_forcing.
- `generate_until`: evalkit's generation loop (`generate`) with the request's stop sequences and
  `max_gen_toks`, prompts batched `batch_size` at a time.
At budget 1 all three equal lm-eval's own HF model (`--model hf`).

Query-agnostic (`query_aware=False`): an lm-eval context is one string, so its question is taken
to be the text after the last `question_marker` (default a newline); only what comes before is
compressed, and the budget is a fraction of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text,
                                  resolve_max_length)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from evalkit import models
from evalkit.assets import DEFAULT_MODEL
from evalkit.errors import EvalkitError
from evalkit.loop import GenerationSettings, Request, ScoreRequest, generate, score_continuations, score_rolling
from evalkit.integrations.lm_eval_options import MODEL_NAME, RESULTS_KEY, AdapterConfig
from evalkit.policies import make_policy

log = logging.getLogger(__name__)


@register_model(MODEL_NAME)
class EvalkitLM(TemplateLM):
    """lm-eval's LM interface over evalkit's generation loop and sparse KV cache.

    `pretrained` and `tokenizer` may also be an already-loaded transformers model and tokenizer.
    Every answered request is recorded (`records`) and reported through `get_model_info`, which
    lm-eval stores in `results["config"]["evalkit"]`; `lm_eval_command.save_run` writes it to runs/.
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
        return GenerationSettings.from_options(self.options, self.policy, temperature=temperature)

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
