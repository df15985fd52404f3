"""Speculative generation with the policy's own MTP drafts (DESIGN.md 4), a `lax.while_loop`.

State per row: the committed sequence, the frontier n (last position whose main hidden state
h0_n is known) and x_{n+1}, already sampled from p_n. One iteration:
  1. Draft: every depth k = 1..K recomputes its window of the last 2K positions ending at n
     (clipped at 0) from the depth below (h0 from the hidden buffer for depth 1) and the
     tokens x_{j+k} (committed, or this iteration's drafts), so every depth-cache entry is
     written with committed tokens before it leaves the window; d_k is drawn from q^k at n
     (sampled, or argmax for greedy_draft / exact).
  2. Verify: one target forward over [x_{n+1}, d_1..d_K] at positions n+1..n+K+1 gives
     p_{n+1}..p_{n+K+1}; `verify` accepts a prefix and draws the next token.
  3. Commit a drafts and the next token; new frontier n + a + 1. Cache entries past it are
     overwritten before anything attends to them.
Rows stop independently (a stop token, or max_new_tokens); a stopped row's state is frozen.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from bebop_jax.decoding import sampling
from bebop_jax.decoding import verify as verify_lib
from bebop_jax.decoding.autoregressive import check_lengths

MODES = verify_lib.MODES


@flax.struct.dataclass
class SpeculativeOutput:
  """Per row: tokens [B, N] (generated, 0 after the end), lengths [B] (incl. the stop token),
  logprobs [B, N] (target sampling distribution), entropy [B, N] (raw target, nats),
  attempted / accepted [B, K] (drafts at depth k verified / accepted; depth k is attempted
  when depths < k were accepted), frontier_depths [B, P + N] (at each position n where a
  draft phase ran: how many depths were verified there, for the self-consistency diagnostic);
  per call: target_forwards (verification forwards after the prefill)."""
  tokens: jax.Array
  lengths: jax.Array
  logprobs: jax.Array
  entropy: jax.Array
  attempted: jax.Array
  accepted: jax.Array
  frontier_depths: jax.Array
  target_forwards: jax.Array


@flax.struct.dataclass
class _State:
  rng: jax.Array
  cache: object
  seq: jax.Array        # [B, L] committed tokens by position (prompt, then generated)
  hidden: jax.Array     # [B, L, E] main hidden states h0 by position
  frontier: jax.Array   # [B] n
  done: jax.Array       # [B]
  out: SpeculativeOutput


def _check_mode(mode: str, params: sampling.SamplingParams):
  if mode not in MODES:
    raise ValueError(f"mode={mode!r} is not allowed: one of {MODES}")
  if (mode == "exact") != params.greedy:
    raise ValueError(f"mode={mode!r} with temperature={params.temperature}: temperature 0 "
                     "needs mode='exact' and mode='exact' needs temperature 0")


@functools.partial(jax.jit, static_argnames=(
    "graphdef", "max_new_tokens", "cache_length", "params", "mode", "stop_tokens",
    "num_draft_steps"))
def generate(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array,
             prompt_lengths: jax.Array, rng: jax.Array, *, max_new_tokens: int,
             cache_length: int, params: sampling.SamplingParams, mode: str,
             stop_tokens: Sequence[int], num_draft_steps: int | None = None
             ) -> SpeculativeOutput:
  """Samples up to `max_new_tokens` per row after right-padded prompts [B, P] with K drafts
  per target forward. Compiled once per (B, P) and settings."""
  _check_mode(mode, params)
  model = nnx.merge(graphdef, state)
  k = model.config.num_draft_steps if num_draft_steps is None else num_draft_steps
  if not 1 <= k <= model.config.num_draft_steps:
    raise ValueError(f"num_draft_steps={k} is not allowed: must be in "
                     f"[1, {model.config.num_draft_steps}]")
  b, p = prompt_tokens.shape
  check_lengths(p, max_new_tokens, cache_length, extra=k + 1)
  window = 2 * k
  buf_len = cache_length + 2 * k + 2  # room for drafts and windows past the cache end
  rows = jnp.arange(b)
  stop = jnp.asarray(stop_tokens, jnp.int32)

  cache = model.init_cache(b, cache_length)
  logits, h0, cache = model.prefill(cache, prompt_tokens)
  seq = jnp.zeros((b, buf_len), jnp.int32).at[:, :p].set(prompt_tokens)
  hidden = jnp.zeros((b, buf_len, h0.shape[-1]), h0.dtype).at[:, :p].set(h0)
  frontier = prompt_lengths - 1
  # x_{n+1} from p_n: the first generated token. Keys are per row (row independence).
  rng, key = sampling.split_rows(sampling.row_keys(rng, b), 2)
  last = logits[rows, frontier]
  logp = sampling.sampling_logprobs(last, params)
  first = sampling.sample(key, logp)
  seq = seq.at[rows, frontier + 1].set(first)
  zeros = lambda dt, n=max_new_tokens: jnp.zeros((b, n), dt)
  out = SpeculativeOutput(
      tokens=zeros(jnp.int32).at[:, 0].set(first), lengths=jnp.ones((b,), jnp.int32),
      logprobs=zeros(jnp.float32).at[:, 0].set(logp[rows, first]),
      entropy=zeros(jnp.float32).at[:, 0].set(sampling.entropy(last)),
      attempted=jnp.zeros((b, k), jnp.int32), accepted=jnp.zeros((b, k), jnp.int32),
      frontier_depths=jnp.zeros((b, p + max_new_tokens), jnp.int32),
      target_forwards=jnp.int32(0))
  done = jnp.isin(first, stop) | (max_new_tokens <= 1)
  init = _State(rng=rng, cache=cache, seq=seq, hidden=hidden, frontier=frontier, done=done,
                out=out)

  def cond(s: _State):
    return ~jnp.all(s.done)

  def body(s: _State):
    rng, verify_key, *draft_keys = sampling.split_rows(s.rng, k + 2)
    n = s.frontier
    cache = s.cache
    # 1. Draft through the MTP chain over each row's window.
    start = jnp.maximum(n - window + 1, 0)
    win = start[:, None] + jnp.arange(window)[None, :]
    at_n = n - start
    h_prev = s.hidden[rows[:, None], win]
    seq = s.seq
    drafts, draft_probs = [], []
    for depth in range(1, k + 1):
      q_logits, h_prev, cache = model.mtp_step(cache, depth, h_prev, seq[rows[:, None],
                                                                       win + depth], start)
      q_logp = sampling.sampling_logprobs(q_logits[rows, at_n], params)
      if mode in ("greedy_draft", "exact"):
        d = jnp.argmax(q_logp, axis=-1).astype(jnp.int32)
      else:
        d = sampling.sample(draft_keys[depth - 1], q_logp)
      seq = seq.at[rows, n + 1 + depth].set(d)
      drafts.append(d)
      draft_probs.append(jnp.exp(q_logp))
    drafts = jnp.stack(drafts, axis=1)
    draft_probs = jnp.stack(draft_probs, axis=1)
    # 2. Verify with one target forward over [x_{n+1}, d_1..d_K].
    chunk = seq[rows[:, None], n[:, None] + 1 + jnp.arange(k + 1)[None, :]]
    t_logits, t_hidden, cache = model.step(cache, chunk, n + 1)
    t_logp = sampling.sampling_logprobs(t_logits, params)
    num_acc, nxt = verify_lib.verify(verify_key, drafts, draft_probs, jnp.exp(t_logp), mode)
    # 3. Commit: emitted tokens e_0..e_a = d_1..d_a, next; e_i sits at position n+2+i and is
    # scored by p_{n+1+i} (chunk index i).
    idx = jnp.arange(k + 1)[None, :]
    emitted = jnp.where(idx < num_acc[:, None],
                        jnp.concatenate([drafts, drafts[:, :1]], axis=1), nxt[:, None])
    count = num_acc + 1
    o = s.out
    room = max_new_tokens - o.lengths
    is_stop = jnp.isin(emitted, stop) & (idx < count[:, None])
    first_stop = jnp.argmax(is_stop, axis=1)
    count = jnp.where(jnp.any(is_stop, axis=1), first_stop + 1, count)
    count = jnp.minimum(count, room)
    active = ~s.done
    count = jnp.where(active, count, 0)
    valid = idx < count[:, None]
    slots = jnp.where(valid, o.lengths[:, None] + idx, max_new_tokens)  # dropped if invalid
    emitted_logp = jnp.take_along_axis(t_logp, emitted[..., None], axis=-1)[..., 0]
    emitted_ent = sampling.entropy(t_logits)
    depth_idx = jnp.arange(k)[None, :]
    out = o.replace(
        tokens=o.tokens.at[rows[:, None], slots].set(emitted, mode="drop"),
        logprobs=o.logprobs.at[rows[:, None], slots].set(emitted_logp, mode="drop"),
        entropy=o.entropy.at[rows[:, None], slots].set(emitted_ent, mode="drop"),
        lengths=o.lengths + count,
        attempted=o.attempted + (active[:, None] & (depth_idx <= num_acc[:, None])),
        accepted=o.accepted + (active[:, None] & (depth_idx < num_acc[:, None])),
        frontier_depths=o.frontier_depths.at[rows, jnp.where(active, n, buf_len)].set(
            jnp.minimum(num_acc + 1, k), mode="drop"),
        target_forwards=o.target_forwards + 1)
    # Committed tokens by position (only the emitted ones; drafts past them are scratch).
    positions = jnp.where(valid, n[:, None] + 2 + idx, buf_len)
    new_seq = s.seq.at[rows[:, None], positions].set(emitted, mode="drop")
    h_pos = jnp.where(active[:, None], n[:, None] + 1 + idx, buf_len)
    hidden = s.hidden.at[rows[:, None], h_pos].set(t_hidden, mode="drop")
    frontier = jnp.where(active, n + count, n)
    done = s.done | jnp.any(is_stop & valid, axis=1) | (out.lengths >= max_new_tokens)
    return _State(rng=rng, cache=cache, seq=new_seq, hidden=hidden, frontier=frontier,
                  done=done, out=out)

  return jax.lax.while_loop(cond, body, init).out
