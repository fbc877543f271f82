"""The results store: `runs/<run_id>/{config.json, predictions.jsonl, metrics.json}`.

Crash safety: config and metrics are written to a temporary file and renamed;
a prediction is one appended, fsynced line, and a torn last line from a killed
run is cut off when the run resumes. A run is complete iff metrics.json exists.
A write that fails (a full disk) leaves no temporary file and no partial line, and
is one line (`WriteFailed`, exit 1); the same command resumes once there is room.

One process at a time: whoever writes a run folder holds its lock (`RunDir.locked`,
an flock on `<run folder>/.lock`); a second process on the same folder waits for it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import tempfile
from importlib import metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from evalkit.errors import EvalkitError, WriteFailed


@contextlib.contextmanager
def _writing(path: Path, size: int, tmp: Path | None = None) -> Iterator[None]:
    """An OSError while writing `size` bytes to `path` (through `tmp`, removed) becomes one WriteFailed line."""
    try:
        yield
    except OSError as error:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise WriteFailed(f"no space left on the device of {path.parent}: writing {path.name} ({size:,} "
                              f"bytes) failed; free some space and run the same command again, it resumes") from None
        raise WriteFailed(f"cannot write {path}: {error.strerror or error}; the same command resumes once it "
                          f"can") from None


def write_json_atomic(path: Path, data) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
    tmp = path.with_suffix(path.suffix + ".tmp")
    with _writing(path, len(text.encode()), tmp):
        with open(tmp, "w") as file:
            file.write(text)
        os.replace(tmp, path)


def read_json(path: Path, kind: type = dict):
    """The JSON document at `path`, which must be a `kind`; anything else is one error naming the file."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as error:
        raise EvalkitError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise EvalkitError(f"{path} is not UTF-8 text") from None
    except ValueError as error:
        raise EvalkitError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(data, kind):
        raise EvalkitError(f"{path} holds a JSON {type(data).__name__}, not the {kind.__name__} evalkit writes")
    return data


def check_writable_folder(path: str | Path, flag: str) -> None:
    """Refuse an output folder that cannot be written (a file in its place or above it, no permission)
    before any work. Creates nothing: a temporary file in the nearest existing folder is made and removed."""
    if not str(path).strip():  # Path("") is the current folder: never what an empty option meant
        raise EvalkitError(f"{flag} is empty: give a folder, such as runs")
    _check_writable(Path(path), Path(path), flag)


def check_writable_file(path: str | Path, flag: str) -> None:
    """Refuse an output file that cannot be written, before any work; creates nothing."""
    path = Path(path)
    try:
        is_dir = path.is_dir()
    except (OSError, ValueError) as error:
        raise EvalkitError(f"{flag} {str(path)!r} is not a usable path: {getattr(error, 'strerror', None) or error}") \
            from None
    if is_dir:
        raise EvalkitError(f"{flag} {path} is a folder: give a file name, such as {path / 'niah_heatmaps.png'}")
    _check_writable(path.parent, path, flag)


def _check_writable(folder: Path, named: Path, flag: str) -> None:
    """`folder` (where `named`, as the user gave it, goes) can take new files."""
    try:
        existing = folder
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        is_dir = existing.is_dir()
    except (OSError, ValueError) as error:
        raise EvalkitError(f"{flag} {str(named)!r} is not a usable path: {getattr(error, 'strerror', None) or error}") \
            from None
    if not is_dir:
        raise EvalkitError(f"{flag} {named} is a file, not a folder" if existing == named else
                           f"{flag} {named} is inside {existing}, which is a file")
    try:
        fd, name = tempfile.mkstemp(dir=existing, prefix=".evalkit-write-test-")
        os.close(fd)
        os.unlink(name)
    except OSError as error:
        raise EvalkitError(f"{flag} {named} is not writable: {error.strerror or error}") from None


@dataclass
class Record:
    """One sample's line of predictions.jsonl, whatever the task: what it kept, held and took, and its score."""

    id: str
    prompt_tokens: float
    score: float
    kept_tokens: float
    bytes_held: float
    bytes_ideal: float
    bytes_full: float
    new_tokens: int
    attended_fraction: float
    meta: dict
    seconds: dict  # "prefill_seconds", "decode_seconds", ...: batch-wide, divided evenly over its samples
    task: dict  # the task's own: a generation's prediction and references, a passage's losses

    def as_dict(self) -> dict:
        common = {name: getattr(self, name) for name in self.__dataclass_fields__ if name not in ("seconds", "task")}
        return {**common, **self.task, **self.seconds}


class FolderBusy(Exception):
    """Another process holds a run folder's lock (`RunDir.locked(wait=False)`)."""


