"""`JaxEngine`: rollouts decoded by the policy, speculatively with its MTP drafts or
autoregressively, every task through its environment (rollout.episodes).

A batch may mix tasks: single-turn rows stop at end of sequence, multi-turn rows also at the
end of a tool call (per-row stop sets), and each row's environment scores it. Because
verification is exact, a speculative rollout is a sample of the same policy as an
autoregressive one; its behaviour log-probs are the policy's (the drafter adds no
off-policyness) and come free from verification.
"""

from __future__ import annotations

import time
from typing import Callable, ContextManager, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from bebop_jax import tasks as tasks_lib
from bebop_jax.decoding import decoder as decoder_lib
from bebop_jax.data.tokenizer import BaseTokenizer
from bebop_jax.rollout import episodes as episodes_lib
from bebop_jax.rollout import base


class JaxEngine(base.RolloutEngine):
  """Rollouts of the policy `(graphdef, params)` on examples of `tasks` ({name: Task}).

  `tokenizer` encodes the prompts, decodes each policy turn for its environment and encodes
  the replies; a turn stops at its `eos_id` (and, for multi-turn tasks, its `call_end_id`).
  """

  def __init__(self, graphdef: nnx.GraphDef, params: nnx.State,
               tasks: Mapping[str, tasks_lib.Task], settings: base.RolloutSettings, *,
               tokenizer: BaseTokenizer, policy_version: int = 0):
    self.graphdef, self.params = graphdef, params
    self.tasks = dict(tasks)
    self.settings = settings
    self.tokenizer = tokenizer
    self.policy_version = policy_version
    self.num_draft_steps = 0
    if settings.engine == "speculative":
      model_k = nnx.merge(graphdef, params).config.num_draft_steps
      self.num_draft_steps = (max(settings.adaptive.k_max, 1) if settings.adaptive else
                              settings.num_draft_steps or model_k)
      if not 1 <= self.num_draft_steps <= model_k:
        raise ValueError(f"num_draft_steps={settings.num_draft_steps} is not allowed: must be "
                         f"in [1, {model_k}] (the model's MTP depth)")

  def decoder(self) -> decoder_lib.Decoder:
    """A fresh decoder of the settings' kind (an adaptive one keeps its own call stats)."""
    s = self.settings
    vocab = None if s.draft_vocab is None else tuple(int(t) for t in s.draft_vocab)
    if s.engine != "speculative":
      return decoder_lib.Autoregressive(s.sampling, max_turn_tokens=s.max_turn_tokens,
                                        return_hidden=s.return_hidden)
    if s.adaptive is not None:
      return decoder_lib.Adaptive(s.sampling, s.decode_mode, s.adaptive,
                                  acceptance=s.acceptance, max_turn_tokens=s.max_turn_tokens,
                                  draft_vocab=vocab)
    return decoder_lib.Speculative(s.sampling, s.decode_mode, self.num_draft_steps,
                                   max_turn_tokens=s.max_turn_tokens, draft_vocab=vocab)

  def update_params(self, params: nnx.State, policy_version: int) -> None:
    self.params, self.policy_version = params, policy_version

  def _task(self, example: tasks_lib.Example) -> tasks_lib.Task:
    if example.task not in self.tasks:
      raise ValueError(f"an example of task {example.task!r}, but the engine has tasks "
                       f"{sorted(self.tasks)}")
    return self.tasks[example.task]

  def release_params(self) -> None:
    """Drops the engine's reference to its parameters: a caller that passes `weights` to
    every `generate` call (asynchronous RL) keeps no version alive through the engine."""
    self.params = None

  def generate(self, examples: Sequence[tasks_lib.Example], rng: jax.Array,
               weights: Callable[[], ContextManager[tuple[nnx.State, int]]] | None = None,
               *, group_size: int = 1,
               after_call: Callable[[base.Rollouts, nnx.State, int], None] | None = None
               ) -> base.Rollouts:
    """One rollout per example (see RolloutEngine.generate).

    `weights`, when given, is called before each decoding call and returns a context
    manager yielding (parameters, version) to decode that call with (asynchronous RL swaps
    in new weights between calls this way; the context is held while the call runs). A call
    takes the largest multiple of `group_size` rows that fits `settings.batch_size`, so the
    rollouts of one prompt (a group of `group_size` consecutive rows) are sampled by one
    version. Call c uses the key fold_in(rng, c), each row keeps the version that sampled
    it, and `after_call(rollouts of the call, parameters, version)`, when given, runs while
    the call's context is still held (to score the rows under the version that sampled
    them).
    """
    if weights is None:
      if self.params is None:
        raise ValueError("the engine's parameters were released: pass `weights`")
      return self._generate(examples, rng, self.params, self.policy_version)
    rows = self.settings.batch_size // group_size * group_size
    if rows < 1:
      raise ValueError(f"batch_size={self.settings.batch_size} is smaller than a group of "
                       f"group_size={group_size} rows: a decoding call must hold whole "
                       "groups, so that one version samples every rollout of a prompt")
    parts = []
    for c, first in enumerate(range(0, len(examples), rows)):
      with weights() as (params, version):
        part = self._generate(examples[first:first + rows], jax.random.fold_in(rng, c),
                              params, version)
        if after_call is not None:
          after_call(part, params, version)
      parts.append(part)
    return base.Rollouts.concatenate(parts)

  def _generate(self, examples: Sequence[tasks_lib.Example], rng: jax.Array,
                params: nnx.State, policy_version: int) -> base.Rollouts:
    start = time.perf_counter()
    s = self.settings
    tok = self.tokenizer
    task_objs = [self._task(ex) for ex in examples]
    prompts = [tok.encode_prompt(ex.prompt) for ex in examples]
    envs = [task.environment(ex) for task, ex in zip(task_objs, examples)]
    stop_tokens = (tok.eos_id, tok.call_end_id)
    row_stops = np.array([[True, task.multi_turn] for task in task_objs], bool).reshape(-1, 2)
    decoder = self.decoder()
    episodes = episodes_lib.decode_episodes(
        decoder, self.graphdef, params, prompts, envs, rng, tokenizer=tok,
        batch_size=s.batch_size, max_new_tokens=s.max_new_tokens, stop_tokens=stop_tokens,
        row_stops=row_stops, max_turns=max((task.max_turns for task in task_objs), default=1),
        prompt_buckets=s.prompt_buckets)
    rollouts = base.rollouts_from_episodes(
        episodes, prompts, [tasks_lib.TASK_NAMES.index(ex.task) for ex in examples],
        max_new_tokens=s.max_new_tokens, num_draft_steps=self.num_draft_steps,
        policy_version=policy_version, seconds=time.perf_counter() - start)
    if isinstance(decoder, decoder_lib.Adaptive):
      rollouts.k_iterations = decoder.k_iterations()
    return rollouts
