"""Episodes: policy turns with an environment in the loop, for both decoding loops.

An episode decodes a policy turn until a stop token (end of sequence, or for multi-turn
tasks the end of a tool call), the per-turn token limit or the completion budget; the turn's
text goes to the row's environment; a reply is tokenized and appended, and the next turn
starts. `max_new_tokens` is the budget of the whole completion, replies included; a reply
that would exhaust it, or one after the `max_turns`-th turn, ends the episode (reward 0
unless the environment gave one).

- `speculative_episodes` keeps its caches across turns: `speculative.continue_with_reply`
  prefills a reply into the main cache and every MTP depth and continues drafting. No
  context is re-encoded.
- `autoregressive_episodes` runs `autoregressive.generate` from the whole context at every
  turn (prompt, earlier turns and replies as token ids, never re-tokenized).

Host work per turn is the environment call (Python) and one transfer of the output so far.
Environments follow the tasks' protocol: `env.step(text)` returns an object with
`observation` (str), `done` (bool) and `reward` (float), and never raises. Prompts and
replies are bucketed (batching.PROMPT_BUCKETS, REPLY_BUCKETS) so each shape compiles once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from bebop_jax.data.tokenizer import get_tokenizer
from bebop_jax.decoding import autoregressive, batching, sampling, speculative


@dataclasses.dataclass
class Episode:
  """One prompt's rollout.

  tokens: the completion (policy turns and environment replies); policy_mask: True where the
  policy sampled the token (the RL loss mask); logprobs: log-prob of each sampled token under
  the sampling distribution (0 elsewhere); entropy: raw policy entropy (nats) at each
  sampled token (0 elsewhere); reward: the environment's final reward (0 if it never ended);
  turns: policy turns; done: whether the environment ended the episode (False when the
  completion budget ran out first); attempted / accepted [K]: drafts verified / accepted at
  each depth (K = 0 for autoregressive decoding); target_forwards: target-model forwards
  after each turn's prefill (verifications, or autoregressive steps).
  """
  tokens: list[int]
  policy_mask: list[bool]
  logprobs: list[float]
  entropy: list[float]
  reward: float
  turns: int
  done: bool
  attempted: np.ndarray
  accepted: np.ndarray
  target_forwards: int


def _check_inputs(prompts, environments, row_stops, stop_tokens):
  if len(prompts) != len(environments):
    raise ValueError(f"{len(prompts)} prompts but {len(environments)} environments")
  if row_stops is not None and np.shape(row_stops) != (len(prompts), len(stop_tokens)):
    raise ValueError(f"row_stops has shape {np.shape(row_stops)}; want "
                     f"[{len(prompts)}, {len(stop_tokens)}] (prompts x stop_tokens)")


def _row_stops(row_stops, first: int, n: int, batch_size: int, num_stops: int):
  """The chunk's [batch_size, S] stop flags (padding rows stop at every stop token)."""
  if row_stops is None:
    return None
  out = np.ones((batch_size, num_stops), bool)
  out[:n] = np.asarray(row_stops, bool)[first:first + n]
  return out


def _env_step(env, turn: list[int]):
  """The environment's result for one policy turn (its eos, if any, is not text)."""
  tok = get_tokenizer()
  if turn and turn[-1] == tok.eos_id:
    turn = turn[:-1]
  return env.step(tok.decode(turn))


def speculative_episodes(graphdef: nnx.GraphDef, state: nnx.State,
                         prompts: Sequence[Sequence[int]], environments: Sequence[Any],
                         rng: jax.Array, *, batch_size: int, max_new_tokens: int,
                         params: sampling.SamplingParams, mode: str,
                         stop_tokens: Sequence[int], row_stops: np.ndarray | None = None,
                         max_turn_tokens: int | None = None, max_turns: int = 16,
                         prompt_buckets: Sequence[int] = batching.PROMPT_BUCKETS,
                         num_draft_steps: int | None = None) -> list[Episode]:
  """One episode per (prompt token list, environment) with speculative decoding; see the
  module docstring. `row_stops` [num_prompts, S] bool selects each prompt's stop tokens
  (default: all). The cache holds the prompt bucket plus `max_new_tokens` plus the draft
  lookahead."""
  stop_tokens = tuple(int(t) for t in stop_tokens)
  _check_inputs(prompts, environments, row_stops, stop_tokens)
  k = num_draft_steps or nnx.merge(graphdef, state).config.num_draft_steps
  common = dict(params=params, mode=mode, max_turn_tokens=max_turn_tokens)
  episodes: list[Episode] = []
  for first in range(0, len(prompts), batch_size):
    chunk = prompts[first:first + batch_size]
    envs = list(environments[first:first + batch_size])
    n = len(chunk)
    prompt, lengths = batching.pad_rows(chunk, batch_size, prompt_buckets)
    rng, key = jax.random.split(rng)
    ds = speculative.start(
        graphdef, state, prompt, lengths, key, max_new_tokens=max_new_tokens,
        cache_length=prompt.shape[1] + max_new_tokens + k + 1, num_draft_steps=num_draft_steps,
        stop_tokens=stop_tokens,
        row_stops=_row_stops(row_stops, first, n, batch_size, len(stop_tokens)), **common)
    turn_start = np.zeros(batch_size, np.int64)
    reward, turns, ended = [0.0] * n, [0] * n, [False] * n
    live = list(range(n))
    for t in range(max_turns):
      tokens, out_len = jax.device_get((ds.out.tokens, ds.out.lengths))
      replies: dict[int, list[int]] = {}
      for i in live:
        turns[i] += 1
        result = _env_step(envs[i], tokens[i, turn_start[i]:out_len[i]].tolist())
        if result.done:
          reward[i], ended[i] = float(result.reward), True
        elif result.observation and t + 1 < max_turns:
          reply = get_tokenizer().encode(result.observation)
          if out_len[i] + len(reply) < max_new_tokens:  # else: out of budget, the row ends
            replies[i] = reply
      live = sorted(replies)
      if not live:
        break
      r = batching.bucket(max(len(x) for x in replies.values()), batching.REPLY_BUCKETS)
      reply_tokens = np.zeros((batch_size, r), np.int32)
      reply_lengths = np.zeros((batch_size,), np.int32)
      for i, reply in replies.items():
        reply_tokens[i, :len(reply)] = reply
        reply_lengths[i] = len(reply)
        turn_start[i] = out_len[i] + len(reply)
      ds = speculative.continue_with_reply(graphdef, state, ds, reply_tokens, reply_lengths,
                                           **common)
    out = jax.device_get(ds.out)
    for i in range(n):
      m = int(out.lengths[i])
      episodes.append(Episode(
          tokens=out.tokens[i, :m].tolist(), policy_mask=out.policy_mask[i, :m].tolist(),
          logprobs=out.logprobs[i, :m].tolist(), entropy=out.entropy[i, :m].tolist(),
          reward=reward[i], turns=turns[i], done=ended[i],
          attempted=np.asarray(out.attempted[i], np.int64),
          accepted=np.asarray(out.accepted[i], np.int64),
          # depth 1 is attempted at every verification the row took part in
          target_forwards=int(out.attempted[i, 0])))
  return episodes