class RunDir:
    def __init__(self, root: str | Path, run_id: str):
        self.path = Path(root) / run_id
        self.config_path = self.path / "config.json"
        self.predictions_path = self.path / "predictions.jsonl"
        self.metrics_path = self.path / "metrics.json"
        self.lock_path = self.path / ".lock"

    @property
    def complete(self) -> bool:
        return self.metrics_path.exists()

    @contextlib.contextmanager
    def locked(self, waiting: Callable[[], None] | None = None, wait: bool = True) -> Iterator[None]:
        """Holds the folder's lock; a second process on the same folder waits here (`waiting` is called
        first), or with `wait=False` gets FolderBusy at once. The folder is created for the lock; if nothing
        was recorded in it by the time the lock is released (input refused after all), it is removed again,
        with any parent folders made for it."""
        made = [p for p in (self.path, *self.path.parents) if not p.exists()]
        while True:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    os.close(fd)
                    raise FolderBusy(self.path) from None
                if waiting:
                    waiting()
                fcntl.flock(fd, fcntl.LOCK_EX)
            # The holder before us unlinks the lock file when it is done: a lock on that old file guards
            # nothing, so take the current one instead.
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(self.lock_path))
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lock_path)
            if not self.config_path.exists():
                for folder in made:  # deepest first
                    with contextlib.suppress(OSError):
                        folder.rmdir()
            os.close(fd)

    def start(self, config: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.config_path, config)

    def predictions(self) -> list[dict]:
        """Recorded predictions, the first of each id. Reads only: a torn last line left by a killed run
        is skipped here and cut by `repair`."""
        return _unique(self._whole_records()[0])[0]

    def finished_predictions(self) -> list[dict]:
        """A complete run's predictions, as its finish left them: a torn last line or a repeated id means
        the file changed since, and is refused rather than read around."""
        records, whole_bytes = self._whole_records()
        if self.predictions_path.exists() and self.predictions_path.stat().st_size != whole_bytes:
            raise EvalkitError(f"{self.predictions_path} ends in a torn line: the run's records are incomplete")
        unique, repeated = _unique(records)
        if repeated:
            raise EvalkitError(f"{self.predictions_path} repeats {repeated} sample id(s): the run's records are "
                               "not one line a sample")
        return unique

    def repair(self) -> int:
        """Before resuming, under the lock: cuts a torn last line and drops lines that repeat an id (the
        first is kept). Returns how many repeated lines were dropped."""
        records, whole_bytes = self._whole_records()
        unique, dropped = _unique(records)
        if dropped:
            self.write_predictions(unique)
        elif self.predictions_path.exists() and self.predictions_path.stat().st_size != whole_bytes:
            with open(self.predictions_path, "r+b") as file:
                file.truncate(whole_bytes)
        return dropped

    def _whole_records(self) -> tuple[list[dict], int]:
        """(records of the complete lines, their length in bytes); a malformed complete line is an error."""
        if not self.predictions_path.exists():
            return [], 0
        raw = self.predictions_path.read_bytes()
        whole = raw[: raw.rfind(b"\n") + 1]
        records = []
        for number, line in enumerate(whole.split(b"\n")[:-1], 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except ValueError as error:  # UnicodeDecodeError is one
                raise EvalkitError(f"{self.predictions_path} line {number} is not a JSON record "
                                   f"({type(error).__name__})") from None
            if not isinstance(record, dict) or "id" not in record:
                raise EvalkitError(f"{self.predictions_path} line {number} is not a prediction record (no id)")
            records.append(record)
        return records, len(whole)

    def write_predictions(self, records: list[dict]) -> None:
        """All of predictions.jsonl at once (one write and one fsync), through a temporary file."""
        text = "".join(json.dumps(record, sort_keys=True, default=str) + "\n" for record in records)
        tmp = self.predictions_path.with_suffix(".jsonl.tmp")
        with _writing(self.predictions_path, len(text.encode()), tmp):
            with open(tmp, "w") as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, self.predictions_path)

    def append(self, record: dict) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        size = self.predictions_path.stat().st_size if self.predictions_path.exists() else 0
        try:
            with _writing(self.predictions_path, len(line.encode())):
                with open(self.predictions_path, "a") as file:
                    file.write(line)
                    file.flush()
                    os.fsync(file.fileno())
        except WriteFailed:
            with contextlib.suppress(OSError):  # what part of the line got in goes: the sample is not recorded
                os.truncate(self.predictions_path, size)
            raise

    def finish(self, metrics: dict) -> None:
        write_json_atomic(self.metrics_path, metrics)

    def metrics(self) -> dict:
        return read_json(self.metrics_path)


def _unique(records: list[dict]) -> tuple[list[dict], int]:
    seen, unique = set(), []
    for record in records:
        key = json.dumps(record["id"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(record)
    return unique, len(records) - len(unique)


def complete_runs(root: str | Path) -> list[tuple[dict, dict]]:
    """(config, metrics) of every complete, readable run under `root`."""
    found = []
    for metrics_path in sorted(Path(root).glob("*/metrics.json")):
        try:
            found.append((read_json(metrics_path.with_name("config.json")), read_json(metrics_path)))
        except EvalkitError:  # a damaged or foreign folder is no one's baseline
            continue
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
