r"""What one speculative iteration costs, in autoregressive steps, and where it goes (batch 1).

  python experiments/profile_speculative.py --config=configs/laptop.py \
      --workdir=runs/laptop --out=runs/laptop/profile_speculative.json

Two measurements, one process:

1. In the real loops (speculative.generate against autoregressive.generate on held-out
   prompts, rejection sampling at temperature 1): seconds per target forward of the
   speculative loop over seconds per token of the autoregressive one, both after
   subtracting the per-call fixed cost (the same loops run with max_new_tokens=1), on
   generations forced to --max_new_tokens. That ratio is the iteration's cost in
   autoregressive steps; the speculative loop is faster when tokens per target forward
   exceed it. Tokens per target forward and the decode-phase and end-to-end speed ratios
   come from generations that stop where a rollout turn stops.
2. The iteration's parts, each repeated --repeats times inside one jitted fori_loop (so
   dispatch is not counted): an autoregressive step (a 1-token forward and sampling), the
   verification forward over K + 1 tokens, the K draft depths over their windows with
   sampling, and the remainder of the iteration (verification, commit, gathers and
   scatters) as the loop's cost minus those parts. The prefill of the prompt is timed too,
   and one sample over the whole vocabulary: the loops' sampler (sampling.sample) and
   Gumbel-max (jax.random.categorical).

The model is the workdir's MTP-stage policy when there is one, else its SFT policy, else a
random policy of the config's shape (--random_init forces that).
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from bebop_jax.stages import config as config_lib
from bebop_jax.decoding import autoregressive, sampling, speculative
from bebop_jax.stages import decode_timing
from bebop_jax.stages import lineage
from bebop_jax.stages import mtp

_CONFIG = config_flags.DEFINE_config_file("config", "configs/laptop.py",
                                          "Experiment config.", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir with SFT (and MTP) stages.")
_RANDOM = flags.DEFINE_bool("random_init", False, "Use a randomly initialised model.")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens per generation at most.")
_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Prompts generated one after another.")
_REPEATS = flags.DEFINE_integer("repeats", 200, "Repetitions inside each part's loop.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed rounds per measurement (best kept).")
_DRAFT_VOCAB = flags.DEFINE_enum(
    "draft_vocab", "stored", ["stored", "full"],
    "Draft from the reduced vocabulary stored with the workdir's drafter (stored; the whole "
    "head when it has none) or from the whole head (full).")
_OUT = flags.DEFINE_string("out", None, "JSON output path.")


def _best(fn, rounds: int) -> float:
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def loop_costs(config, graphdef, state, prompts, *, max_new: int, rounds: int,
               draft_vocab=None) -> dict:
  """The real loops' per-token and per-iteration seconds after their per-call fixed cost.

  The iteration's cost is measured on generations forced to max_new tokens (no stop token):
  long loops, so what a call costs besides its iterations (prefill, the first token, entering
  and leaving the loop) is a small, subtracted share. The speed ratios are measured on
  generations that stop where a rollout turn stops, as bench_decode does."""
  params = sampling.SamplingParams(temperature=1.0)
  cache_length = max(t.shape[1] for t, _ in prompts) + max_new + 8
  tok = config_lib.settings(config).data.loaded_tokenizer

  def run(kind, new, stops):
    def go():
      outs = []
      for i, (tokens, lengths) in enumerate(prompts):
        kw = dict(max_new_tokens=new, cache_length=cache_length, params=params,
                  stop_tokens=stops)
        if kind == "autoregressive":
          outs.append(autoregressive.generate(graphdef, state, tokens, lengths,
                                              jax.random.key(i), **kw))
        else:
          outs.append(speculative.generate(graphdef, state, tokens, lengths,
                                           jax.random.key(i), mode="rejection",
                                           draft_vocab=draft_vocab, **kw))
      return outs
    return go

  def measure(kind, stops):
    full, fixed = _best(run(kind, max_new, stops), rounds), _best(run(kind, 1, stops), rounds)
    count = lambda outs: (sum(int(np.asarray(o.lengths).sum()) for o in outs),
                          sum(int(o.target_forwards) for o in outs))
    outs = run(kind, max_new, stops)()
    (tokens, forwards), (tokens_1, forwards_1) = count(outs), count(run(kind, 1, stops)())
    result = {"seconds": full, "fixed_seconds": fixed, "tokens": tokens,
              "target_forwards": forwards, "tokens_after_fixed": tokens - tokens_1,
              "forwards_after_fixed": forwards - forwards_1}
    if kind == "speculative":
      result["tokens_per_target_forward"] = speculative.tokens_per_target_forward(
          np.concatenate([np.asarray(o.emitted_by_forwards) for o in outs]),
          np.concatenate([np.asarray(o.attempted)[:, 0] for o in outs]))
    return result

  forced = {kind: measure(kind, ()) for kind in ("autoregressive", "speculative")}
  stopping = {kind: measure(kind, (tok.eos_id, tok.call_end_id))
              for kind in ("autoregressive", "speculative")}
  after = lambda m: m["seconds"] - m["fixed_seconds"]
  ar_step = after(forced["autoregressive"]) / forced["autoregressive"]["tokens_after_fixed"]
  iteration = after(forced["speculative"]) / max(
      forced["speculative"]["forwards_after_fixed"], 1)
  ar, sp = stopping["autoregressive"], stopping["speculative"]
  rate = lambda m, key: m[key] / max(after(m), 1e-9)
  return {"forced": forced, "stopping": stopping, "ar_step_s": ar_step,
          "iteration_s": iteration, "iteration_in_ar_steps": iteration / ar_step,
          "tokens_per_target_forward": sp["tokens_per_target_forward"],
          "decode_phase_ratio": (rate(sp, "tokens_after_fixed")
                                 / rate(ar, "tokens_after_fixed")),
          "end_to_end_ratio": (ar["seconds"] / ar["tokens"]) / (sp["seconds"] / sp["tokens"]),
          "fixed_share_of_ar": ar["fixed_seconds"] / ar["seconds"]}


def part_costs(graphdef, state, prompt_len: int, *, cache_length: int, repeats: int,
               rounds: int, draft_vocab=None) -> dict:
  """Seconds of each part of an iteration, repeated inside one jitted loop, batch 1."""
  model = nnx.merge(graphdef, state)
  c = model.config
  k, window = c.num_draft_steps, c.num_draft_steps + 1
  params = sampling.SamplingParams(temperature=1.0)
  w = model.loop_weights()
  draft_head = None if draft_vocab is None else jnp.take(w["shared"]["head"], draft_vocab,
                                                         axis=1)
  tokens = jnp.ones((1, prompt_len), jnp.int32)
  cache0 = model.init_cache(1, cache_length)
  pos = jnp.full((1,), prompt_len, jnp.int32)

  def repeated(body, carry):
    return jax.jit(lambda carry: jax.lax.fori_loop(0, repeats, lambda i, x: body(x),
                                                   carry)), carry

  def ar_body(x):
    cache, tok, key = x
    logits, _, cache = model.step(cache, tok[:, None], pos, weights=w)
    key, sub = sampling.split_rows(key, 2)
    tok = sampling.sample(sub, sampling.sampling_logprobs(logits[:, -1], params))
    return cache, tok.astype(jnp.int32), key

  def verify_body(x):
    cache, chunk = x
    logits, _, cache = model.step(cache, chunk, pos, weights=w)
    chunk = chunk.at[:, 0].set(jnp.argmax(logits[:, -1], -1).astype(jnp.int32))
    return cache, chunk

  def draft_body(x):
    cache, h, toks, key = x
    start = pos - window + 1
    at = jnp.full((1,), window - 1, jnp.int32)
    key, sub = sampling.split_rows(key, 2)
    u = jax.vmap(lambda r: jax.random.uniform(r, (k,)))(sub)  # [1, K]
    h_prev = h
    for depth in range(1, k + 1):
      q, h_prev, cache = model.mtp_step(cache, depth, h_prev, toks, start, at, weights=w,
                                        draft_head=draft_head)
      d = sampling.categorical(u[:, depth - 1], jnp.exp(sampling.sampling_logprobs(q, params)))
      toks = toks.at[:, -1].set(d.astype(jnp.int32))
    return cache, h, toks, key

  def sample_body(draw):  # one token from [1, V] log-probs (a token's update keeps it live)
    def body(x):
      logp, key = x
      key, sub = sampling.split_rows(key, 2)
      tok = draw(sub, logp)
      return logp.at[jnp.arange(1), tok].add(-1e-6), key
    return body

  gumbel = lambda keys, logp: jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)
  logp0 = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (1, c.vocab_size)))

  def prefill():
    return model.prefill(model.init_cache(1, cache_length), tokens, weights=w)

  fresh = lambda: cache0
  key = sampling.row_keys(jax.random.key(0), 1)
  parts = {
      "ar_step": repeated(ar_body, lambda: (fresh(), jnp.ones((1,), jnp.int32), key)),
      "verify_forward": repeated(verify_body, lambda: (fresh(), jnp.ones((1, window),
                                                                          jnp.int32))),
      "drafts": repeated(draft_body, lambda: (fresh(), jnp.zeros((1, window, c.d_model),
                                                                 c.compute_dtype),
                                              jnp.ones((1, window), jnp.int32), key)),
      # The sampler of every decoding loop (sampling.sample: inverse CDF from one uniform)
      # against Gumbel-max (jax.random.categorical), one row over the whole vocabulary.
      "sample": repeated(sample_body(sampling.sample), lambda: (logp0, key)),
      "sample_gumbel_max": repeated(sample_body(gumbel), lambda: (logp0, key)),
  }
  out = {}
  for name, (fn, make) in parts.items():
    out[f"{name}_s"] = _best(lambda fn=fn, make=make: fn(make()), rounds) / repeats
  prefill_fn = jax.jit(prefill)
  out["prefill_s"] = _best(prefill_fn, rounds)
  return out


def main(argv):
  del argv
  config = config_lib.validate(_CONFIG.value)
  graphdef, state, source = mtp.load_workdir_policy(
      config, _WORKDIR.value, which="random" if _RANDOM.value else "auto")
  # Held-out prompts padded to their buckets (a loop compiles once per bucket, before timing).
  prompts = decode_timing.prompt_batches(config, 1, _PROMPTS.value)
  p = int(np.median([t.shape[1] for t, _ in prompts]))  # the parts' prompt bucket
  stored = (lineage.stored_draft_vocabulary(_WORKDIR.value)
            if _WORKDIR.value and not _RANDOM.value and _DRAFT_VOCAB.value == "stored" else None)
  draft_vocab = None if stored is None else jnp.asarray(stored, jnp.int32)
  loops = loop_costs(config, graphdef, state, prompts, max_new=_NEW.value,
                     rounds=_ROUNDS.value, draft_vocab=draft_vocab)
  parts = part_costs(graphdef, state, p, cache_length=p + _NEW.value + 8,
                     repeats=_REPEATS.value, rounds=_ROUNDS.value, draft_vocab=draft_vocab)
  ar = parts["ar_step_s"]
  parts_in_ar = {k[:-len("_s")] + "_in_ar_steps": v / ar for k, v in parts.items()}
  rest = loops["iteration_in_ar_steps"] * loops["ar_step_s"] - parts["verify_forward_s"] \
      - parts["drafts_s"]
  report = {"model": source, "device": jax.devices()[0].device_kind, "prompt_len": p,
            "max_new_tokens": _NEW.value,
            "draft_vocab": None if stored is None else int(stored.shape[0]),
            "loops": loops, "parts": parts,
            "parts_in_ar_steps": parts_in_ar,
            "rest_of_iteration_in_ar_steps": rest / loops["ar_step_s"]}
  print(f"model: {source}; loops: {len(prompts)} held-out prompts, at most {_NEW.value} new "
        f"tokens; parts: prompt bucket {p}; batch 1; drafting from "
        + ("the whole head" if stored is None else f"{stored.shape[0]} tokens"))
  print(f"| measurement | seconds | in AR steps |\n|---|---|---|")
  print(f"| AR step (in the loop) | {loops['ar_step_s'] * 1e3:.3f} ms | 1 |")
  print(f"| speculative iteration (in the loop) | {loops['iteration_s'] * 1e3:.3f} ms | "
        f"{loops['iteration_in_ar_steps']:.2f} |")
  for name in ("ar_step", "verify_forward", "drafts", "sample", "sample_gumbel_max", "prefill"):
    print(f"| part: {name} | {parts[name + '_s'] * 1e3:.3f} ms | "
          f"{parts_in_ar[name + '_in_ar_steps']:.2f} |")
  print(f"| part: rest of the iteration | {rest * 1e3:.3f} ms | "
        f"{report['rest_of_iteration_in_ar_steps']:.2f} |")
  print(f"tokens per target forward {loops['tokens_per_target_forward']:.2f}; decode-phase "
        f"ratio {loops['decode_phase_ratio']:.2f}x; end-to-end ratio "
        f"{loops['end_to_end_ratio']:.2f}x; fixed cost {loops['fixed_share_of_ar']:.0%} of "
        "the autoregressive time")
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump(report, f, indent=2)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
