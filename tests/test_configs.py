"""The committed sweep configs (configs/): each plans its grid, and `make study` runs every grid of the study."""
import re
from pathlib import Path

import pytest

from evalkit.sweep.plan import read_config_file
from helpers import evalkit

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


@pytest.mark.model  # the committed configs' sweeps resolve their models (Gemma 3 270M's too) to plan
@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: str(path.relative_to(ROOT / "configs")))
def test_every_committed_config_plans_its_grid(monkeypatch, capsys, tmp_path, config):
    """A typo in a committed config (a task, a policy, a field, a length over the model's window) fails here,
    not when its sweep reaches the cell hours in."""
    out = tmp_path / "runs"
    code, stdout, err = evalkit(monkeypatch, capsys, "sweep", "--config", str(config), "--out", str(out),
                                "--dry-run", "--wandb", "off")
    assert code == 0, err
    cells = int(re.search(r"sweep-[0-9a-f]{8}: (\d+) cells", stdout).group(1))
    assert cells == _cells_in(read_config_file(config))  # no list collapsed into fewer cells
    assert not out.exists()  # a dry run writes nothing


def _cells_in(settings: dict) -> int:
    """Each task × length: every policy at every budget, and the full cache once (its baseline)."""
    def values(key):
        value = settings[key]
        return value if isinstance(value, list) else [part for part in str(value).split(",") if part.strip()]

    evicting = [policy for policy in values("policies") if policy != "full"]
    return len(values("tasks")) * len(values("length")) * (len(evicting) * len(values("budgets")) + 1)


def test_make_study_runs_every_grid_of_the_study():
    """A grid added to configs/study/ is one `make -j2 study` runs, and every target there names a config."""
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    targets = re.search(r"^STUDY := (.*)$", makefile, re.M).group(1).split()
    assert len(targets) == len(set(targets))
    study = {f"study-{path.stem}" for path in (ROOT / "configs" / "study").glob("*.yaml")}
    assert study <= set(targets), sorted(study - set(targets))
    for target in targets:
        folder, name = target.split("-", 1)
        assert (ROOT / "configs" / folder / f"{name}.yaml").is_file(), target
