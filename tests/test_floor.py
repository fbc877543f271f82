"""The hidden-answer floor: with the whole cache the default model finds RULER's single needles at 2k tokens.

If this fails, the generation loop, the prompt, the length fitting or the
task lost the answer somewhere, and every policy's number below it means
nothing. Chance is about zero: the answer is a random seven-digit number.
"""

import json

import pytest

from evalkit.config import RunConfig
from evalkit.runner import run

pytestmark = pytest.mark.model  # runs the default model on RULER's needles at 2k tokens

LENGTH, SAMPLES = 2048, 4

# Measured on the reference machine (2 CPU cores, fp32), 4 of 4 needles found for each task
# (depths 0, 33, 67 and 100%), with:
#   evalkit run --policy full --budget 1.0 --task ruler:niah_single_1 --length 2048 --samples 4 --wandb off
#   evalkit run --policy full --budget 1.0 --task ruler:niah_single_2 --length 2048 --samples 4 --wandb off
# (and with --samples 10: 10 of 10 for each). The floor allows one miss, for rounding on other hardware.
FLOOR = 0.75


@pytest.mark.parametrize("task", ["ruler:niah_single_1", "ruler:niah_single_2"])
def test_the_full_cache_finds_the_needle(task, tmp_path):
    config = RunConfig(policy="full", budget=1.0, task=task, length=LENGTH, samples=SAMPLES, out=str(tmp_path),
                       wandb="off")
    result = run(config)
    records = [json.loads(line) for line in (tmp_path / result.run_id / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == SAMPLES and all(r["kept_tokens"] == r["prompt_tokens"] for r in records)
    assert all(LENGTH - 200 < r["prompt_tokens"] + 128 <= LENGTH for r in records)  # really 2k-token prompts
    assert result.metrics["score"] >= FLOOR, [(r["references"], r["prediction"]) for r in records]
