"""The scorers a wrapper (`adakv_<name>`, `critical_<name>`) can take: every policy whose score ranks
tokens by what they are worth. Position-only (StreamingLLM), random, read-restricting (Quest) and
layer-allocating (PyramidKV) policies are not among them."""

from evalkit.policies.expected_attention import ExpectedAttention
from evalkit.policies.h2o import H2O
from evalkit.policies.keydiff import KeyDiff
from evalkit.policies.knorm import KeyNorm
from evalkit.policies.lagkv import LagKV
from evalkit.policies.snapkv import SnapKV
from evalkit.policies.tova import TOVA

SCORERS = {"h2o": H2O, "snapkv": SnapKV, "tova": TOVA, "knorm": KeyNorm, "keydiff": KeyDiff, "lagkv": LagKV,
           "expected_attention": ExpectedAttention}
