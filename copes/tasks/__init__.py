"""Datasets as tasks: math (gsm8k, math, math500, aime24, aime25), multi-hop QA (hotpotqa, 2wiki, musique),
Countdown (generated offline), the synthetic arithmetic task the embedded tiny model is trained on, and the
tool-use tasks (tool-arithmetic, tool-lookup) of the embedded tool-using model."""

from copes.tasks import countdown, math_tasks, qa_tasks, synthetic, tool_use  # noqa: F401  (importing registers the tasks)
from copes.tasks.base import Example, Score, Task, TaskBase, get_task, register, task_names

__all__ = ["Example", "Score", "Task", "TaskBase", "get_task", "register", "task_names"]
