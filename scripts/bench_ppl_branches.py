"""Token-by-token perplexity (chunks of one token) of configs/study/ppl_token_512.yaml's nine policies at budget
0.2 and the full cache, the default model, one random passage of LENGTH tokens, one torch thread: the ten
branches streamed together (`score_rolling_branches`, one forward a token for all) against one after another
(`score_rolling` each), timed in the order given (docs/sweeps.md).

    .venv/bin/python scripts/bench_ppl_branches.py LENGTH together apart together apart
"""
import sys
import time

import torch

from evalkit.loop import GenerationSettings, score_rolling, score_rolling_branches
from evalkit.models import load_model
from evalkit.policies import make_policy

torch.set_num_threads(1)
model, _ = load_model("smollm2-135m")
length = int(sys.argv[1])
seq = [torch.randint(0, 49000, (length,), generator=torch.Generator().manual_seed(0)).tolist()]
names = ["h2o_head", "h2o_head_page", "h2o_token", "h2o_page", "snapkv_head", "snapkv_head_page", "snapkv_token",
         "snapkv_page", "streaming_llm", "full"]
branches = [GenerationSettings(make_policy(n), budget=1.0 if n == "full" else 0.2, page_size=16, chunk_size=1)
            for n in names]
for mode in sys.argv[2:]:
    begun = time.perf_counter()
    if mode == "together":
        score_rolling_branches(model, seq, [length - 1], branches)
    else:
        for settings in branches:
            score_rolling(model, seq, [length - 1], settings)
    print(mode, f"{time.perf_counter() - begun:.1f} s", flush=True)
