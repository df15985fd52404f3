"""Plain autoregressive generation: one target forward per token, a `lax.while_loop`.

The baseline speculative decoding is measured against, and the sampler SFT evaluation uses.

State per row (`DecodeState`): the frontier n (the last position written to the KV cache)
and x_{n+1}, already sampled from p_n. One step runs the target on x_{n+1} at position n+1
(each row at its own position), writes its cache entries, samples x_{n+2} from p_{n+1} and
advances n. Rows stop independently (a stop token, the turn's token limit, or
max_new_tokens); a stopped row's state is frozen, its random key included: a row's key is
split once per token it samples, so its samples depend on its own key and context only,
never on which other rows are still decoding.

Multi-turn (agentic) generation keeps the `DecodeState`, and so the cache, between calls
(as a serving engine's prefix cache does): `start` prefills and decodes the first turn;
`continue_with_reply` appends an environment reply to chosen rows (one target forward over
[x_{n+1}, reply] at each row's own positions writes the cache), samples the next token from
p at the reply's last position and decodes the next turn. Reply tokens are in the output
with `policy_mask` False. `continue_with_reply` donates the state, so the cache is updated
in place. `generate` is a single-turn `start` that returns a `GenerateOutput`.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from bebop_jax.decoding import batching, sampling


@flax.struct.dataclass
class GenerateOutput:
  """Per row: tokens [B, N] (generated only, 0 after the end), lengths [B] (incl. the stop
  token), logprobs [B, N] (sampling distribution), entropy [B, N] (raw policy, nats);
  target_forwards: scalar count of target-model forward calls after the prefill."""
  tokens: jax.Array
  lengths: jax.Array
  logprobs: jax.Array
  entropy: jax.Array
  target_forwards: jax.Array


@flax.struct.dataclass
class DecodeOutput:
  """The output so far of `start` / `continue_with_reply`. Per row: tokens [B, N] (the
  completion: policy turns and, in multi-turn generation, environment replies; 0 after the
  end), lengths [B], policy_mask [B, N] (True where the policy sampled the token, False for
  replies and padding), logprobs [B, N] (sampling distribution; 0 where not sampled),
  entropy [B, N] (raw policy, nats; 0 where not sampled), emitted_by_forwards [B] (target
  forwards the row took part in after each turn's first token, one emitted token each);
  per call: target_forwards (loop forwards, summed over calls; the prefill and reply
  forwards are not counted). With `return_hidden`, hidden [B, P + N, E] float32: the main
  model's h0 at every position it ran on (the prompt's, then each fed token's), indexed by
  position (the completion's token j sits at prompt_length + j; undefined past the last
  token fed, e.g. at the last token itself, which no forward reads): the features a drafter
  trains on
  (bebop_jax/train/drafter.py), free from the forwards decoding runs anyway."""
  tokens: jax.Array
  lengths: jax.Array
  policy_mask: jax.Array
  logprobs: jax.Array
  entropy: jax.Array
  emitted_by_forwards: jax.Array
  target_forwards: jax.Array
  hidden: jax.Array | None = None  # [B, P + N, E] f32 h0 by position, when asked for


@flax.struct.dataclass
class DecodeState:
  """Everything a later `continue_with_reply` needs; `out` is the output so far."""
  rng: jax.Array        # [B] per-row keys, split once per sampled token
  cache: object
  frontier: jax.Array   # [B] n: the last position written to the cache
  token: jax.Array      # [B] x_{n+1}: the last emitted token, sampled from p_n
  limit: jax.Array      # [B] output length at which the current turn stops
  stop: jax.Array       # [B, S] the row's stop tokens (-1: off; batching.stop_table)
  done: jax.Array       # [B]
  out: DecodeOutput


def check_lengths(prompt_len: int, max_new_tokens: int, cache_length: int, extra: int = 0):
  """Raises a clear error when prompt + generation (+ extra) cannot fit the cache."""
  if prompt_len + max_new_tokens + extra > cache_length:
    raise ValueError(
        f"prompts of up to {prompt_len} tokens plus max_new_tokens={max_new_tokens}"
        f"{f' plus {extra} lookahead' if extra else ''} need a cache of "
        f"{prompt_len + max_new_tokens + extra} positions, but cache_length={cache_length}")


def _row_keys(rng: jax.Array, batch: int) -> jax.Array:
  """[B] typed per-row keys: `rng` itself when it holds one key per row ([B] typed or
  [B, 2] raw), else fold_in(rng, row) of one key (sampling.row_keys)."""
  if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)
  if rng.shape == (batch,):
    return rng
  if rng.shape:
    raise ValueError(f"rng has shape {rng.shape}: want one key, or one key per row "
                     f"([{batch}])")
  return sampling.row_keys(rng, batch)


def _emit(s: DecodeState, logits: jax.Array, active: jax.Array,
          params: sampling.SamplingParams) -> DecodeState:
  """Samples x_{n+1} from p_n (`logits` [B, V]) for the active rows [B] and appends it; the
  other rows (their keys included) are left as they are."""
  rng, key = sampling.split_rows(s.rng, 2)
  out, tok = sampling.append_sample(s.out, logits, key, active, params)
  done = jnp.where(active, batching.hits_stop(tok, s.stop) | (out.lengths >= s.limit), s.done)
  return s.replace(rng=jnp.where(active, rng, s.rng), token=jnp.where(active, tok, s.token),
                   done=done, out=out)


def _start(model, w, prompt_tokens, prompt_lengths, rng, *, max_new_tokens, cache_length,
           params, stop_tokens, row_stops, row_limits, max_turn_tokens,
           return_hidden: bool = False) -> DecodeState:
  """Prefills right-padded prompts [B, P] and samples every row's first token."""
  b, p = prompt_tokens.shape
  check_lengths(p, max_new_tokens, cache_length)
  cache = model.init_cache(b, cache_length)
  logits, h0, cache = model.prefill(cache, prompt_tokens, mtp=False, weights=w)
  hidden = None
  if return_hidden:  # padding positions past a prompt are overwritten by its completion
    hidden = jnp.zeros((b, p + max_new_tokens, h0.shape[-1]), jnp.float32).at[:, :p].set(
        h0.astype(jnp.float32))
  lengths = jnp.zeros((b,), jnp.int32)
  limit = batching.turn_limit(lengths, max_new_tokens, max_turn_tokens)
  if row_limits is not None:
    limit = jnp.minimum(limit, jnp.asarray(row_limits, jnp.int32))
  zeros = lambda dt: jnp.zeros((b, max_new_tokens), dt)
  s = DecodeState(
      rng=_row_keys(rng, b), cache=cache, frontier=prompt_lengths - 1,
      token=jnp.zeros((b,), jnp.int32), limit=limit,
      stop=batching.stop_table(stop_tokens, row_stops, b), done=jnp.zeros((b,), bool),
      out=DecodeOutput(tokens=zeros(jnp.int32), lengths=lengths, policy_mask=zeros(bool),
                       logprobs=zeros(jnp.float32), entropy=zeros(jnp.float32),
                       emitted_by_forwards=jnp.zeros((b,), jnp.int32),
                       target_forwards=jnp.int32(0), hidden=hidden))
  # The first token comes from the prefill's logits (at least one token per row).
  return _emit(s, logits[jnp.arange(b), prompt_lengths - 1], jnp.ones((b,), bool), params)


def _write_hidden(out: DecodeOutput, h0: jax.Array, positions: jax.Array) -> DecodeOutput:
  """`out` with h0 [B, C, E] written at positions [B, C] of its hidden states (when it keeps
  them; positions past the end, those of inactive rows, are dropped)."""
  if out.hidden is None:
    return out
  rows = jnp.arange(h0.shape[0])[:, None]
  return out.replace(hidden=out.hidden.at[rows, positions].set(h0.astype(jnp.float32),
                                                                mode="drop"))


def _decode(model, w, s: DecodeState, *, params) -> DecodeState:
  """One target forward per token until every row is done (w: model.loop_weights()). Each
  forward scores the token after the last one, so no forward runs past the last token."""
  cache_length = s.cache.length

  def body(s: DecodeState) -> DecodeState:
    active = ~s.done
    # Done rows write past the cache, where writes are dropped.
    position = jnp.where(active, s.frontier + 1, cache_length)
    logits, h0, cache = model.step(s.cache, s.token[:, None], position, weights=w)
    o = _write_hidden(s.out, h0, position[:, None])
    s = s.replace(cache=cache, frontier=jnp.where(active, s.frontier + 1, s.frontier),
                  out=o.replace(emitted_by_forwards=o.emitted_by_forwards + active,
                                target_forwards=o.target_forwards + 1))
    return _emit(s, logits[:, 0], active, params)

  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, s)


