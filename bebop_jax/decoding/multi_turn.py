"""Multi-turn speculative rollouts: the environment's replies go into the caches.

`speculative_episodes` runs one episode per prompt in batches. Each turn is decoded with MTP
drafts until a stop token (end of sequence or end of a tool call), the per-turn token limit or
the completion budget; the turn's text goes to the row's environment; a reply is tokenized and
appended with `speculative.continue_with_reply`, which prefills it into the main cache and
every MTP depth and continues drafting. No context is re-encoded. Host work per turn is the
environment call (Python) and one transfer of the output so far.

Environments follow the agentic task's protocol: `env.step(text)` returns an object with
`observation` (str), `done` (bool) and `reward` (float), and never raises. Replies are
bucketed to powers of two so each (batch, prompt bucket, reply bucket) compiles once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from bebop_jax.data.tokenizer import get_tokenizer
from bebop_jax.decoding import sampling, speculative

REPLY_BUCKETS = (32, 64, 128, 256)


def bucket(length: int, buckets: Sequence[int]) -> int:
  """The smallest bucket >= length."""
  for b in buckets:
    if length <= b:
      return b
  raise ValueError(f"a length of {length} is longer than the largest bucket {buckets[-1]}")


@dataclasses.dataclass
class Episode:
  """One prompt's rollout.

  tokens: the completion (policy turns and environment replies); policy_mask: True where the
  policy sampled the token (the RL loss mask); logprobs: target log-prob of each sampled
  token (0 elsewhere); reward: the environment's final reward (0 if it never ended);
  turns: policy turns; done: whether the environment ended the episode (False when the
  completion budget ran out first).
  """
  tokens: list[int]
  policy_mask: list[bool]
  logprobs: list[float]
  reward: float
  turns: int
  done: bool


@dataclasses.dataclass
class RolloutStats:
  """Summed over rows and calls: per-depth attempted / accepted drafts, target forwards
  (verification forwards, per batch), policy tokens."""
  attempted: np.ndarray
  accepted: np.ndarray
  target_forwards: int = 0
  policy_tokens: int = 0

  def add(self, out: speculative.SpeculativeOutput, rows: int):
    self.attempted = self.attempted + np.asarray(out.attempted)[:rows].sum(0)
    self.accepted = self.accepted + np.asarray(out.accepted)[:rows].sum(0)
    self.target_forwards += int(out.target_forwards)
    self.policy_tokens += int(np.asarray(out.policy_mask)[:rows].sum())


def speculative_episodes(graphdef: nnx.GraphDef, state: nnx.State,
                         prompts: Sequence[Sequence[int]], environments: Sequence[Any],
                         rng: jax.Array, *, batch_size: int, max_new_tokens: int,
                         params: sampling.SamplingParams, mode: str,
                         stop_tokens: Sequence[int], max_turn_tokens: int | None = None,
                         max_turns: int = 16, prompt_buckets: Sequence[int] = (64, 128, 256),
                         num_draft_steps: int | None = None,
                         stats: RolloutStats | None = None) -> list[Episode]:
  """One episode per (prompt token list, environment); see the module docstring.

  The cache holds the largest prompt bucket plus `max_new_tokens` plus the draft lookahead.
  """
  if len(prompts) != len(environments):
    raise ValueError(f"{len(prompts)} prompts but {len(environments)} environments")
  tok = get_tokenizer()
  stop_tokens = tuple(int(t) for t in stop_tokens)
  k = num_draft_steps or nnx.merge(graphdef, state).config.num_draft_steps
  episodes: list[Episode] = []
  for first in range(0, len(prompts), batch_size):
    chunk = [list(p) for p in prompts[first:first + batch_size]]
    envs = list(environments[first:first + batch_size])
    n = len(chunk)
    p = bucket(max(len(c) for c in chunk), prompt_buckets)
    rows = chunk + [[tok.bos_id]] * (batch_size - n)
    prompt = np.zeros((batch_size, p), np.int32)
    for i, ctx in enumerate(rows):
      prompt[i, :len(ctx)] = ctx
    lengths = np.array([len(c) for c in rows], np.int32)
    rng, key = jax.random.split(rng)
    cache_length = p + max_new_tokens + k + 1
    common = dict(params=params, mode=mode, stop_tokens=stop_tokens,
                  max_turn_tokens=max_turn_tokens)
    ds = speculative.start(graphdef, state, prompt, lengths, key, max_new_tokens=max_new_tokens,
                           cache_length=cache_length, num_draft_steps=num_draft_steps,
                           **common)
    turn_start = np.zeros(batch_size, np.int64)
    reward = [0.0] * n
    turns = [0] * n
    ended = [False] * n
    live = list(range(n))
    for _ in range(max_turns):
      tokens, out_len = jax.device_get((ds.out.tokens, ds.out.lengths))
      replies: dict[int, list[int]] = {}
      for i in live:
        turn = tokens[i, turn_start[i]:out_len[i]].tolist()
        if turn and turn[-1] == tok.eos_id:
          turn = turn[:-1]
        turns[i] += 1
        result = envs[i].step(tok.decode(turn))
        if result.done:
          reward[i], ended[i] = float(result.reward), True
        elif result.observation:
          reply = tok.encode(result.observation)
          if out_len[i] + len(reply) < max_new_tokens:  # else: out of budget, row ends
            replies[i] = reply
      live = sorted(replies)
      if not live:
        break
      r = bucket(max(len(x) for x in replies.values()), REPLY_BUCKETS)
      reply_tokens = np.zeros((batch_size, r), np.int32)
      reply_lengths = np.zeros((batch_size,), np.int32)
      for i, reply in replies.items():
        reply_tokens[i, :len(reply)] = reply
        reply_lengths[i] = len(reply)
        turn_start[i] = out_len[i] + len(reply)
      ds = speculative.continue_with_reply(graphdef, state, ds, reply_tokens, reply_lengths,
                                           **common)
    out = jax.device_get(ds.out)
    if stats is not None:
      stats.add(out, n)
    for i in range(n):
      m = int(out.lengths[i])
      episodes.append(Episode(
          tokens=out.tokens[i, :m].tolist(), policy_mask=out.policy_mask[i, :m].tolist(),
          logprobs=out.logprobs[i, :m].tolist(), reward=reward[i], turns=turns[i],
          done=ended[i]))
  return episodes
