"""One protocol for the three decoders: autoregressive, speculative with a fixed K, and
speculative with an adaptive K.

A decoder is a small value that holds how to decode (sampling parameters, verification
mode, draft length, reduced draft vocabulary, per-turn limit); the policy, the prompts and
the stop tokens are the call's. Every decoder has the same five members:

  out = decoder.generate(graphdef, params, prompt_tokens [B, P], prompt_lengths [B], rng, *,
                         max_new_tokens, cache_length, stop_tokens, row_stops=None)
      one turn, no state kept: the output only (what a benchmark or a single-turn rollout
      times);

  state = decoder.start(graphdef, params, prompt_tokens [B, P], prompt_lengths [B], rng, *,
                        max_new_tokens, cache_length, stop_tokens, row_stops=None)
      prefills the prompts and decodes the first turn (until a stop token, the per-turn
      limit or the completion budget);
  state = decoder.continue_with_reply(graphdef, params, state, reply_tokens [B, R],
                                      reply_lengths [B])
      appends environment replies (rows of length 0 are left alone) and decodes the next
      turn, the cache kept (the state is donated);
  decoder.lookahead
      cache positions the decoder writes beyond prompt + completion (its draft window);
  decoder.draft_counts(out, i) -> (attempted [K], accepted [K], target_forwards)
      row i's per-depth draft counts and its target forwards after each turn's first token
      (K = 0 and one forward per emitted token for autoregressive decoding).

`state.out` is the output so far; every decoder's has tokens, lengths, policy_mask,
logprobs, entropy and emitted_by_forwards per row (autoregressive.DecodeOutput,
speculative.SpeculativeOutput). The episode loop (rollout/episodes.py) and the rollout
engine take any decoder, so neither branches on the kind of decoding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bebop_jax.decoding import adaptive, autoregressive, sampling, segments, speculative


class Decoder(Protocol):
  """What the episode loop and single-turn callers need of a decoder (module docstring)."""
  lookahead: int

  def generate(self, graphdef, params, prompt_tokens, prompt_lengths, rng, *,
               max_new_tokens: int, cache_length: int, stop_tokens: Sequence[int],
               row_stops=None) -> Any: ...

  def start(self, graphdef, params, prompt_tokens, prompt_lengths, rng, *,
            max_new_tokens: int, cache_length: int, stop_tokens: Sequence[int],
            row_stops=None) -> Any: ...

  def continue_with_reply(self, graphdef, params, state, reply_tokens,
                          reply_lengths) -> Any: ...

  def draft_counts(self, out, i: int) -> tuple[np.ndarray, np.ndarray, int]: ...


@functools.lru_cache(maxsize=8)
def _vocab(draft_vocab: tuple[int, ...] | None) -> jax.Array | None:
  """The draft vocabulary's ids on the device, put there once per vocabulary rather than at
  every turn of every chunk."""
  return None if draft_vocab is None else jnp.asarray(draft_vocab, jnp.int32)


@dataclasses.dataclass(frozen=True)
class Autoregressive:
  """One target forward per token (autoregressive.start / continue_with_reply).
  `return_hidden`: the output keeps h0 by position (DecodeOutput.hidden)."""
  params: sampling.SamplingParams
  max_turn_tokens: int | None = None
  return_hidden: bool = False
  lookahead: int = dataclasses.field(default=0, init=False)

  def generate(self, graphdef, params, prompt_tokens, prompt_lengths, rng, *, max_new_tokens,
               cache_length, stop_tokens, row_stops=None):
    return autoregressive.generate(
        graphdef, params, prompt_tokens, prompt_lengths, rng,
        max_new_tokens=_turn_budget(max_new_tokens, self.max_turn_tokens),
        cache_length=cache_length, params=self.params, stop_tokens=tuple(stop_tokens),
        row_stops=row_stops)

  def start(self, graphdef, params, prompt_tokens, prompt_lengths, rng, *, max_new_tokens,
            cache_length, stop_tokens, row_stops=None):
    return autoregressive.start(
        graphdef, params, prompt_tokens, prompt_lengths, rng, max_new_tokens=max_new_tokens,
        cache_length=cache_length, params=self.params, stop_tokens=tuple(stop_tokens),
        row_stops=row_stops, max_turn_tokens=self.max_turn_tokens,
        return_hidden=self.return_hidden)

  def continue_with_reply(self, graphdef, params, state, reply_tokens, reply_lengths):
    return autoregressive.continue_with_reply(
        graphdef, params, state, reply_tokens, reply_lengths, params=self.params,
        max_turn_tokens=self.max_turn_tokens)

  def draft_counts(self, out, i):
    forwards = int(out.emitted_by_forwards[i])  # one emitted token per forward
    return np.zeros(0, np.int64), np.zeros(0, np.int64), forwards


def _turn_budget(max_new_tokens: int, max_turn_tokens: int | None) -> int:
  return max_new_tokens if max_turn_tokens is None else min(max_new_tokens, max_turn_tokens)


def _speculative_counts(out, i):
  return (np.asarray(out.attempted[i], np.int64), np.asarray(out.accepted[i], np.int64),
          int(out.row_forwards[i]))


@dataclasses.dataclass(frozen=True)
class Speculative:
  """K = `num_draft_steps` MTP drafts per target forward (None: the model's depth), verified
  by `mode` (speculative.start / continue_with_reply). `draft_vocab`: token ids the drafter
  is restricted to (None: the whole head)."""
  params: sampling.SamplingParams
  mode: str
  num_draft_steps: int
  max_turn_tokens: int | None = None
  draft_vocab: tuple[int, ...] | None = None

  @property
  def lookahead(self) -> int:
    return self.num_draft_steps

  def generate(self, graphdef, params, prompt_tokens, prompt_lengths, rng, *, max_new_tokens,
               cache_length, stop_tokens, row_stops=None):
    return speculative.generate(
        graphdef, params, prompt_tokens, prompt_lengths, rng,
        max_new_tokens=_turn_budget(max_new_tokens, self.max_turn_tokens),
        cache_length=cache_length, params=self.params, mode=self.mode,
        stop_tokens=tuple(stop_tokens), row_stops=row_stops,
        num_draft_steps=self.num_draft_steps, draft_vocab=_vocab(self.draft_vocab))

  def start(self, graphdef, params, prompt_tokens, prompt_lengths, rng, *, max_new_tokens,
            cache_length, stop_tokens, row_stops=None):
    return speculative.start(
        graphdef, params, prompt_tokens, prompt_lengths, rng, max_new_tokens=max_new_tokens,
        cache_length=cache_length, params=self.params, mode=self.mode,
        stop_tokens=tuple(stop_tokens), row_stops=row_stops,
        num_draft_steps=self.num_draft_steps, max_turn_tokens=self.max_turn_tokens,
        draft_vocab=_vocab(self.draft_vocab))

  def continue_with_reply(self, graphdef, params, state, reply_tokens, reply_lengths):
    return speculative.continue_with_reply(
        graphdef, params, state, reply_tokens, reply_lengths, params=self.params,
        mode=self.mode, max_turn_tokens=self.max_turn_tokens,
        draft_vocab=_vocab(self.draft_vocab))

  def draft_counts(self, out, i):
    return _speculative_counts(out, i)


@dataclasses.dataclass
class Adaptive:
  """Speculative decoding with K chosen per segment from live acceptance and measured cost
  (decoding/segments.py), up to `settings.k_max`; the estimate is seeded with `acceptance`
  (the drafter's measured per-depth acceptance; None: optimistic). Each call's
  segments.Stats is appended to `stats`."""
  params: sampling.SamplingParams
  mode: str
  settings: adaptive.Settings
  acceptance: Sequence[float] | None = None
  max_turn_tokens: int | None = None
  draft_vocab: tuple[int, ...] | None = None
  stats: list = dataclasses.field(default_factory=list)

  @property
  def lookahead(self) -> int:
    return max(self.settings.k_max, 1)

  def _common(self):
    return dict(params=self.params, mode=self.mode, settings=self.settings,
                acceptance=self.acceptance, max_turn_tokens=self.max_turn_tokens,
                draft_vocab=_vocab(self.draft_vocab))

  def generate(self, graphdef, params, prompt_tokens, prompt_lengths, rng, *, max_new_tokens,
               cache_length, stop_tokens, row_stops=None):
    common = self._common()
    del common["max_turn_tokens"]
    out, st = segments.generate(
        graphdef, params, prompt_tokens, prompt_lengths, rng,
        max_new_tokens=_turn_budget(max_new_tokens, self.max_turn_tokens),
        cache_length=cache_length, stop_tokens=tuple(stop_tokens), row_stops=row_stops,
        **common)
    self.stats.append(st)
    return out

  def start(self, graphdef, params, prompt_tokens, prompt_lengths, rng, *, max_new_tokens,
            cache_length, stop_tokens, row_stops=None):
    state, st = segments.start(graphdef, params, prompt_tokens, prompt_lengths, rng,
                               max_new_tokens=max_new_tokens, cache_length=cache_length,
                               stop_tokens=tuple(stop_tokens), row_stops=row_stops,
                               **self._common())
    self.stats.append(st)
    return state

  def continue_with_reply(self, graphdef, params, state, reply_tokens, reply_lengths):
    state, st = segments.continue_with_reply(graphdef, params, state, reply_tokens,
                                             reply_lengths, **self._common())
    self.stats.append(st)
    return state

  def draft_counts(self, out, i):
    return _speculative_counts(out, i)

  def k_iterations(self) -> dict[int, int]:
    """Iterations run at each K over every call so far."""
    total: dict[int, int] = {}
    for st in self.stats:
      for k, n in st.k_iterations.items():
        total[k] = total.get(k, 0) + n
    return total
