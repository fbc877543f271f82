"""Policies by name. Importing this package registers every built-in policy."""

from evalkit.policies.base import POLICIES, Policy, ScoreInput, make_policy, policy_args, resolve_budget
from evalkit.policies.selection import GRANULARITIES, PAGE_GRANULARITIES, select_adaptive, select_keep
from evalkit.policies import (  # noqa: F401  (registration)
    adakv, full, h2o, knorm, pyramidkv, quest, random_policy, snapkv, streaming_llm, tova,
)

__all__ = ["GRANULARITIES", "PAGE_GRANULARITIES", "POLICIES", "Policy", "ScoreInput", "make_policy", "policy_args",
           "resolve_budget", "select_adaptive", "select_keep"]
