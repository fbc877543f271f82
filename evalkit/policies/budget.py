"""Budgets: parsed, converted between fraction and tokens, and checked here and nowhere else.

One name per shape, everywhere in evalkit:
- `budget` (`Budget`): what the user gives: a fraction in (0, 1] of each prompt (`1` = everything) or a
  token count, an integer > 1, kept per layer and KV head.
- `tokens` [B]: the budget of each sequence in tokens per KV head (`tokens_for`).
- `caps` [L, B]: tokens per KV head of each layer and sequence, after the policy's allocator spread
  `tokens` over the layers (the cap `compress` evicts down to); flattened to [L·B] rows for selection.

The one-page rule of page granularities (`head_page`, `page`: whole pages or nothing) is decided here
too: a budget that keeps less than one page of the nominal prompt is refused before any work
(`check_budget`); where an allocator or a shorter prompt leaves a layer less than a page, that layer
keeps one page (`at_least_one_page`), since it could keep no whole page otherwise.
"""

from __future__ import annotations

import decimal
import re

import torch

from evalkit.errors import EvalkitError

Budget = float | int

# More positions than any model has: token counts at or above it are refused before any arithmetic on them
# overflows, a buffer is sized from them, or one lands in a run id (a folder name).
TOKEN_LIMIT = 2**31


def parse_budget(text: str | float | int) -> Budget:
    """A fraction in (0, 1] of the prompt ('0.2', '1', '1.0') or a token count, an integer > 1 ('512')."""
    raw = str(text).strip()
    if re.fullmatch(r"[+-]?\d+", raw):
        value = int(raw)
        if value <= 0:
            raise EvalkitError(f"budget must be > 0, got {raw}")
        if value >= TOKEN_LIMIT:
            raise EvalkitError(f"budget {raw} tokens is more than any model's window (the limit is 2**31)")
        return 1.0 if value == 1 else value
    try:
        value = float(raw)
    except ValueError:
        raise EvalkitError(f"budget must be a fraction in (0, 1] or a token count > 1, got {raw!r}") from None
    if not 0 < value <= 1:
        raise EvalkitError(
            f"budget {raw} is out of range: a fraction must be in (0, 1]; a token count must be an integer > 1"
        )
    return value


def tokens_for(budget: Budget, lengths: torch.Tensor) -> torch.Tensor:
    """tokens [B] kept per KV head: a fraction in (0, 1] of each length [B], or an integer count > 1."""
    if budget <= 1:
        # Rounded first so 0.07 * 100 (= 7.000000000000001 in floating point) keeps 7, not 8.
        kept = torch.ceil((lengths.double() * budget).round(decimals=9)).long()
    else:
        kept = torch.full_like(lengths, int(budget))
    return torch.minimum(kept.clamp(min=1), lengths)


def tokens_of(budget: Budget, length: int) -> int:
    """`tokens_for` of one prompt of `length` tokens."""
    return int(tokens_for(budget, torch.tensor([length]))[0])


def fraction_of(budget: Budget, prompt_tokens: float | None) -> float:
    """The budget as a fraction of the prompt: a fraction as is, a token count over the (mean) prompt."""
    if budget <= 1:
        return float(budget)
    return min(1.0, budget / max(1.0, prompt_tokens or 1.0))


def smallest_fraction(length: int) -> float:
    """The smallest budget fraction (3 significant digits, rounded up) that keeps one token of `length`."""
    return float(decimal.Context(prec=3, rounding=decimal.ROUND_CEILING).divide(1, length))


def check_budget(budget: Budget, length: int, page_size: int, page_granularity: str | None) -> None:
    """Refuse a budget that keeps nothing of a `length`-token prompt: less than one token, or, at a
    `page_granularity` (whole pages or nothing; None otherwise), less than one page."""
    if budget <= 1 and budget * length < 1 - 1e-9:
        raise EvalkitError(f"budget {budget} keeps less than one token of --length {length}: the "
                           f"smallest useful fraction is {smallest_fraction(length):g}, or give a token "
                           f"count such as {max(2, page_size)}")
    tokens = tokens_of(budget, length)
    if page_granularity is not None and tokens < min(page_size, length):
        raise EvalkitError(
            f"budget {budget} keeps {tokens} tokens per head of {length}, less than one page: at granularity "
            f"{page_granularity} the smallest budget is {page_size} tokens (block size) or "
            f"{page_size / length:.4g} of --length {length}")


def at_least_one_page(caps: torch.Tensor, lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """caps [L, B] raised to one page (or the whole prompt [B], if shorter) for whole-page selection."""
    return torch.maximum(caps, torch.minimum(lengths, torch.tensor(page_size)))