def autoregressive_episodes(graphdef: nnx.GraphDef, state: nnx.State,
                            prompts: Sequence[Sequence[int]], environments: Sequence[Any],
                            rng: jax.Array, *, batch_size: int, max_new_tokens: int,
                            params: sampling.SamplingParams, stop_tokens: Sequence[int],
                            row_stops: np.ndarray | None = None,
                            max_turn_tokens: int | None = None, max_turns: int = 16,
                            prompt_buckets: Sequence[int] = batching.PROMPT_BUCKETS
                            ) -> list[Episode]:
  """One episode per (prompt token list, environment) with plain autoregressive decoding
  from the whole context at every turn; same contract as `speculative_episodes`. Each turn
  packs the live rows of a chunk into one batch; contexts are bucketed."""
  stop_tokens = tuple(int(t) for t in stop_tokens)
  _check_inputs(prompts, environments, row_stops, stop_tokens)
  tok = get_tokenizer()
  episodes: list[Episode] = []
  for first in range(0, len(prompts), batch_size):
    chunk = [list(p) for p in prompts[first:first + batch_size]]
    envs = list(environments[first:first + batch_size])
    n = len(chunk)
    stops = _row_stops(row_stops, first, n, batch_size, len(stop_tokens))
    comp = [dict(tokens=[], mask=[], logprobs=[], entropy=[]) for _ in range(n)]
    reward, turns, ended, forwards = [0.0] * n, [0] * n, [False] * n, [0] * n
    live = list(range(n))
    for t in range(max_turns):
      if not live:
        break
      contexts = [chunk[i] + comp[i]["tokens"] for i in live]
      tokens, lengths = batching.pad_rows(contexts, batch_size, prompt_buckets)
      limits = np.ones(batch_size, np.int32)
      for j, i in enumerate(live):
        budget = max_new_tokens - len(comp[i]["tokens"])
        limits[j] = budget if max_turn_tokens is None else min(budget, max_turn_tokens)
      live_stops = None if stops is None else np.concatenate(
          [stops[live], np.ones((batch_size - len(live), len(stop_tokens)), bool)])
      rng, key = jax.random.split(rng)
      out = jax.device_get(autoregressive.generate(
          graphdef, state, tokens, lengths, key, max_new_tokens=max_new_tokens,
          cache_length=tokens.shape[1] + max_new_tokens, params=params,
          stop_tokens=stop_tokens, row_stops=live_stops, row_limits=limits))
      still = []
      for j, i in enumerate(live):
        m = int(out.lengths[j])
        turn = out.tokens[j, :m].tolist()
        c = comp[i]
        c["tokens"] += turn
        c["mask"] += [True] * m
        c["logprobs"] += out.logprobs[j, :m].tolist()
        c["entropy"] += out.entropy[j, :m].tolist()
        turns[i] += 1
        forwards[i] += m - 1  # the turn's first token comes from its prefill
        result = _env_step(envs[i], turn)
        if result.done:
          reward[i], ended[i] = float(result.reward), True
          continue
        reply = tok.encode(result.observation) if result.observation else []
        if reply and t + 1 < max_turns and len(c["tokens"]) + len(reply) < max_new_tokens:
          c["tokens"] += reply
          c["mask"] += [False] * len(reply)
          c["logprobs"] += [0.0] * len(reply)
          c["entropy"] += [0.0] * len(reply)
          still.append(i)
      live = still
    for i in range(n):
      c = comp[i]
      episodes.append(Episode(
          tokens=c["tokens"], policy_mask=c["mask"], logprobs=c["logprobs"],
          entropy=c["entropy"], reward=reward[i], turns=turns[i], done=ended[i],
          attempted=np.zeros(0, np.int64), accepted=np.zeros(0, np.int64),
          target_forwards=forwards[i]))
  return episodes
