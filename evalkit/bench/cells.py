"""What `evalkit bench` measures: the settings every cell of a benchmark shares (`BenchSettings`), one cell
(`BenchCell`: a loop, evalkit's under a policy or HF's `generate`, at one budget, layout and length) and the
grid of cells the options ask for (`grid_cells`). Measured by `evalkit.bench.generations`, compared by
`evalkit.bench.targets`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HF_LOOP = "hf"
EVALKIT_LOOP = "evalkit"
FULL = "full"


@dataclass(frozen=True)
class BenchSettings:
    """What every cell of one benchmark shares; results measured under other settings are not reused."""

    model: str
    new_tokens: int
    batch: int
    repeats: int
    block_size: int
    dtype: str
    device: str
    seed: int
    threads: int  # torch threads in each measurement; 0: torch's default (one per core)
    decode_eviction: bool = True  # keep the cache at budget while decoding (one eviction per token), as `run` does
    policy_args: dict = field(default_factory=dict)  # `--policy-arg` hyper-parameters for every policy


@dataclass(frozen=True)
class BenchCell:
    """One measurement of the grid: a loop (evalkit's under a policy, or HF's) at one budget, layout and length."""

    loop: str  # EVALKIT_LOOP or HF_LOOP
    policy: str  # FULL for the full cache; HF_LOOP for the baseline
    budget: float | int
    layout: str  # "paged", "dense"; HF's own cache for the baseline
    length: int  # prompt + new tokens
    granularity: str | None = None  # None: the policy's own

    @property
    def key(self) -> str:
        key = f"{self.loop}/{self.policy}/{self.budget}/{self.layout}/{self.length}"
        return key + (f"/{self.granularity}" if self.granularity else "")

    @property
    def label(self) -> str:
        if self.loop == HF_LOOP:
            return "HF generate"
        name = self.policy + (f"[{self.granularity}]" if self.granularity else "")
        return name if self.policy == FULL else f"{name} @ {self.budget}"


def grid_cells(policies: list[str], budgets: list, layouts: list[str], lengths: list[int],
               granularities: list[str | None] = (None,)) -> list[BenchCell]:
    """Per length: HF's baseline, the full cache on every layout, then every policy × granularity × budget ×
    layout (granularity None: the policy's own)."""
    cells = []
    for length in lengths:
        cells.append(BenchCell(HF_LOOP, HF_LOOP, 1.0, "hf", length))
        cells += [BenchCell(EVALKIT_LOOP, FULL, 1.0, layout, length) for layout in layouts]
        cells += [BenchCell(EVALKIT_LOOP, policy, budget, layout, length, granularity)
                  for policy in policies if policy != FULL for granularity in granularities
                  for budget in budgets for layout in layouts]
    return cells
