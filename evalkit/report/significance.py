"""Which differences in a report are real: each run against its full-cache baseline and against the same
scorer at the other granularities, paired on their samples (`uncertainty.compare`), Holm-corrected within a
scorer × budget (docs/statistics.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable


from evalkit.errors import EvalkitError
from evalkit.policies.names import policy_family
from evalkit.uncertainty import compare, holm
from evalkit.uncertainty.settings import ALPHA


@dataclass
class Test:
    other: str  # "full" or the other run's policy label
    difference: float  # this run's score minus the other's
    p_value: float  # Holm-adjusted within the run's family
    significant: bool


@dataclass
class Marks:
    """The paired tests of one run: against its baseline, and against its scorer's other granularities."""

    vs_full: Test | None = None
    vs_granularities: list[Test] = field(default_factory=list)

    def text(self, lower_is_better: bool = False) -> str:
        """`≠ full (p = 0.002); > snapkv_token (p = 0.01)`; `-` when nothing was tested."""
        tests = ([self.vs_full] if self.vs_full else []) + self.vs_granularities
        if not tests:
            return "-"
        shown = [f"{_sign(t, lower_is_better)} {t.other} (p = {t.p_value:.2g})" for t in tests if t.significant]
        return "; ".join(shown) if shown else "no difference found"


def _sign(test: Test, lower_is_better: bool) -> str:
    if test.other == "full":
        return "≠"
    better = (test.difference > 0) != lower_is_better
    return ">" if better else "<"


def significance(entries: list, records: Callable[[object], list[dict]], label: Callable[[dict], str],
                 variant_keys: tuple[str, ...]) -> dict[str, Marks]:
    """Marks by run id for `entries` (the report's, with `setting`, `config`, `run_id`, `is_full` and
    `baseline_entry`); `records(entry)` reads a run's predictions, `label(config)` names what ran."""
    families: dict[tuple, list] = {}
    for e in entries:
        if e.is_full:
            continue
        try:
            base, _ = policy_family(e.config["policy"], e.config.get("granularity"))
        except EvalkitError:  # a policy this evalkit does not know: a family of its own
            base = str(e.config["policy"])
        others = json.dumps({k: e.config.get(k) for k in variant_keys if k != "granularity"}, sort_keys=True,
                            default=str)
        families.setdefault((e.setting, base, json.dumps(e.config.get("budget")), others), []).append(e)
    marks: dict[str, Marks] = {e.run_id: Marks() for e in entries if not e.is_full}
    for members in families.values():
        pairs = [(e, e.baseline_entry, "full") for e in members if e.baseline_entry is not None]
        pairs += [(a, b, label(b.config)) for i, a in enumerate(members) for b in members[i + 1:]]
        tested = []
        for a, b, name in pairs:
            try:
                tested.append((a, b, name, compare(records(a), records(b), detect=None)))
            except EvalkitError:  # different samples (or too few): nothing paired to say
                continue
        if not tested:
            continue
        adjusted = holm([result.p_value for *_, result in tested])
        for (a, b, name, result), p in zip(tested, adjusted):
            test = Test(name, result.difference, float(p), bool(p < ALPHA))
            if name == "full":
                marks[a.run_id].vs_full = test
            else:
                marks[a.run_id].vs_granularities.append(test)
                marks[b.run_id].vs_granularities.append(Test(label(a.config), -result.difference, float(p), bool(p < ALPHA)))
    return marks
