"""Plain autoregressive generation: one target forward per token, a `lax.while_loop`.

The baseline speculative decoding is measured against, and the sampler SFT evaluation uses.
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
class _LoopState:
  step: jax.Array    # tokens emitted so far (the output slot of the next one)
  rng: jax.Array
  token: jax.Array   # [B] the last emitted token (input of the next forward)
  cache: object
  done: jax.Array
  out: GenerateOutput


def check_lengths(prompt_len: int, max_new_tokens: int, cache_length: int, extra: int = 0):
  """Raises a clear error when prompt + generation (+ extra) cannot fit the cache."""
  if prompt_len + max_new_tokens + extra > cache_length:
    raise ValueError(
        f"prompts of up to {prompt_len} tokens plus max_new_tokens={max_new_tokens}"
        f"{f' plus {extra} lookahead' if extra else ''} need a cache of "
        f"{prompt_len + max_new_tokens + extra} positions, but cache_length={cache_length}")


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
  b, p = prompt_tokens.shape
  check_lengths(p, max_new_tokens, cache_length)
  model = nnx.merge(graphdef, state)
  cache = model.init_cache(b, cache_length)
  w = model.loop_weights()  # once, outside the loop (see Policy.decode_weights)
  logits, _, cache = model.prefill(cache, prompt_tokens, mtp=False, weights=w)
  rows = jnp.arange(b)
  stop = batching.stop_table(stop_tokens, row_stops, b)
  limit = (jnp.full((b,), max_new_tokens, jnp.int32) if row_limits is None
           else jnp.minimum(jnp.asarray(row_limits, jnp.int32), max_new_tokens))
  zeros = lambda dt: jnp.zeros((b, max_new_tokens), dt)

  def emit(s: _LoopState, logits: jax.Array) -> _LoopState:
    """Samples token `s.step` of every active row from its logits [B, V]."""
    rng, key = sampling.split_rows(s.rng, 2)
    logp = sampling.sampling_logprobs(logits, params)
    active = ~s.done
    tok = jnp.where(active, sampling.sample(key, logp), 0)
    o = s.out
    out = o.replace(
        tokens=o.tokens.at[:, s.step].set(tok),
        lengths=o.lengths + active,
        logprobs=o.logprobs.at[:, s.step].set(jnp.where(active, logp[rows, tok], 0.0)),
        entropy=o.entropy.at[:, s.step].set(jnp.where(active, sampling.entropy(logits), 0.0)))
    done = s.done | batching.hits_stop(tok, stop) | (s.step + 1 >= limit)
    return s.replace(step=s.step + 1, rng=rng, token=tok, done=done, out=out)

  init = _LoopState(
      step=jnp.int32(0), rng=sampling.row_keys(rng, b), token=jnp.zeros((b,), jnp.int32),
      cache=cache, done=jnp.zeros((b,), bool),
      out=GenerateOutput(tokens=zeros(jnp.int32), lengths=jnp.zeros((b,), jnp.int32),
                         logprobs=zeros(jnp.float32), entropy=zeros(jnp.float32),
                         target_forwards=jnp.int32(0)))
  # The first token comes from the prefill's logits; each forward then scores the token
  # after the last one, so no forward runs past the last token.
  first = emit(init, logits[rows, prompt_lengths - 1])

  def body(s: _LoopState):
    logits, _, cache = model.step(s.cache, s.token[:, None], prompt_lengths + s.step - 1,
                                  weights=w)
    s = s.replace(cache=cache, out=s.out.replace(target_forwards=s.out.target_forwards + 1))
    return emit(s, logits[:, 0])

  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, first).out
