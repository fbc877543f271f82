"""Tasks a run is made from: registered names, and user data files."""

from __future__ import annotations

from evalkit.tasks.base import TASKS, Task


def make_task(config) -> Task:
    task = TASKS.create(config.task)
    return task.with_args(config.task_args) if config.task_args else task