def _append(model, w, s: DecodeState, reply_tokens, reply_lengths, *, params,
            max_turn_tokens) -> DecodeState:
  """Appends reply_tokens[b, :reply_lengths[b]] after row b's last token where
  reply_lengths[b] > 0 and the reply leaves room for a policy token (other rows stay as
  they are), and samples the token after it."""
  b, r = reply_tokens.shape
  rows = jnp.arange(b)
  o = s.out
  max_new_tokens = o.tokens.shape[1]
  active = (reply_lengths > 0) & (o.lengths + reply_lengths < max_new_tokens)
  n = s.frontier
  idx = jnp.arange(r)[None, :]
  in_reply = idx < reply_lengths[:, None]
  # One target forward over [x_{n+1}, reply] at n+1..n+r+1 (inactive rows write past the
  # cache, where writes are dropped; entries past a reply's end are overwritten before
  # anything attends to them).
  chunk = jnp.concatenate([s.token[:, None], reply_tokens], axis=1)
  start = jnp.where(active, n + 1, s.cache.length)
  logits, h0, cache = model.step(s.cache, chunk, start, weights=w)
  o = _write_hidden(o, h0, start[:, None] + jnp.arange(r + 1)[None, :])
  slots = jnp.where(active[:, None] & in_reply, o.lengths[:, None] + idx, max_new_tokens)
  out = o.replace(tokens=o.tokens.at[rows[:, None], slots].set(reply_tokens, mode="drop"),
                  lengths=o.lengths + jnp.where(active, reply_lengths, 0))
  s = s.replace(cache=cache, frontier=jnp.where(active, n + 1 + reply_lengths, n), out=out,
                limit=jnp.where(active, batching.turn_limit(out.lengths, max_new_tokens,
                                                            max_turn_tokens), s.limit))
  # The next policy token from p at the reply's last position (chunk index reply_length).
  return _emit(s, logits[rows, jnp.where(active, reply_lengths, 0)], active, params)


