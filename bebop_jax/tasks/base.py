"""Shared interface and text format of the synthetic verifiable tasks.

Every task produces `Example`s: a `prompt` (what the policy is conditioned on), a
`demonstration` (the completion a good policy writes, reasoning included, ending with the
final-answer marker and the answer), and `meta`, a JSON-serialisable dict holding whatever
the reward needs (the expected answer, held-out test cases, the tool world ...).

Text format (all tasks):
  * The completion ends with ``ANSWER_MARKER`` followed by the final answer. The policy then
    emits the end-of-sequence token; decoded completions may or may not contain ``EOS_MARKER``
    and rewards accept both. Under a chat template (data/tokenizer.py, `data.chat_format`) the
    marker is written as plain text, a line starting ``PLAIN_ANSWER`` ("Answer: 9"), and the
    end of sequence is the template's end-of-turn token; rewards accept either form.
  * Multi-turn tasks: the policy emits ``CALL_START <call> CALL_END``; the environment replies
    with ``RESULT_START <result> RESULT_END``, which is appended to the context. Tool results
    are not the policy's text: everything from RESULT_START to RESULT_END inclusive is
    excluded from training losses.

Model-generated text is hostile input. `reward` and environments never raise, never hang and
do bounded work on any string: they clip the input to `MAX_COMPLETION_CHARS` first.
"""

from __future__ import annotations

import numpy as np

import abc
import dataclasses
import json
from typing import Any

# Special markers. Each is one token of the tokenizer (bebop_jax.data.tokenizer).
BOS_MARKER = "<|bos|>"
EOS_MARKER = "<|eos|>"
PAD_MARKER = "<|pad|>"
ANSWER_MARKER = "<|answer|>"
CALL_START = "<|call|>"
CALL_END = "<|/call|>"
RESULT_START = "<|result|>"
RESULT_END = "<|/result|>"
SPECIAL_MARKERS = (PAD_MARKER, BOS_MARKER, EOS_MARKER, ANSWER_MARKER,
                   CALL_START, CALL_END, RESULT_START, RESULT_END)

# The answer marker as plain text, at the start of a line: the form an instruct model writes
# (chat format). `find_answer` accepts it wherever ANSWER_MARKER is accepted.
PLAIN_ANSWER = "Answer: "

# Rewards look at no more than this many characters of a completion.
MAX_COMPLETION_CHARS = 4096
# A final answer longer than this is wrong without being parsed.
MAX_ANSWER_CHARS = 256


@dataclasses.dataclass(frozen=True)
class Example:
  """One task instance.

  Attributes:
    task: task name ("math", "code", "agentic").
    prompt: the text the policy is conditioned on.
    demonstration: the completion a good policy writes (for agentic tasks the whole
      transcript, tool results included between RESULT_START and RESULT_END).
    meta: JSON-serialisable data the reward needs.
  """
  task: str
  prompt: str
  demonstration: str
  meta: dict[str, Any]

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  @classmethod
  def from_json(cls, text: str | bytes) -> "Example":
    return cls(**json.loads(text))


def clip_completion(text: Any) -> str:
  """Returns `text` as a str of at most MAX_COMPLETION_CHARS characters; never raises."""
  if isinstance(text, bytes):
    text = text[:MAX_COMPLETION_CHARS].decode("utf-8", errors="replace")
  if not isinstance(text, str):
    return ""
  return text[:MAX_COMPLETION_CHARS]


def find_answer(text: str) -> int | None:
  """Where the final answer starts in `text`: just after the first ANSWER_MARKER, or after
  the first line that starts with PLAIN_ANSWER (its trailing space optional), whichever comes
  first; None when neither is there. Bounded: two substring searches."""
  found = []
  marker = text.find(ANSWER_MARKER)
  if marker >= 0:
    found.append(marker + len(ANSWER_MARKER))
  plain = PLAIN_ANSWER.rstrip()
  line = 0 if text.startswith(plain) else text.find("\n" + plain)
  if line >= 0:
    found.append(line + (line > 0 or text.startswith("\n")) + len(plain))
  return min(found) if found else None


def extract_final_answer(completion: Any) -> str | None:
  """The stripped text after the first answer marker (`find_answer`), up to EOS or the end;
  None if absent.

  Bounded work: the completion is clipped first and an answer over MAX_ANSWER_CHARS is None.
  """
  text = clip_completion(completion)
  start = find_answer(text)
  if start is None:
    return None
  answer = text[start:]
  end = answer.find(EOS_MARKER)
  if end >= 0:
    answer = answer[:end]
  answer = answer.strip()
  if len(answer) > MAX_ANSWER_CHARS:
    return None
  return answer


def parse_int(text: str | None, max_digits: int = 18) -> int | None:
  """Parses an optionally signed decimal integer of at most `max_digits` digits, else None."""
  if text is None:
    return None
  body = text[1:] if text[:1] in ("-", "+") else text
  if not body or len(body) > max_digits or not body.isascii() or not body.isdigit():
    return None
  return int(text)


@dataclasses.dataclass(frozen=True)
class StepResult:
  """Outcome of one policy turn in an environment.

  Attributes:
    observation: text to append to the context (RESULT_START ... RESULT_END); '' when done.
    done: whether the episode is over.
    reward: the final reward when done, else 0.0.
    turn: number of policy turns consumed so far (this one included).
  """
  observation: str
  done: bool
  reward: float
  turn: int


class OneTurnEnvironment:
  """A single-turn task as an environment: the first turn ends the episode with its reward
  (the rollout engine runs every task through this one protocol)."""

  def __init__(self, task: "Task", example: Example):
    self.task, self.example = task, example

  def step(self, policy_text: Any) -> StepResult:
    """Never raises: rewards are total functions of the text."""
    return StepResult("", True, float(self.task.reward(self.example, policy_text)), 1)


def solved(reward) -> "bool | np.ndarray":
  """Whether a completion solves its example: its reward is 1, every check passed (for code,
  every held-out test case; partial credit is not a solve). pass@1 is the mean of this."""
  return np.asarray(reward) >= 1.0


class Task(abc.ABC):
  """A seeded generator of examples with a verifiable reward.

  Every task is also an environment factory: `environment(example)` returns an object with
  `step(policy_text) -> StepResult`. Single-turn tasks end at the first turn; multi-turn
  tasks override `environment`, `multi_turn` and `max_turns`.
  """

  name: str
  max_turns = 1  # most policy turns an episode can take (multi-turn tasks set their own)

  @abc.abstractmethod
  def sample(self, seed: int) -> Example:
    """Deterministic in `seed` (and the task's difficulty knobs)."""

  @abc.abstractmethod
  def reward(self, example: Example, completion: str) -> float:
    """Score in [0, 1] of a completion (text after the prompt). Never raises."""

  def demonstration(self, example: Example, seed: int) -> str:
    """One valid solution path of `example`, deterministic in `seed`; every path gets
    reward 1. The canonical `example.demonstration` unless the task has a `diversity` > 0
    (then SFT sees a policy with real entropy: mostly forced tokens, some forks)."""
    del seed
    return example.demonstration

  @property
  def multi_turn(self) -> bool:
    return False

  def environment(self, example: Example):
    """A fresh environment for one episode of `example`."""
    return OneTurnEnvironment(self, example)
