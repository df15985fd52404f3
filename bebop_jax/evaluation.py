"""Policy evaluation by sampling: per-task pass@1, with the agentic environment in the loop.

Single-turn tasks (math, code): one generation per held-out prompt, stopped at eos, scored by
the task's reward. Agentic: each turn is generated until eos or the end of a tool call; the
environment's reply is appended to the context and the episode continues until it ends (an
answer, no call, or the turn limit). The autoregressive sampler re-encodes the whole context
each turn; the speculative one (`SpeculativeSampler`) keeps its caches and prefills only the
reply (decoding/multi_turn.py). The reward is averaged over the held-out examples ("pass@1" =
mean reward of one sample per prompt; for code, the fraction of held-out test cases passed).

Shapes are bucketed (batch fixed, context padded to a power-of-two bucket) so the sampler
compiles once per bucket.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from bebop_jax import tasks as tasks_lib
from bebop_jax.data.tokenizer import get_tokenizer
from bebop_jax.decoding import autoregressive, multi_turn, sampling, speculative

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)

# Generates for a batch of token contexts: (contexts, stop_tokens, max_new_tokens, rng) ->
# (list of generated token lists, each including its stop token if one was emitted).
GenerateFn = Callable[[Sequence[Sequence[int]], tuple[int, ...], int, jax.Array],
                      list[list[int]]]


def bucket(length: int, buckets: Sequence[int] = PROMPT_BUCKETS) -> int:
  """The smallest bucket >= length."""
  for b in buckets:
    if length <= b:
      return b
  raise ValueError(f"a context of {length} tokens is longer than the largest bucket "
                   f"{buckets[-1]}")


def autoregressive_generate_fn(graphdef: nnx.GraphDef, state: nnx.State, batch_size: int,
                               params: sampling.SamplingParams,
                               prompt_buckets: Sequence[int] = PROMPT_BUCKETS) -> GenerateFn:
  """A GenerateFn over plain autoregressive decoding with fixed batch size and buckets."""
  tok = get_tokenizer()

  def generate(contexts, stop_tokens, max_new_tokens, rng):
    results = []
    for start in range(0, len(contexts), batch_size):
      chunk = list(contexts[start:start + batch_size])
      p = bucket(max(len(c) for c in chunk), prompt_buckets)
      rows = chunk + [[tok.bos_id]] * (batch_size - len(chunk))  # pad the batch
      prompt = np.zeros((batch_size, p), np.int32)
      for i, ctx in enumerate(rows):
        prompt[i, :len(ctx)] = ctx
      lengths = np.array([len(c) for c in rows], np.int32)
      rng, key = jax.random.split(rng)
      out = autoregressive.generate(
          graphdef, state, prompt, lengths, key, max_new_tokens=max_new_tokens,
          cache_length=p + max_new_tokens, params=params, stop_tokens=tuple(stop_tokens))
      tokens, n = jax.device_get((out.tokens, out.lengths))
      results += [tokens[i, :n[i]].tolist() for i in range(len(chunk))]
    return results

  return generate


class SpeculativeSampler:
  """Speculative decoding with the policy's MTP drafts: `generate` is a GenerateFn for
  single-turn prompts and `episodes` runs multi-turn episodes with the caches kept. Per-depth
  acceptance and target forwards accumulate in `stats`."""

  def __init__(self, graphdef: nnx.GraphDef, state: nnx.State, batch_size: int,
               params: sampling.SamplingParams, mode: str | None = None,
               num_draft_steps: int | None = None,
               prompt_buckets: Sequence[int] = PROMPT_BUCKETS):
    self.graphdef, self.state, self.batch_size, self.params = graphdef, state, batch_size, params
    self.mode = mode or ("exact" if params.greedy else "rejection")
    self.num_draft_steps = num_draft_steps
    self.prompt_buckets = tuple(prompt_buckets)
    self.max_context = self.prompt_buckets[-1]
    k = num_draft_steps or nnx.merge(graphdef, state).config.num_draft_steps
    self.stats = multi_turn.RolloutStats(np.zeros(k, np.int64), np.zeros(k, np.int64))

  def _cache_length(self, p: int, max_new_tokens: int) -> int:
    return p + max_new_tokens + len(self.stats.attempted) + 1

  def __call__(self, contexts, stop_tokens, max_new_tokens, rng):
    tok = get_tokenizer()
    results = []
    for start in range(0, len(contexts), self.batch_size):
      chunk = list(contexts[start:start + self.batch_size])
      p = bucket(max(len(c) for c in chunk), self.prompt_buckets)
      rows = chunk + [[tok.bos_id]] * (self.batch_size - len(chunk))
      prompt = np.zeros((self.batch_size, p), np.int32)
      for i, ctx in enumerate(rows):
        prompt[i, :len(ctx)] = ctx
      lengths = np.array([len(c) for c in rows], np.int32)
      rng, key = jax.random.split(rng)
      out = speculative.generate(
          self.graphdef, self.state, prompt, lengths, key, max_new_tokens=max_new_tokens,
          cache_length=self._cache_length(p, max_new_tokens), params=self.params,
          mode=self.mode, stop_tokens=tuple(stop_tokens),
          num_draft_steps=self.num_draft_steps)
      out = jax.device_get(out)
      self.stats.add(out, len(chunk))
      results += [out.tokens[i, :out.lengths[i]].tolist() for i in range(len(chunk))]
    return results

  def episodes(self, task, examples, rng, max_new_tokens) -> list[float]:
    """Rewards of one multi-turn episode per example (caches kept across turns); the whole
    completion, replies included, gets `max_new_tokens`."""
    tok = get_tokenizer()
    eps = multi_turn.speculative_episodes(
        self.graphdef, self.state, [tok.encode(ex.prompt, add_bos=True) for ex in examples],
        [task.environment(ex) for ex in examples], rng, batch_size=self.batch_size,
        max_new_tokens=max_new_tokens,
        params=self.params, mode=self.mode, stop_tokens=(tok.eos_id, tok.call_end_id),
        max_turns=task.max_turns, prompt_buckets=self.prompt_buckets,
        num_draft_steps=self.num_draft_steps, stats=self.stats)
    return [ep.reward for ep in eps]


def _strip_stop(ids: list[int], stop: int) -> list[int]:
  return ids[:-1] if ids and ids[-1] == stop else ids


def evaluate_single_turn(task: tasks_lib.Task, examples: Sequence[tasks_lib.Example],
                         generate: GenerateFn, rng: jax.Array, max_new_tokens: int
                         ) -> list[float]:
  """Rewards of one sample per example."""
  tok = get_tokenizer()
  contexts = [tok.encode(ex.prompt, add_bos=True) for ex in examples]
  outputs = generate(contexts, (tok.eos_id,), max_new_tokens, rng)
  return [task.reward(ex, tok.decode(_strip_stop(ids, tok.eos_id)))
          for ex, ids in zip(examples, outputs)]


def evaluate_agentic(task, examples: Sequence[tasks_lib.Example], generate: GenerateFn,
                     rng: jax.Array, max_new_tokens: int) -> list[float]:
  """Rewards of one multi-turn episode per example, the environment in the loop."""
  tok = get_tokenizer()
  envs = [task.environment(ex) for ex in examples]
  transcripts = [""] * len(examples)
  rewards = [0.0] * len(examples)
  active = list(range(len(examples)))
  for _ in range(task.max_turns):
    if not active:
      break
    contexts = [tok.encode(examples[i].prompt + transcripts[i], add_bos=True) for i in active]
    rng, key = jax.random.split(rng)
    outputs = generate(contexts, (tok.eos_id, tok.call_end_id), max_new_tokens, key)
    still = []
    for i, ids in zip(active, outputs):
      turn = tok.decode(_strip_stop(ids, tok.eos_id))
      result = envs[i].step(turn)
      transcripts[i] += turn + result.observation
      if result.done:
        rewards[i] = result.reward
      else:
        still.append(i)
    active = [i for i in still
              if len(tok.encode(examples[i].prompt + transcripts[i])) + 1 < getattr(
                  generate, "max_context", PROMPT_BUCKETS[-1])]
  return rewards


def evaluate_tasks(generate_fns: dict[float, GenerateFn],
                   examples: dict[str, Sequence[tasks_lib.Example]],
                   task_objs: dict[str, tasks_lib.Task], *, seed: int,
                   max_new_tokens: int) -> dict[str, float]:
  """pass@1 per task and temperature: {"<task>/t<temperature>": mean reward}."""
  results = {}
  for temperature, generate in generate_fns.items():
    for name, exs in examples.items():
      rng = jax.random.key(seed + 1000 * tasks_lib.TASK_NAMES.index(name))
      task = task_objs[name]
      if task.multi_turn and hasattr(generate, "episodes"):
        rewards = generate.episodes(task, exs, rng, max_new_tokens)
      elif task.multi_turn:
        rewards = evaluate_agentic(task, exs, generate, rng, max_new_tokens)
      else:
        rewards = evaluate_single_turn(task, exs, generate, rng, max_new_tokens)
      results[f"{name}/t{temperature:g}"] = float(np.mean(rewards)) if rewards else 0.0
  return results
