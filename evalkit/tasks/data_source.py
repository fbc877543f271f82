"""Where a data task's records come from: a JSON Lines file, read lazily, or a dataset split
(`datasets.load_dataset`, or a folder written by `Dataset.save_to_disk`)."""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from evalkit.errors import EvalkitError


@dataclass(frozen=True)
class DataSource:
    """Where records come from: a JSON Lines file, or a dataset split."""

    kind: str  # "jsonl" or "hf"
    name: str  # jsonl: the file's absolute path; hf: a dataset name, or a local folder's absolute path
    config: str | None = None  # hf only
    split: str | None = None  # hf only

    @classmethod
    def parse(cls, task: str) -> "DataSource":
        kind, _, rest = task.partition(":")
        if kind == "jsonl":
            path = Path(rest).expanduser()
            if not rest or not path.exists():
                raise EvalkitError(f"no data file {rest!r} (--task jsonl:PATH)")
            if not path.is_file():
                raise EvalkitError(f"{rest} is not a file (--task jsonl:PATH)")
            return cls("jsonl", str(path.resolve()))
        parts = rest.split(":")
        if len(parts) not in (2, 3) or not all(parts):
            raise EvalkitError(f"a dataset task is hf:NAME[:CONFIG]:SPLIT, got {task!r}")
        name = Path(parts[0]).expanduser()
        # datasets reads an existing local folder before asking the hub, so the folder is the identity.
        return cls("hf", str(name.resolve()) if name.exists() else parts[0],
                   parts[1] if len(parts) == 3 else None, parts[-1])

    @property
    def task(self) -> str:
        """The task's canonical name, as stored in the run's config."""
        if self.kind == "jsonl":
            return f"jsonl:{self.name}"
        return ":".join(["hf", self.name, *([self.config] if self.config else []), self.split])

    def read(self, stop: int | None = None) -> list[dict]:
        """The first `stop` records (all with None); a JSONL file is read no further than them."""
        if self.kind == "jsonl":
            stat = Path(self.name).stat()
            return _read_cached(self, (stat.st_mtime_ns, stat.st_size), stop)
        return _read_cached(self, None, None)[:stop]


@functools.lru_cache(maxsize=4)
def _read_cached(source: DataSource, stamp, stop: int | None) -> list[dict]:
    """Read once per process and file version: a run checks its data when validating its config
    and reads it again to build the task."""
    if source.kind == "jsonl":
        return list(itertools.islice(iter_jsonl(Path(source.name)), stop))
    return _read_dataset(source)


def iter_jsonl(path: Path) -> Iterator[dict]:
    """The JSON objects of a JSON Lines file, read line by line as they are asked for; blank lines skipped, a
    bad line refused with its number. Lines are split as bytes: str.splitlines would also split at U+2028
    inside a JSON string."""
    number = 0
    with open(path, "rb") as file:
        for chunk in file:  # split at b"\n"; splitlines also at a bare b"\r"
            for raw in chunk.splitlines():
                number += 1
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise EvalkitError(f"{path}:{number}: not UTF-8 text") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise EvalkitError(f"{path}:{number}: not JSON ({error.msg})") from None
                if not isinstance(record, dict):
                    raise EvalkitError(f"{path}:{number}: a record is a JSON object, got {type(record).__name__}")
                yield record


def _read_dataset(source: DataSource) -> list[dict]:
    import datasets  # only hf: tasks need it, and it takes seconds to import

    bars_were_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # the CLI's stderr is for evalkit's own lines
    try:
        folder = Path(source.name)
        if (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file():
            data = _saved_split(source, datasets.load_from_disk(str(folder)))
        else:
            data = datasets.load_dataset(source.name, source.config, split=source.split)
    except EvalkitError:
        raise
    except Exception as error:  # a dataset that cannot be had is the user's environment: one line
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise EvalkitError(f"{source.task}: cannot load the dataset ({reason})") from None
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    return [dict(row) for row in data]


def _saved_split(source: DataSource, saved):
    """The split a `save_to_disk` folder holds under the name asked for."""
    if source.config:
        raise EvalkitError(f"{source.task}: a folder written by save_to_disk has no configs; "
                           f"use hf:{source.name}:{source.split}")
    if hasattr(saved, "keys"):  # a DatasetDict
        if source.split not in saved:
            raise EvalkitError(f"{source.task}: no split {source.split!r}; it has {', '.join(saved)}")
        return saved[source.split]
    if saved.split is not None and str(saved.split) != source.split:
        raise EvalkitError(f"{source.task}: the saved dataset is the {saved.split} split, not {source.split}")
    return saved
