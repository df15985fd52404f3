"""Episodes: policy turns with an environment in the loop, for every decoder.

An episode decodes a policy turn until a stop token (end of sequence, or for multi-turn
tasks the end of a tool call), the per-turn token limit or the completion budget; the turn's
text goes to the row's environment; a reply is tokenized and appended, and the next turn
starts. `max_new_tokens` is the budget of the whole completion, replies included; a reply
that would exhaust it, or one after the `max_turns`-th turn, ends the episode (reward 0
unless the environment gave one). An episode is `truncated` when a length limit cut it: its
last policy turn reached the completion budget or `max_turn_tokens` without a stop token,
or the environment's reply did not fit in the budget left.

`decode_episodes` is the one episode loop. It takes any decoder of decoding/decoder.py
(autoregressive, speculative with a fixed K, adaptive) and keeps each chunk's caches across
turns, as a serving engine's prefix cache does: a chunk of `batch_size` rows keeps its rows
in their slots, and `decoder.continue_with_reply` appends the replies to the caches and
decodes the next turn. `reencoded_episodes` is the baseline without a prefix cache: it
decodes every turn autoregressively from the whole context (prompt, earlier turns and
replies as token ids, never re-tokenized). The autoregressive decoder and the baseline
consume a row's random keys identically (per-row keys split once per sampled token, carried
across turns), so the two give the same episodes for the same key, up to float rounding of
the logits.

Host work per turn is the environment call (Python) and one transfer of the output so far.
The caller's tokenizer (`tokenizer=`, the one that encoded the prompts) decodes each turn
for the environment and encodes its reply.
Environments follow the tasks' protocol: `env.step(text)` returns an object with
`observation` (str), `done` (bool) and `reward` (float), and never raises. Prompts and
replies are bucketed (batching.PROMPT_BUCKETS; REPLY_BUCKETS, capped at max_new_tokens - 1)
so each shape compiles once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from bebop_jax.data.tokenizer import BaseTokenizer
from bebop_jax.decoding import autoregressive, batching, sampling
from bebop_jax.decoding import decoder as decoder_lib


@dataclasses.dataclass
class Episode:
  """One prompt's rollout.

  tokens: the completion (policy turns and environment replies); policy_mask: True where the
  policy sampled the token (the RL loss mask); logprobs: log-prob of each sampled token under
  the sampling distribution (0 elsewhere); entropy: raw policy entropy (nats) at each
  sampled token (0 elsewhere); reward: the environment's final reward (0 if it never ended);
  turns: policy turns; done: whether the environment ended the episode (False when the
  completion budget ran out first); truncated: a length limit cut the episode (its last
  policy turn reached the completion budget or the per-turn limit without a stop token, or
  the environment's reply did not fit in the budget left); attempted / accepted [K]: drafts
  verified / accepted at each depth (K = 0 for autoregressive decoding); target_forwards:
  target-model forwards after each turn's first token (verifications, or autoregressive
  steps); emitted_by_forwards: the policy tokens those forwards emitted (policy tokens
  minus one per turn: each turn's first token comes from the prefill or the reply's
  forward).
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
  emitted_by_forwards: int
  truncated: bool
  hidden: np.ndarray | None = None  # [prompt + completion, E] h0 (return_hidden)


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


def _env_step(env, turn: list[int], tokenizer: BaseTokenizer):
  """The environment's result for one policy turn (its eos, if any, is not text)."""
  if turn and turn[-1] == tokenizer.eos_id:
    turn = turn[:-1]
  return env.step(tokenizer.decode(turn))


def _stop_sets(stop_tokens: tuple[int, ...], row_stops, first: int, n: int
               ) -> list[frozenset[int]]:
  """The stop tokens of each of the chunk's n rows."""
  if row_stops is None:
    return [frozenset(stop_tokens)] * n
  flags = np.asarray(row_stops, bool)[first:first + n]
  return [frozenset(t for t, on in zip(stop_tokens, row) if on) for row in flags]


