from evalkit.tasks.base import TASKS, PromptLength, Sample, Task, Turn
from evalkit.tasks import long_answer, longbench, niah_grid, ppl, multiturn, ruler, ruler_niah  # noqa: F401  (registers tasks)

__all__ = ["TASKS", "PromptLength", "Sample", "Task", "Turn"]
