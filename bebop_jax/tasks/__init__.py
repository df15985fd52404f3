"""Synthetic verifiable tasks: math, code and agentic tool use.

`get_task(name, **knobs)` returns a `Task` whose `sample(seed)` gives an `Example` and whose
`reward(example, completion)` scores a completion in [0, 1]; `solved(reward)` (reward 1)
is what pass@1 counts. The agentic task also provides
`environment(example)` for multi-turn episodes.
"""

from __future__ import annotations

import importlib
from typing import Any

from bebop_jax.tasks.base import Example, Task, solved

TASK_NAMES = ("math", "code", "agentic")


_TASK_CLASSES = {"math": "bebop_jax.tasks.math:MathTask",
                 "code": "bebop_jax.tasks.code:CodeTask",
                 "agentic": "bebop_jax.tasks.agentic:AgenticTask"}


def task_class(name: str) -> type[Task]:
  """The class of task `name` (imported on first use, so tasks don't import each other)."""
  if name not in _TASK_CLASSES:
    raise ValueError(f"unknown task {name!r}; allowed: {', '.join(TASK_NAMES)}")
  module, _, cls = _TASK_CLASSES[name].partition(":")
  return getattr(importlib.import_module(module), cls)


def get_task(name: str, **knobs: Any) -> Task:
  """The task `name` ("math", "code" or "agentic") with difficulty `knobs`.

  Raises:
    ValueError: for an unknown task name or knob, naming what is allowed.
  """
  cls = task_class(name)
  try:
    return cls(**knobs)
  except TypeError as e:
    raise ValueError(f"bad knobs for task {name!r}: {e}") from e