def _cut_by_limit(turn: list[int], stops: frozenset[int]) -> bool:
  """Whether a policy turn ended at a length limit rather than at one of its stop tokens."""
  return not turn or turn[-1] not in stops


def _fits(completion_length: int, reply: list[int], max_new_tokens: int) -> bool:
  """Whether a reply leaves room for at least one more policy token in the budget."""
  return completion_length + len(reply) < max_new_tokens


def _turns_in_slots(ds, continue_fn, envs, stop_sets, *, tokenizer: BaseTokenizer,
                    batch_size: int, max_new_tokens: int, max_turns: int):
  """The environment loop of a chunk whose rows keep their slots (and caches) across turns.

  Args:
    ds: the decode state after the first turn (`ds.out.tokens` [B, N], `ds.out.lengths`).
    continue_fn: (ds, reply_tokens [B, R], reply_lengths [B]) -> ds: appends the replies
      (rows of length 0 are left alone) and decodes the next turn.
    envs, stop_sets: the chunk's rows' environments and stop tokens.
    tokenizer: decodes each turn for its environment and encodes the replies.
  Returns:
    (final ds, and per row of the chunk: reward, turns, done, truncated).
  """
  n = len(envs)
  turn_start = np.zeros(batch_size, np.int64)
  reward, turns, ended, truncated = [0.0] * n, [0] * n, [False] * n, [False] * n
  live = list(range(n))
  for t in range(max_turns):
    tokens, out_len = jax.device_get((ds.out.tokens, ds.out.lengths))
    replies: dict[int, list[int]] = {}
    for i in live:
      turns[i] += 1
      turn = tokens[i, turn_start[i]:out_len[i]].tolist()
      truncated[i] = _cut_by_limit(turn, stop_sets[i])
      result = _env_step(envs[i], turn, tokenizer)
      if result.done:
        reward[i], ended[i] = float(result.reward), True
      elif result.observation and t + 1 < max_turns:
        reply = tokenizer.encode(result.observation)
        if not reply:
          continue
        if _fits(out_len[i], reply, max_new_tokens):
          replies[i] = reply
        else:  # the budget has no room for the reply and a policy token: the row is cut
          truncated[i] = True
    live = sorted(replies)
    if not live:
      break
    # A reply that fits is shorter than max_new_tokens - 1, so capping the bucket there keeps
    # [last token, reply] within the cache.
    r = min(batching.bucket(max(len(x) for x in replies.values()), batching.REPLY_BUCKETS),
            max_new_tokens - 1)
    reply_tokens = np.zeros((batch_size, r), np.int32)
    reply_lengths = np.zeros((batch_size,), np.int32)
    for i, reply in replies.items():
      reply_tokens[i, :len(reply)] = reply
      reply_lengths[i] = len(reply)
      turn_start[i] = out_len[i] + len(reply)
    ds = continue_fn(ds, reply_tokens, reply_lengths)
  return ds, reward, turns, ended, truncated


