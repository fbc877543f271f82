"""The generation loop: prefill, compression and decode through evalkit's own cache.

Modules, each importing only those above it in this list:
- `state`: settings, requests, generations, the loop's state and its one `forward`;
- `compression`: a batch's budgets (`Budgets`), the slots a policy keeps, eviction;
- `shared_prefill`: one prefill forked into several branches (a branch: one settings' policy, budget, ...);
- `generate`: prefill, then decode (`generate`, `start`, `Decoding`);
- `joint_decode`: branches decoding together, one forward per step;
- `teacher_forcing`: log-probabilities through the same cache (lm-eval, perplexity), branches streamed together;
- `conversation`: several turns on one compressed context (multi-turn tasks), branches' answers decoded together.
"""

from evalkit.loop.conversation import Conversation, converse, converse_branches
from evalkit.loop.generate import generate, start
from evalkit.loop.joint_decode import generate_branches
from evalkit.loop.shared_prefill import SharedPrefill, prefill_statistics, share_prefill, statistic_key
from evalkit.loop.state import Generation, GenerationSettings, Request
from evalkit.loop.teacher_forcing import Score, ScoreRequest, score_continuations, score_rolling, score_rolling_branches

__all__ = ["Conversation", "Generation", "GenerationSettings", "Request", "Score", "ScoreRequest", "SharedPrefill",
           "converse", "converse_branches", "generate", "generate_branches", "prefill_statistics", "score_continuations",
           "score_rolling", "score_rolling_branches", "share_prefill", "start", "statistic_key"]
