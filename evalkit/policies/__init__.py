"""Policies by name. Importing this package registers every built-in policy."""

from evalkit.policies.base import GRANULARITIES, POLICIES, Policy, ScoreInput, make_policy, resolve_budget
from evalkit.policies.selection import select_keep
from evalkit.policies import full, h2o, random_policy, streaming_llm  # noqa: F401  (registration)

__all__ = ["GRANULARITIES", "POLICIES", "Policy", "ScoreInput", "make_policy", "resolve_budget", "select_keep"]