def decode_episodes(decoder: decoder_lib.Decoder, graphdef: nnx.GraphDef, state: nnx.State,
                    prompts: Sequence[Sequence[int]], environments: Sequence[Any],
                    rng: jax.Array, *, tokenizer: BaseTokenizer, batch_size: int,
                    max_new_tokens: int, stop_tokens: Sequence[int],
                    row_stops: np.ndarray | None = None, max_turns: int = 16,
                    prompt_buckets: Sequence[int] = batching.PROMPT_BUCKETS
                    ) -> list[Episode]:
  """One episode per (prompt token list, environment), decoded by `decoder` (any of
  decoding/decoder.py: autoregressive, speculative or adaptive) with each chunk's caches
  kept across turns; see the module docstring. `tokenizer` decodes the policy's turns for
  the environments (a turn's final `tokenizer.eos_id` is not text), encodes their replies
  and gives the bos id of the padding rows; `stop_tokens` are ids of the same tokenizer.
  `row_stops` [num_prompts, S] bool selects each prompt's stop tokens (default: all). The
  cache holds the prompt bucket plus `max_new_tokens` plus the decoder's lookahead."""
  stop_tokens = tuple(int(t) for t in stop_tokens)
  _check_inputs(prompts, environments, row_stops, stop_tokens)
  episodes: list[Episode] = []
  for first in range(0, len(prompts), batch_size):
    chunk = [list(p) for p in prompts[first:first + batch_size]]
    envs = list(environments[first:first + batch_size])
    n = len(chunk)
    prompt, lengths = batching.pad_rows(chunk, batch_size, prompt_buckets,
                                       fill_id=tokenizer.bos_id)
    rng, key = jax.random.split(rng)
    lookahead = decoder.lookahead + 1 if decoder.lookahead else 0
    ds = decoder.start(graphdef, state, prompt, lengths, key, max_new_tokens=max_new_tokens,
                       cache_length=prompt.shape[1] + max_new_tokens + lookahead,
                       stop_tokens=stop_tokens,
                       row_stops=_row_stops(row_stops, first, n, batch_size, len(stop_tokens)))
    ds, reward, turns, ended, truncated = _turns_in_slots(
        ds, lambda ds, replies, reply_lengths: decoder.continue_with_reply(
            graphdef, state, ds, replies, reply_lengths),
        envs, _stop_sets(stop_tokens, row_stops, first, n), tokenizer=tokenizer,
        batch_size=batch_size, max_new_tokens=max_new_tokens, max_turns=max_turns)
    out = jax.device_get(ds.out)
    hidden = getattr(out, "hidden", None)
    for i in range(n):
      m = int(out.lengths[i])
      attempted, accepted, forwards = decoder.draft_counts(out, i)
      episodes.append(Episode(
          tokens=out.tokens[i, :m].tolist(), policy_mask=out.policy_mask[i, :m].tolist(),
          logprobs=out.logprobs[i, :m].tolist(), entropy=out.entropy[i, :m].tolist(),
          reward=reward[i], turns=turns[i], done=ended[i], attempted=attempted,
          accepted=accepted, target_forwards=forwards,
          emitted_by_forwards=int(out.emitted_by_forwards[i]), truncated=truncated[i],
          hidden=None if hidden is None else hidden[i, :len(chunk[i]) + m]))
  return episodes


def reencoded_episodes(graphdef: nnx.GraphDef, state: nnx.State,
                       prompts: Sequence[Sequence[int]], environments: Sequence[Any],
                       rng: jax.Array, *, tokenizer: BaseTokenizer, batch_size: int,
                       max_new_tokens: int, params: sampling.SamplingParams,
                       stop_tokens: Sequence[int], row_stops: np.ndarray | None = None,
                       max_turn_tokens: int | None = None, max_turns: int = 16,
                       prompt_buckets: Sequence[int] = batching.PROMPT_BUCKETS
                       ) -> list[Episode]:
  """The baseline without a prefix cache: autoregressive episodes that decode every turn
  from the whole context, packing a chunk's live rows into one batch; contexts are bucketed
  (`prompt_buckets` must hold the longest prompt + completion). Same arguments as
  `decode_episodes` with `decoder_lib.Autoregressive(params, max_turn_tokens)`, and the same
  episodes for the same `rng` up to float rounding (see the module docstring): the
  reference the cached loop is tested against, and the benchmarks' no-cache baseline."""
  stop_tokens = tuple(int(t) for t in stop_tokens)
  _check_inputs(prompts, environments, row_stops, stop_tokens)
  episodes: list[Episode] = []
  for first in range(0, len(prompts), batch_size):
    chunk = [list(p) for p in prompts[first:first + batch_size]]
    n = len(chunk)
    rng, key = jax.random.split(rng)
    episodes += _reencoded_chunk(
        graphdef, state, chunk, list(environments[first:first + batch_size]), key,
        tokenizer=tokenizer, batch_size=batch_size, max_new_tokens=max_new_tokens,
        params=params, stop_tokens=stop_tokens,
        stops=_row_stops(row_stops, first, n, batch_size, len(stop_tokens)),
        stop_sets=_stop_sets(stop_tokens, row_stops, first, n),
        max_turn_tokens=max_turn_tokens, max_turns=max_turns, prompt_buckets=prompt_buckets)
  return episodes


