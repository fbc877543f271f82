"""The results store: `runs/<run_id>/{config.json, predictions.jsonl, metrics.json}`.

Crash safety: config and metrics are written to a temporary file and renamed;
a prediction is one appended, fsynced line, and a torn last line from a killed
run is cut off when the run resumes. A run is complete iff metrics.json exists.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path


def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


class RunDir:
    def __init__(self, root: str | Path, run_id: str):
        self.path = Path(root) / run_id
        self.config_path = self.path / "config.json"
        self.predictions_path = self.path / "predictions.jsonl"
        self.metrics_path = self.path / "metrics.json"

    @property
    def complete(self) -> bool:
        return self.metrics_path.exists()

    def start(self, config: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.config_path, config)

    def predictions(self) -> list[dict]:
        """Recorded predictions, after cutting a torn last line left by a killed run."""
        if not self.predictions_path.exists():
            return []
        raw = self.predictions_path.read_bytes()
        whole = raw[: raw.rfind(b"\n") + 1]
        if len(whole) != len(raw):
            with open(self.predictions_path, "r+b") as file:
                file.truncate(len(whole))
        return [json.loads(line) for line in whole.decode().splitlines() if line.strip()]

    def append(self, record: dict) -> None:
        with open(self.predictions_path, "a") as file:
            file.write(json.dumps(record, sort_keys=True) + "\n")
            file.flush()
            os.fsync(file.fileno())

    def finish(self, metrics: dict) -> None:
        write_json_atomic(self.metrics_path, metrics)

    def metrics(self) -> dict:
        return json.loads(self.metrics_path.read_text())


def complete_runs(root: str | Path) -> list[tuple[dict, dict]]:
    """(config, metrics) of every complete run under `root`."""
    found = []
    for metrics_path in sorted(Path(root).glob("*/metrics.json")):
        config_path = metrics_path.with_name("config.json")
        if config_path.exists():
            found.append((json.loads(config_path.read_text()), json.loads(metrics_path.read_text())))
    return found


def package_versions(packages: tuple[str, ...]) -> dict[str, str | None]:
    """Installed versions, for a run's config.json (None where a package is absent)."""
    versions = {}
    for package in packages:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions
