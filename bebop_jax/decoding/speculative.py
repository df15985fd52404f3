"""Speculative generation with the policy's own MTP drafts (DESIGN.md 4), a `lax.while_loop`.

State per row: the committed sequence, the frontier n (last position whose main hidden state
h0_n is known) and x_{n+1}, already sampled from p_n. One iteration:
  1. Draft: every depth k = 1..K recomputes its window of the last K+1 positions ending at
     n (clipped at 0) from the depth below (h0 from the hidden buffer for depth 1) and the
     tokens x_{j+k} (committed, or this iteration's drafts); d_k is drawn from q^k at n
     (sampled, or argmax for greedy_draft / exact). The window keeps DESIGN.md's invariant
     (every depth-cache entry is written with committed tokens before it leaves the window):
     the frontier advances by a + 1 <= K + 1, so the window covers every position not yet
     written; an entry at j written with draft d_m (m = j + k - n - 1 in 1..k-1) is wrong
     only when d_m is not committed (rejected, a < m; or cut by a stop token, which ends
     the turn), and then j > n + 1 + a - K, i.e. inside the next window [n' - K, n'] with
     n' = n + a + 1 (or inside the repair window of `continue_with_reply`, which starts at
     n' - K too). So an entry that falls below the window is exact, and it is never written
     again; the depth-(k-1) hidden states a window needs come from the same window one
     depth down.
  2. Verify: one target forward over [x_{n+1}, d_1..d_K] at positions n+1..n+K+1 gives
     p_{n+1}..p_{n+K+1}; `verify` accepts a prefix and draws the next token.
  3. Commit a drafts and the next token; new frontier n + a + 1. Cache entries past it are
     overwritten before anything attends to them.
Rows stop independently (a stop token, the turn's token limit, or max_new_tokens); a stopped
row's state is frozen.

The modes of temperature > 0 (rejection, greedy_draft, strict, block) share one compiled
program per shape: the mode is an argument of the program (an index into
verification.SAMPLED_MODES), not of its compilation. Drafts are argmax(log q + g) with the Gumbel noise g scaled by 0
for greedy_draft (argmax q) and 1 otherwise (a sample of q), and verification selects its
rule elementwise. The outputs are bitwise those of a loop compiled for one mode, at the cost
of a few elementwise ops on [B, K, V] per iteration; it saves compiling the whole loop per
mode (a decoding loop is the expensive program to compile: its layers are unrolled).
`exact` (temperature 0) is its own program.

Multi-turn (agentic) generation keeps the `DecodeState` between calls: `start` prefills and
decodes the first turn; `continue_with_reply` appends an environment reply to chosen rows
(one target forward over [x_{n+1}, reply] writes the main cache and the hidden states, then
every MTP depth rewrites the positions from the old frontier's window to the new frontier,
so the drafting invariant holds), samples the next token from p at the reply's last position and
decodes the next turn. Reply tokens are in the output with `policy_mask` False. Both calls
donate the state, so caches are updated in place.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bebop_jax.decoding import batching, sampling
from bebop_jax.decoding import verification as verify_lib
from bebop_jax.decoding.autoregressive import check_lengths

MODES = verify_lib.MODES
_GREEDY_DRAFT = verify_lib.SAMPLED_MODES.index("greedy_draft")


@flax.struct.dataclass
class SpeculativeOutput:
  """Per row: tokens [B, N] (the completion: generated tokens and, in multi-turn generation,
  environment replies; 0 after the end), lengths [B], policy_mask [B, N] (True where the
  policy sampled the token, False for replies and padding), logprobs [B, N] (target sampling
  distribution; 0 where not sampled), entropy [B, N] (raw target, nats), attempted /
  accepted [B, K] (drafts at depth k verified / accepted; depth k is attempted when depths
  < k were accepted and the token it decides is emitted, i.e. not past a stop token or the
  length limit), emitted_by_forwards [B] (policy tokens emitted by the verifications the
  row took part in: each iteration's count, summed; a turn's first token comes from the
  prefill or the reply's forward and is not counted; `tokens_per_target_forward`),
  frontier_depths [B, P + N] (at each position n where a draft phase ran: how many depths
  were verified there, for the self-consistency diagnostic), row_forwards [B] (the target
  forwards the row took part in after each turn's first token: its verifications, its
  depth-1 attempts attempted[:, 0], plus adaptive decoding's autoregressive steps); per
  call: target_forwards (loop forwards after the prefill, summed over calls)."""
  tokens: jax.Array
  lengths: jax.Array
  policy_mask: jax.Array
  logprobs: jax.Array
  entropy: jax.Array
  attempted: jax.Array
  accepted: jax.Array
  emitted_by_forwards: jax.Array
  frontier_depths: jax.Array
  row_forwards: jax.Array
  target_forwards: jax.Array


def tokens_per_target_forward(emitted_by_forwards, target_forwards) -> float:
  """Policy tokens emitted by target forwards per target forward, over all rows.

  Args:
    emitted_by_forwards: [B] per row, the tokens its target forwards emitted (a
      verification emits its accepted drafts and the next token, cut at a stop token or a
      length limit; an autoregressive step emits one token).
    target_forwards: [B] per row, the target forwards it took part in after each turn's
      first token (verifications, or autoregressive steps).
  Returns:
    sum(emitted_by_forwards) / sum(target_forwards) (0.0 when there were no forwards).
    Each turn's first token comes from the prefill (or the reply's forward) and is in
    neither count, so an autoregressive row gives exactly 1.
  """
  forwards = int(np.sum(target_forwards))
  return float(np.sum(emitted_by_forwards) / forwards) if forwards else 0.0


@flax.struct.dataclass
class DecodeState:
  """Everything a later `continue_with_reply` needs; `out` is the output so far."""
  rng: jax.Array
  cache: object
  seq: jax.Array        # [B, L] committed tokens by position (prompt, then completion)
  hidden: jax.Array     # [B, L, E] main hidden states h0 by position
  frontier: jax.Array   # [B] n
  limit: jax.Array      # [B] output length at which the current turn stops
  stop: jax.Array       # [B, S] the row's stop tokens (-1: off; batching.stop_table)
  done: jax.Array       # [B]
  synced: jax.Array     # [B, K] depth k's cache entries below synced[:, k-1] are exact
  out: SpeculativeOutput


def _check_mode(mode: str, params: sampling.SamplingParams):
  if mode not in MODES:
    raise ValueError(f"mode={mode!r} is not allowed: one of {MODES}")
  if (mode == "exact") != params.greedy:
    raise ValueError(f"mode={mode!r} with temperature={params.temperature}: temperature 0 "
                     "needs mode='exact' and mode='exact' needs temperature 0")


def _num_drafts(model, num_draft_steps: int | None) -> int:
  k = model.config.num_draft_steps if num_draft_steps is None else num_draft_steps
  if not 1 <= k <= model.config.num_draft_steps:
    raise ValueError(f"num_draft_steps={k} is not allowed: must be in "
                     f"[1, {model.config.num_draft_steps}]")
  return k


def _emit_sampled(s: DecodeState, logits: jax.Array, key: jax.Array, active: jax.Array,
                  params: sampling.SamplingParams) -> DecodeState:
  """Samples x_{n+1} from p_n (`logits` [B, V]) for the active rows and appends it."""
  rows = jnp.arange(logits.shape[0])
  out, tok = sampling.append_sample(s.out, logits, key, active, params)
  seq = s.seq.at[rows, jnp.where(active, s.frontier + 1, s.seq.shape[1])].set(tok, mode="drop")
  done = jnp.where(active, batching.hits_stop(tok, s.stop) | (out.lengths >= s.limit), s.done)
  return s.replace(seq=seq, out=out, done=done)


def _start(model, w, prompt_tokens, prompt_lengths, rng, *, k, max_new_tokens, cache_length,
           params, stop_tokens, row_stops, max_turn_tokens, draft_prefill=True) -> DecodeState:
  """Prefills the main cache and, with `draft_prefill`, depths 1..k (otherwise `synced` is 0
  and `_catch_up` fills them when a segment first drafts), and samples the first token."""
  b, p = prompt_tokens.shape
  check_lengths(p, max_new_tokens, cache_length, extra=k + 1)
  buf_len = cache_length + 2 * k + 2  # room for drafts and windows past the cache end
  rows = jnp.arange(b)
  cache = model.init_cache(b, cache_length)
  logits, h0, cache = model.prefill(cache, prompt_tokens, mtp=draft_prefill, weights=w)
  zeros = lambda dt, n=max_new_tokens: jnp.zeros((b, n), dt)
  lengths = jnp.zeros((b,), jnp.int32)
  s = DecodeState(
      rng=sampling.row_keys(rng, b), cache=cache,
      seq=jnp.zeros((b, buf_len), jnp.int32).at[:, :p].set(prompt_tokens),
      hidden=jnp.zeros((b, buf_len, h0.shape[-1]), h0.dtype).at[:, :p].set(h0),
      frontier=prompt_lengths - 1,
      limit=batching.turn_limit(lengths, max_new_tokens, max_turn_tokens),
      stop=batching.stop_table(stop_tokens, row_stops, b), done=jnp.zeros((b,), bool),
      # Depth d is exact below n + 1 - d after a prefill (its token x_{j+d} is in the
      # prompt), below 0 without one.
      synced=(jnp.maximum(prompt_lengths[:, None] - jnp.arange(1, k + 1)[None, :], 0)
              if draft_prefill else jnp.zeros((b, k), jnp.int32)),
      out=SpeculativeOutput(
          tokens=zeros(jnp.int32), lengths=lengths, policy_mask=zeros(bool),
          logprobs=zeros(jnp.float32), entropy=zeros(jnp.float32),
          attempted=jnp.zeros((b, k), jnp.int32), accepted=jnp.zeros((b, k), jnp.int32),
          emitted_by_forwards=jnp.zeros((b,), jnp.int32),
          frontier_depths=jnp.zeros((b, p + max_new_tokens), jnp.int32),
          row_forwards=jnp.zeros((b,), jnp.int32), target_forwards=jnp.int32(0)))
  # x_{n+1} from p_n: the first generated token. Keys are per row (row independence).
  rng, key = sampling.split_rows(s.rng, 2)
  s = s.replace(rng=rng)
  return _emit_sampled(s, logits[rows, s.frontier], key, jnp.ones((b,), bool), params)


def _decode(model, w, s: DecodeState, *, params, mode, draft_vocab=None, k=None,
            iterations=None) -> DecodeState:
  """Runs the draft-verify-commit loop until every row is done (w: model.loop_weights()).
  mode: "exact", or a traced int32 index into verification.SAMPLED_MODES.
  draft_vocab: optional [V_d] token ids (draft_vocab.py): the drafts come from the head's
  columns of those tokens only, and q is 0 on every other token, which the verification
  (rejection, block, ...) covers exactly.
  k: drafts per iteration, 1..K of the state (default K); iterations: optional traced
  bound on the iterations run (a segment of adaptive decoding, `segment`)."""
  b = s.seq.shape[0]
  buf_len = s.seq.shape[1]
  k_state = s.out.attempted.shape[1]
  k = k_state if k is None else k
  max_new_tokens = s.out.tokens.shape[1]
  window = k + 1  # see the module docstring: the narrowest window that keeps the invariant
  rows = jnp.arange(b)
  vocab = model.config.vocab_size
  draft_head = None
  if draft_vocab is not None:  # the sub-head, sliced once before the loop
    head = (w if w is not None else model.decode_weights())["shared"]["head"]
    draft_head = jnp.take(head, draft_vocab, axis=1)
  turn_start = s.out.lengths

  def cond(s: DecodeState):
    return ~jnp.all(s.done)

  def body(s: DecodeState):
    rng, verify_key, draft_key = sampling.split_rows(s.rng, 3)
    # The uniforms of all K draft samples in one PRNG call (sampling.categorical).
    draft_u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(draft_key)
    n = s.frontier
    cache = s.cache
    # 1. Draft through the MTP chain over each row's window. Depth k at window position
    # start + i takes x_{start+i+k}: committed up to n + 1, this iteration's drafts after, so
    # the tokens of every depth are slices of one gather of the committed sequence with the
    # drafts written in as they are drawn.
    start = jnp.maximum(n - window + 1, 0)
    offsets = jnp.arange(window + k)[None, :]
    win = start[:, None] + offsets[:, :window]
    at_n = n - start
    h_prev = s.hidden[rows[:, None], win]
    ext = s.seq[rows[:, None], start[:, None] + offsets]  # x at start .. start + W + K - 1
    drafts, draft_probs = [], []
    for depth in range(1, k + 1):
      q_logits, h_prev, cache = model.mtp_step(cache, depth, h_prev,
                                               ext[:, depth:depth + window], start, at_n,
                                               weights=w, draft_head=draft_head)
      q_logp = sampling.sampling_logprobs(q_logits, params)
      q = jnp.exp(q_logp)
      d = jnp.argmax(q_logp, axis=-1).astype(jnp.int32)
      if not isinstance(mode, str):  # an index into SAMPLED_MODES: greedy_draft drafts argmax q
        d = jnp.where(mode == _GREEDY_DRAFT, d,
                      sampling.categorical(draft_u[:, depth - 1], q))
      if draft_vocab is not None:  # back to token ids; q is 0 off the draft vocabulary
        d = draft_vocab[d]
        q = jnp.zeros((b, vocab), q.dtype).at[:, draft_vocab].set(q)
      if depth < k:  # d_K is not an input of any depth
        ext = jnp.where(offsets == (at_n + 1 + depth)[:, None], d[:, None], ext)
      drafts.append(d)
      draft_probs.append(q)
    drafts = jnp.stack(drafts, axis=1)
    draft_probs = jnp.stack(draft_probs, axis=1)
    # 2. Verify with one target forward over [x_{n+1}, d_1..d_K].
    chunk = jnp.concatenate([s.seq[rows, n + 1][:, None], drafts], axis=1)
    t_logits, t_hidden, cache = model.step(cache, chunk, n + 1, weights=w)
    t_logp = sampling.sampling_logprobs(t_logits, params)
    num_acc, nxt = verify_lib.verify(verify_key, drafts, draft_probs, jnp.exp(t_logp), mode)
    # 3. Commit: emitted tokens e_0..e_a = d_1..d_a, next; e_i sits at position n+2+i and is
    # scored by p_{n+1+i} (chunk index i).
    idx = jnp.arange(k + 1)[None, :]
    emitted = jnp.where(idx < num_acc[:, None],
                        jnp.concatenate([drafts, drafts[:, :1]], axis=1), nxt[:, None])
    count = num_acc + 1
    o = s.out
    is_stop = batching.hits_stop(emitted, s.stop) & (idx < count[:, None])
    first_stop = jnp.argmax(is_stop, axis=1)
    count = jnp.where(jnp.any(is_stop, axis=1), first_stop + 1, count)
    count = jnp.minimum(count, s.limit - o.lengths)
    active = ~s.done
    count = jnp.where(active, count, 0)
    valid = idx < count[:, None]
    slots = jnp.where(valid, o.lengths[:, None] + idx, max_new_tokens)  # dropped if invalid
    emitted_logp = jnp.take_along_axis(t_logp, emitted[..., None], axis=-1)[..., 0]
    emitted_ent = sampling.entropy(t_logits, params, t_logp)
    # Depth j decides emitted token j-1, so it counts as attempted (accepted) only when that
    # token is emitted: drafts past a stop token or the length limit decide nothing.
    depth_idx = jnp.arange(k_state)[None, :]
    attempted_depths = jnp.minimum(jnp.minimum(num_acc + 1, count), k)
    accepted_depths = jnp.minimum(num_acc, count)
    out = o.replace(
        tokens=o.tokens.at[rows[:, None], slots].set(emitted, mode="drop"),
        logprobs=o.logprobs.at[rows[:, None], slots].set(emitted_logp, mode="drop"),
        entropy=o.entropy.at[rows[:, None], slots].set(emitted_ent, mode="drop"),
        lengths=o.lengths + count,
        attempted=o.attempted + (depth_idx < attempted_depths[:, None]),
        accepted=o.accepted + (depth_idx < accepted_depths[:, None]),
        emitted_by_forwards=o.emitted_by_forwards + count,
        row_forwards=o.row_forwards + active,
        frontier_depths=o.frontier_depths.at[rows, jnp.where(active, n, buf_len)].set(
            attempted_depths, mode="drop"),
        target_forwards=o.target_forwards + 1)
    # Committed tokens by position (only the emitted ones; drafts past them are scratch).
    positions = jnp.where(valid, n[:, None] + 2 + idx, buf_len)
    new_seq = s.seq.at[rows[:, None], positions].set(emitted, mode="drop")
    h_pos = jnp.where(active[:, None], n[:, None] + 1 + idx, buf_len)
    hidden = s.hidden.at[rows[:, None], h_pos].set(t_hidden, mode="drop")
    frontier = jnp.where(active, n + count, n)
    done = s.done | jnp.any(is_stop & valid, axis=1) | (out.lengths >= s.limit)
    return s.replace(rng=rng, cache=cache, seq=new_seq, hidden=hidden, frontier=frontier,
                     done=done, out=out)

  s = _loop(cond, body, s, iterations)
  # Every depth up to k is exact below the next window (the module docstring).
  synced = s.synced.at[:, :k].set(jnp.maximum(s.frontier - k, 0)[:, None])
  # Every token the loop emitted was sampled by the policy.
  slot = jnp.arange(max_new_tokens)[None, :]
  emitted = (slot >= turn_start[:, None]) & (slot < s.out.lengths[:, None])
  return s.replace(synced=synced, out=s.out.replace(policy_mask=s.out.policy_mask | emitted))


def _loop(cond, body, s: DecodeState, iterations) -> DecodeState:
  """lax.while_loop(cond, body, s), stopped after `iterations` when it is given."""
  if iterations is None:
    return jax.lax.while_loop(cond, body, s)
  s, _ = jax.lax.while_loop(lambda c: cond(c[0]) & (c[1] < iterations),
                            lambda c: (body(c[0]), c[1] + 1), (s, jnp.int32(0)))
  return s


def _autoregressive_steps(model, w, s: DecodeState, *, params, iterations) -> DecodeState:
  """Adaptive decoding's K = 0: plain autoregressive steps (one target forward over x_{n+1},
  x_{n+2} sampled from p_{n+1}), no drafting and no verification, for at most `iterations`
  steps. The main hidden state of each position is kept, so a later segment with drafts can
  bring the depth caches up to date (`_catch_up`)."""
  b, buf_len = s.seq.shape
  rows = jnp.arange(b)
  cache_length = s.cache.length

  def body(s: DecodeState):
    active = ~s.done
    n = s.frontier
    logits, h0, cache = model.step(s.cache, s.seq[rows, n + 1][:, None],
                                   jnp.where(active, n + 1, cache_length), weights=w)
    o = s.out
    s = s.replace(cache=cache,
                  hidden=s.hidden.at[rows, jnp.where(active, n + 1, buf_len)].set(
                      h0[:, 0], mode="drop"),
                  frontier=jnp.where(active, n + 1, n),
                  out=o.replace(emitted_by_forwards=o.emitted_by_forwards + active,
                                row_forwards=o.row_forwards + active,
                                target_forwards=o.target_forwards + 1))
    rng, key = sampling.split_rows(s.rng, 2)
    return _emit_sampled(s.replace(rng=rng), logits[:, 0], key, active, params)

  return _loop(lambda s: ~jnp.all(s.done), body, s, iterations)


def _catch_up(model, w, s: DecodeState, k: int, chunk: int) -> DecodeState:
  """Brings depths 1..k up to the drafting invariant before a segment with k drafts: each
  live row recomputes every depth over chunks of `chunk` positions from the lowest of those
  depths' `synced` to the window start n - k (depths that ran less often, or not at all,
  since the positions were committed: adaptive decoding with a smaller K, or K = 0). The
  chunks go up in order and each depth reads the one below over the same chunk, as the
  prefill does; positions a chunk writes past n - k are rewritten by the segment's windows
  before anything attends to them. Drafts only affect acceptance, never the output law, so
  this is about acceptance (a drafter reading stale caches drafts worse), not exactness."""
  b, buf_len = s.seq.shape
  rows = jnp.arange(b)
  cache_length = s.cache.length
  target = jnp.maximum(s.frontier - k, 0)
  lo = jnp.min(s.synced[:, :k], axis=1)
  offsets = jnp.arange(chunk)[None, :]

  def body(c):
    lo, cache = c
    active = (lo < target) & ~s.done
    start = jnp.where(active, lo, cache_length)  # inactive rows write past the cache
    win = jnp.minimum(start[:, None] + offsets, buf_len - k - 1)
    h_prev = s.hidden[rows[:, None], win]
    for depth in range(1, k + 1):
      _, h_prev, cache = model.mtp_step(cache, depth, h_prev, s.seq[rows[:, None], win + depth],
                                        start, weights=w)
    return jnp.where(active, lo + chunk, lo), cache

  _, cache = jax.lax.while_loop(lambda c: jnp.any((c[0] < target) & ~s.done), body,
                                (lo, s.cache))
  synced = s.synced.at[:, :k].set(jnp.maximum(s.synced[:, :k], target[:, None]))
  return s.replace(cache=cache, synced=synced)


def _append(model, w, s: DecodeState, reply_tokens, reply_lengths, *, params,
            max_turn_tokens) -> DecodeState:
  """Appends reply_tokens[b, :reply_lengths[b]] after row b's last token where
  reply_lengths[b] > 0 (other rows stay as they are) and samples the token after it."""
  b, r = reply_tokens.shape
  k = s.out.attempted.shape[1]
  cache_length = s.cache.length
  max_new_tokens = s.out.tokens.shape[1]
  rows = jnp.arange(b)
  o = s.out
  # A reply that would leave no room for a policy token is not appended.
  active = (reply_lengths > 0) & (o.lengths + reply_lengths < max_new_tokens)
  n = s.frontier
  idx = jnp.arange(r)[None, :]
  in_reply = idx < reply_lengths[:, None]
  # 1. Main model over [x_{n+1}, reply] at n+1..n+r+1 (inactive rows write past the cache,
  # where writes are dropped).
  chunk = jnp.concatenate([s.seq[rows, n + 1][:, None], reply_tokens], axis=1)
  start = jnp.where(active, n + 1, cache_length)
  logits, h0, cache = model.step(s.cache, chunk, start, weights=w)
  buf_len = s.seq.shape[1]
  reply_pos = jnp.where(active[:, None] & in_reply, n[:, None] + 2 + idx, buf_len)
  seq = s.seq.at[rows[:, None], reply_pos].set(reply_tokens, mode="drop")
  h_pos = jnp.where(active[:, None], start[:, None] + jnp.arange(r + 1)[None, :], buf_len)
  hidden = s.hidden.at[rows[:, None], h_pos].set(h0, mode="drop")
  slots = jnp.where(active[:, None] & in_reply, o.lengths[:, None] + idx, max_new_tokens)
  out = o.replace(tokens=o.tokens.at[rows[:, None], slots].set(reply_tokens, mode="drop"),
                  lengths=o.lengths + jnp.where(active, reply_lengths, 0))
  frontier = jnp.where(active, n + reply_lengths + 1, n)
  s = s.replace(cache=cache, seq=seq, hidden=hidden, frontier=frontier, out=out,
                limit=jnp.where(active, batching.turn_limit(out.lengths, max_new_tokens,
                                                            max_turn_tokens), s.limit))
  # 2. The next policy token from p at the reply's last position.
  rng, key = sampling.split_rows(s.rng, 2)
  s = _emit_sampled(s.replace(rng=rng), logits[rows, jnp.where(active, reply_lengths, 0)],
                    key, active, params)
  # 3. Every depth rewrites positions from the old window's start to the new frontier.
  width = k + r + 2
  w_start = jnp.where(active, jnp.maximum(n - k, 0), cache_length)
  win = jnp.minimum(w_start[:, None] + jnp.arange(width)[None, :], buf_len - k - 1)
  h_prev = s.hidden[rows[:, None], win]
  cache = s.cache
  for depth in range(1, k + 1):
    _, h_prev, cache = model.mtp_step(cache, depth, h_prev, s.seq[rows[:, None], win + depth],
                                      w_start, weights=w)
  return s.replace(cache=cache)


_STATIC = ("graphdef", "params", "program", "max_turn_tokens")


def _program_mode(program: str, mode_index: jax.Array):
  """_decode's mode: "exact", or the traced index of a sampled mode."""
  return "exact" if program == "exact" else mode_index


def _first_turn(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array,
                prompt_lengths: jax.Array, rng: jax.Array, *, max_new_tokens: int,
                cache_length: int, params: sampling.SamplingParams, program: str,
                mode_index: jax.Array, stop_tokens: Sequence[int],
                row_stops: jax.Array | None = None, num_draft_steps: int | None = None,
                max_turn_tokens: int | None = None, draft_vocab: jax.Array | None = None
                ) -> DecodeState:
  """Prefills right-padded prompts [B, P] and decodes the first turn: until a stop token
  (those of `row_stops` [B, S] bool when given, see batching.stop_table), `max_turn_tokens`
  or `max_new_tokens` (the whole completion's budget). `draft_vocab`: optional [V_d] token
  ids the drafter is restricted to (`_decode`). Compiled once per (B, P) and settings."""
  model = nnx.merge(graphdef, state)
  k = _num_drafts(model, num_draft_steps)
  w = model.loop_weights()
  s = _start(model, w, prompt_tokens, prompt_lengths, rng, k=k, max_new_tokens=max_new_tokens,
             cache_length=cache_length, params=params, stop_tokens=stop_tokens,
             row_stops=row_stops, max_turn_tokens=max_turn_tokens)
  return _decode(model, w, s, params=params, mode=_program_mode(program, mode_index),
                 draft_vocab=draft_vocab)


class _ModeArgument:
  """A jitted decoding function, called with `mode=` a name of MODES. The sampled modes
  become the program's argument `mode_index` (see the module docstring), so they share one
  compiled program; "exact" is its own. `lower` and `_cache_size` are the jitted function's.
  """

  def __init__(self, jitted):
    self._jitted = jitted
    functools.update_wrapper(self, jitted)

  @staticmethod
  def _translate(kwargs):
    mode = kwargs.pop("mode")
    _check_mode(mode, kwargs["params"])
    exact = mode == "exact"
    return dict(kwargs, program="exact" if exact else "sampled", mode_index=np.int32(
        0 if exact else verify_lib.SAMPLED_MODES.index(mode)))

  def __call__(self, *args, **kwargs):
    return self._jitted(*args, **self._translate(kwargs))

  def lower(self, *args, **kwargs):
    return self._jitted.lower(*args, **self._translate(kwargs))

  def _cache_size(self) -> int:
    return self._jitted._cache_size()  # pylint: disable=protected-access


_FIRST_STATIC = _STATIC + ("max_new_tokens", "cache_length", "num_draft_steps", "stop_tokens")
start = _ModeArgument(jax.jit(_first_turn, static_argnames=_FIRST_STATIC))


def _continue_with_reply(graphdef: nnx.GraphDef, state: nnx.State, decode_state: DecodeState,
                         reply_tokens: jax.Array, reply_lengths: jax.Array, *,
                         params: sampling.SamplingParams, program: str, mode_index: jax.Array,
                         max_turn_tokens: int | None = None,
                         draft_vocab: jax.Array | None = None) -> DecodeState:
  """Appends right-padded replies [B, R] (rows with reply_lengths 0 are finished and left
  alone; a reply that would fill the completion budget is not appended and its row stays
  done) and decodes the next turn, with the stop tokens `start` was given. Donates
  `decode_state`."""
  model = nnx.merge(graphdef, state)
  w = model.loop_weights()
  s = _append(model, w, decode_state, reply_tokens, reply_lengths, params=params,
              max_turn_tokens=max_turn_tokens)
  return _decode(model, w, s, params=params, mode=_program_mode(program, mode_index),
                 draft_vocab=draft_vocab)


continue_with_reply = _ModeArgument(jax.jit(_continue_with_reply, static_argnames=_STATIC,
                                            donate_argnames=("decode_state",)))


def _generate(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array,
              prompt_lengths: jax.Array, rng: jax.Array, *, max_new_tokens: int,
              cache_length: int, params: sampling.SamplingParams, program: str,
              mode_index: jax.Array, stop_tokens: Sequence[int],
              row_stops: jax.Array | None = None, num_draft_steps: int | None = None,
              max_turn_tokens: int | None = None, draft_vocab: jax.Array | None = None
              ) -> SpeculativeOutput:
  """Samples up to `max_new_tokens` per row after right-padded prompts [B, P] with K drafts
  per target forward (single turn; `draft_vocab` as in `start`). Compiled once per (B, P)
  and settings."""
  return _first_turn(
      graphdef, state, prompt_tokens, prompt_lengths, rng, max_new_tokens=max_new_tokens,
      cache_length=cache_length, params=params, program=program, mode_index=mode_index,
      stop_tokens=stop_tokens, row_stops=row_stops, num_draft_steps=num_draft_steps,
      max_turn_tokens=max_turn_tokens, draft_vocab=draft_vocab).out


generate = _ModeArgument(jax.jit(_generate, static_argnames=_FIRST_STATIC))


# ----------------------------------------------------------------- adaptive decoding
# decoding/segments.py drives these: `prefill` once, then `segment`s with a K chosen between
# them from live acceptance and measured cost, on a batch that shrinks as rows finish.

_PREFILL_STATIC = ("graphdef", "params", "max_new_tokens", "cache_length", "num_draft_steps",
                   "stop_tokens", "max_turn_tokens", "draft_prefill")


@functools.partial(jax.jit, static_argnames=_PREFILL_STATIC)
def prefill(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array,
            prompt_lengths: jax.Array, rng: jax.Array, *, max_new_tokens: int,
            cache_length: int, params: sampling.SamplingParams, stop_tokens: Sequence[int],
            row_stops: jax.Array | None = None, num_draft_steps: int | None = None,
            max_turn_tokens: int | None = None, draft_prefill: bool = True) -> DecodeState:
  """Prefills right-padded prompts [B, P] and samples each row's first token; no decoding.
  The state holds K = num_draft_steps depths, prefilled with `draft_prefill`; without it
  only the main cache is (an autoregressive prefill) and the first segment that drafts
  computes the depths over the prompt (`_catch_up`), so a call that never drafts never
  pays for them."""
  model = nnx.merge(graphdef, state)
  k = _num_drafts(model, num_draft_steps)
  return _start(model, model.loop_weights(), prompt_tokens, prompt_lengths, rng, k=k,
                max_new_tokens=max_new_tokens, cache_length=cache_length, params=params,
                stop_tokens=stop_tokens, row_stops=row_stops,
                max_turn_tokens=max_turn_tokens, draft_prefill=draft_prefill)


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "max_turn_tokens"),
                   donate_argnames=("decode_state",))