def _reencoded_chunk(graphdef, state, chunk, envs, key, *, tokenizer, batch_size,
                     max_new_tokens, params, stop_tokens, stops, stop_sets, max_turn_tokens,
                     max_turns, prompt_buckets) -> list[Episode]:
  """One chunk's episodes, every turn decoded from the whole context (no prefix cache).

  Each turn packs the live rows into the first slots of one batch; row i always samples
  with its own key (fold_in(key, i), as in `_autoregressive_chunk`), carried across turns.
  """
  n = len(chunk)
  keys = sampling.row_keys(key, batch_size)
  comp = [dict(tokens=[], mask=[], logprobs=[], entropy=[]) for _ in range(n)]
  reward, turns, ended, truncated = [0.0] * n, [0] * n, [False] * n, [False] * n
  forwards = [0] * n
  live = list(range(n))
  for t in range(max_turns):
    if not live:
      break
    contexts = [chunk[i] + comp[i]["tokens"] for i in live]
    tokens, lengths = batching.pad_rows(contexts, batch_size, prompt_buckets,
                                        fill_id=tokenizer.bos_id)
    limits = np.ones(batch_size, np.int32)
    for j, i in enumerate(live):
      budget = max_new_tokens - len(comp[i]["tokens"])
      limits[j] = budget if max_turn_tokens is None else min(budget, max_turn_tokens)
    live_stops = None if stops is None else np.concatenate(
        [stops[live], np.ones((batch_size - len(live), len(stop_tokens)), bool)])
    # The live rows' keys first; the padding rows use the others' (their output is dropped).
    slots = np.array(live + [i for i in range(batch_size) if i not in live])
    ds = autoregressive.start(
        graphdef, state, tokens, lengths, keys[slots], max_new_tokens=max_new_tokens,
        cache_length=tokens.shape[1] + max_new_tokens, params=params,
        stop_tokens=stop_tokens, row_stops=live_stops, row_limits=limits)
    keys = keys.at[np.asarray(live)].set(ds.rng[:len(live)])
    out = jax.device_get(ds.out)
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
      forwards[i] += int(out.emitted_by_forwards[j])
      truncated[i] = _cut_by_limit(turn, stop_sets[i])
      result = _env_step(envs[i], turn, tokenizer)
      if result.done:
        reward[i], ended[i] = float(result.reward), True
        continue
      reply = tokenizer.encode(result.observation) if result.observation else []
      if not reply or t + 1 >= max_turns:
        continue
      if not _fits(len(c["tokens"]), reply, max_new_tokens):
        truncated[i] = True  # the budget has no room for the reply and a policy token
        continue
      c["tokens"] += reply
      c["mask"] += [False] * len(reply)
      c["logprobs"] += [0.0] * len(reply)
      c["entropy"] += [0.0] * len(reply)
      still.append(i)
    live = still
  return [Episode(tokens=c["tokens"], policy_mask=c["mask"], logprobs=c["logprobs"],
                  entropy=c["entropy"], reward=reward[i], turns=turns[i], done=ended[i],
                  attempted=np.zeros(0, np.int64), accepted=np.zeros(0, np.int64),
                  target_forwards=forwards[i], emitted_by_forwards=forwards[i],
                  truncated=truncated[i])
          for i, c in enumerate(comp)]
