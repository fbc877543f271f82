"""Policies by name. Importing this package registers every built-in policy."""

from evalkit.policies.arguments import policy_args
from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import POLICIES, make_policy
from evalkit.policies.budget import Budget, fraction_of, parse_budget, tokens_for
from evalkit.policies.selection import GRANULARITIES, PAGE_GRANULARITIES, keep_mask
from evalkit.policies import (  # noqa: F401  (registration; the wrappers after the scorers they wrap)
    duo_attention, expected_attention, full, h2o, keydiff, knorm, kvzip, lagkv, pyramidkv, quest, random_policy, snapkv,
    streaming_llm, tova,
)
from evalkit.policies import adakv, critical  # noqa: F401,E402
from evalkit.policies.adakv import select_adaptive  # noqa: E402

__all__ = ["GRANULARITIES", "PAGE_GRANULARITIES", "POLICIES", "Budget", "Policy", "ScoreInput", "fraction_of",
           "keep_mask", "make_policy", "parse_budget", "policy_args", "select_adaptive", "tokens_for"]