def append_reply(graphdef: nnx.GraphDef, state: nnx.State, decode_state: DecodeState,
                 reply_tokens: jax.Array, reply_lengths: jax.Array, *,
                 params: sampling.SamplingParams,
                 max_turn_tokens: int | None = None) -> DecodeState:
  """`continue_with_reply`'s first half: appends the replies (rows with reply_lengths 0
  are left alone) and samples the token after each; no decoding. Donates the state."""
  model = nnx.merge(graphdef, state)
  return _append(model, model.loop_weights(), decode_state, reply_tokens, reply_lengths,
                 params=params, max_turn_tokens=max_turn_tokens)


def _run_segment(model, w, s: DecodeState, iterations, *, k: int, params, mode, draft_vocab,
                 catch_up_chunk: int) -> DecodeState:
  """At most `iterations` iterations with k drafts each on `s` (see `segment`)."""
  k_state = s.out.attempted.shape[1]
  if not 0 <= k <= k_state:
    raise ValueError(f"k={k} is not allowed: must be in [0, {k_state}]")
  if k == 0:
    return _autoregressive_steps(model, w, s, params=params, iterations=iterations)
  s = _catch_up(model, w, s, k, catch_up_chunk)
  return _decode(model, w, s, params=params, mode=mode, draft_vocab=draft_vocab, k=k,
                 iterations=iterations)


def _segment(graphdef: nnx.GraphDef, state: nnx.State, decode_state: DecodeState,
             iterations: jax.Array, *, k: int, params: sampling.SamplingParams, program: str,
             mode_index: jax.Array, draft_vocab: jax.Array | None = None,
             catch_up_chunk: int = 16) -> DecodeState:
  """At most `iterations` iterations with k drafts each (0 <= k <= the state's K), until
  every row is done. k = 0 is the plain autoregressive step; k >= 1 first brings depths
  1..k up to date (`_catch_up`) and then runs the speculative loop with a window of k + 1.
  Each iteration is an exact speculative (or autoregressive) step whatever k the one before
  used, so segments with any sequence of k chosen from the past sample the target law.
  Compiled once per (k, B, shapes); donates `decode_state`."""
  model = nnx.merge(graphdef, state)
  return _run_segment(model, model.loop_weights(), decode_state, iterations, k=k,
                      params=params, mode=_program_mode(program, mode_index),
                      draft_vocab=draft_vocab, catch_up_chunk=catch_up_chunk)


segment = _ModeArgument(jax.jit(
    _segment, static_argnames=("graphdef", "params", "program", "k", "catch_up_chunk"),
    donate_argnames=("decode_state",)))