_START_STATIC = ("graphdef", "max_new_tokens", "cache_length", "params", "stop_tokens",
                 "max_turn_tokens", "return_hidden")


@functools.partial(jax.jit, static_argnames=_START_STATIC)
def start(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array,
          prompt_lengths: jax.Array, rng: jax.Array, *, max_new_tokens: int,
          cache_length: int, params: sampling.SamplingParams, stop_tokens: Sequence[int],
          row_stops: jax.Array | None = None, row_limits: jax.Array | None = None,
          max_turn_tokens: int | None = None, return_hidden: bool = False) -> DecodeState:
  """Prefills right-padded prompts [B, P] and decodes the first turn.

  A row's turn ends after any of `stop_tokens` (those of `row_stops` [B, S] bool when
  given; see batching.stop_table), after `max_turn_tokens` or `row_limits[b]` tokens, or at
  `max_new_tokens`, the budget of the whole completion (replies included); at least one
  token is sampled. `rng` is one key (row b uses fold_in(rng, b)) or per-row keys [B].
  The cache holds `cache_length` >= P + max_new_tokens positions. `return_hidden`: the
  output keeps h0 by position (DecodeOutput.hidden). Compiled once per (B, P) and settings.
  """
  model = nnx.merge(graphdef, state)
  w = model.loop_weights()  # once, outside the loop (see Policy.decode_weights)
  s = _start(model, w, prompt_tokens, prompt_lengths, rng, max_new_tokens=max_new_tokens,
             cache_length=cache_length, params=params, stop_tokens=stop_tokens,
             row_stops=row_stops, row_limits=row_limits, max_turn_tokens=max_turn_tokens,
             return_hidden=return_hidden)
  return _decode(model, w, s, params=params)


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "max_turn_tokens"),
                   donate_argnames=("decode_state",))
def continue_with_reply(graphdef: nnx.GraphDef, state: nnx.State, decode_state: DecodeState,
                        reply_tokens: jax.Array, reply_lengths: jax.Array, *,
                        params: sampling.SamplingParams,
                        max_turn_tokens: int | None = None) -> DecodeState:
  """Appends right-padded replies [B, R] and decodes the next turn, with the stop tokens
  `start` was given. Rows with reply_lengths 0 are finished and left alone; a reply that
  would leave no room for a policy token in the completion budget is not appended and its
  row stays done. Compiled once per (B, R) and settings; donates `decode_state`."""
  model = nnx.merge(graphdef, state)
  w = model.loop_weights()
  s = _append(model, w, decode_state, reply_tokens, reply_lengths, params=params,
              max_turn_tokens=max_turn_tokens)
  return _decode(model, w, s, params=params)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "cache_length",
                                             "params", "stop_tokens"))
def generate(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array,
             prompt_lengths: jax.Array, rng: jax.Array, *, max_new_tokens: int,
             cache_length: int, params: sampling.SamplingParams,
             stop_tokens: Sequence[int], row_stops: jax.Array | None = None,
             row_limits: jax.Array | None = None) -> GenerateOutput:
  """Samples up to `max_new_tokens` per row after right-padded prompts [B, P].

  A row stops after emitting any of `stop_tokens` (those of `row_stops` [B, S] bool, when
  given; see batching.stop_table) or after `row_limits[b]` tokens (default max_new_tokens;
  at least one token is sampled). Compiled once per (B, P) and settings.
  """
  model = nnx.merge(graphdef, state)
  w = model.loop_weights()
  s = _start(model, w, prompt_tokens, prompt_lengths, rng, max_new_tokens=max_new_tokens,
             cache_length=cache_length, params=params, stop_tokens=stop_tokens,
             row_stops=row_stops, row_limits=row_limits, max_turn_tokens=None)
  o = _decode(model, w, s, params=params).out
  return GenerateOutput(tokens=o.tokens, lengths=o.lengths, logprobs=o.logprobs,
                        entropy=o.entropy, target_forwards=o.target_forwards)
