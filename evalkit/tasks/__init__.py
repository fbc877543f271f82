from evalkit.tasks.base import TASKS, PromptLength, Sample, Task
from evalkit.tasks import longbench, niah_grid, ppl, ruler, ruler_niah  # noqa: F401  (registers tasks)

__all__ = ["TASKS", "PromptLength", "Sample", "Task"]
