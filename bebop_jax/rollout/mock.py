"""`MockEngine`: scripted completions, for tests of what consumes rollouts (advantages,
learner batches, the RL loop's bookkeeping) without compiling a decoding loop."""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

from bebop_jax import tasks as tasks_lib
from bebop_jax.data import pipeline
from bebop_jax.data.tokenizer import BaseTokenizer
from bebop_jax.rollout import episodes as episodes_lib
from bebop_jax.rollout import base

# (example, row index in the batch, a per-call integer seed) -> completion text
CompletionFn = Callable[[tasks_lib.Example, int, int], str]


class MockEngine(base.RolloutEngine):
  """Each completion is `completion_fn(example, row, seed)` followed by eos, scored by the
  task's reward; tokens between RESULT_START and RESULT_END are environment replies (not in
  the policy mask). A completion longer than `max_new_tokens` is cut there (its eos too)
  and marked truncated; `tokenizer` encodes prompts and completions. Behaviour log-probs
  are the constant `logprob`, entropies `entropy`; one turn, one target forward per token
  after the first; no drafts (K = 0)."""

  def __init__(self, tasks: Mapping[str, tasks_lib.Task], completion_fn: CompletionFn,
               settings: base.RolloutSettings = base.RolloutSettings(engine="autoregressive"),
               *, tokenizer: BaseTokenizer, logprob: float = -1.0, entropy: float = 1.0):
    self.tasks, self.completion_fn, self.settings = dict(tasks), completion_fn, settings
    self.tokenizer = tokenizer
    self.logprob, self.entropy = logprob, entropy
    self.params = None

  def update_params(self, params, policy_version: int) -> None:
    self.params, self.policy_version = params, policy_version

  def generate(self, examples: Sequence[tasks_lib.Example], rng: jax.Array) -> base.Rollouts:
    start = time.perf_counter()
    tok = self.tokenizer
    seed = int(jax.random.randint(rng, (), 0, 2 ** 30))
    n_max = self.settings.max_new_tokens
    prompts, episodes = [], []
    for row, ex in enumerate(examples):
      text = self.completion_fn(ex, row, seed)
      full = tok.encode_completion(text)
      ids = full[:n_max]
      mask = ~pipeline.tool_result_mask(np.asarray(ids, np.int32), tok)
      prompts.append(tok.encode_prompt(ex.prompt))
      episodes.append(episodes_lib.Episode(
          tokens=ids, policy_mask=mask.tolist(),
          logprobs=np.where(mask, self.logprob, 0.0).tolist(),
          entropy=np.where(mask, self.entropy, 0.0).tolist(),
          reward=float(self.tasks[ex.task].reward(ex, text)), turns=1, done=True,
          attempted=np.zeros(0, np.int64), accepted=np.zeros(0, np.int64),
          target_forwards=max(len(ids) - 1, 0), emitted_by_forwards=max(len(ids) - 1, 0),
          truncated=len(full) > n_max))
    return base.rollouts_from_episodes(
        episodes, prompts, [tasks_lib.TASK_NAMES.index(ex.task) for ex in examples],
        max_new_tokens=n_max, num_draft_steps=0, policy_version=self.policy_version,
        seconds=time.perf_counter() - start)
