r"""What host work between calls costs a short decoding call (batch 1), and where the adaptive
decoder does its own.

  python experiments/bench_call_overhead.py --config=configs/laptop.py \
      --workdir=runs/quickstart --out=runs/quickstart/call_overhead.json

One held-out prompt, one row, T = 1; an adaptive call whose acceptance seed is 0 chooses
K = 0, so it runs the prefill and segments of autoregressive steps. Each variant runs
--calls calls back to back as one timed block (as a rollout or the decode benchmark does);
blocks of the variants are interleaved, alternating direction, for --blocks rounds, and each
variant's median seconds per call is reported with its ratio to the plain program:

  autoregressive      `autoregressive.generate` and block on its output (the baseline);
  program             the adaptive decoder's programs at K = 0 (its prefill and one K = 0
                      segment to the end of the call) and the lengths fetched, no other
                      host work;
  before_dispatch     the adaptive decoder's per-call host work (its acceptance estimate,
                      first choice and bookkeeping) done before dispatching those programs;
  after_dispatch      the same work done after the dispatch, while the programs run;
  adaptive            `segments.generate` itself (calibrated once before timing).

The adaptive decoder plans each call's first choice during the call before and does its
bookkeeping after the dispatch (decoding/segments.py); docs/decoding.md has the numbers.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from bebop_jax.stages import config as config_lib
from bebop_jax.stages import decode_timing  # pylint: disable=g-bad-import-order
from bebop_jax.decoding import (adaptive, autoregressive, sampling, segments,
                                speculative)
from bebop_jax.stages import mtp

_CONFIG = config_flags.DEFINE_config_file("config", "configs/laptop.py",
                                          "Experiment config.", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir with SFT (and MTP) stages.")
_RANDOM = flags.DEFINE_bool("random_init", False, "Use a randomly initialised model.")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens per generation at most.")
_PROMPT = flags.DEFINE_integer("prompt", 3, "Which held-out prompt (index) to decode.")
_CALLS = flags.DEFINE_integer("calls", 16, "Calls per timed block.")
_BLOCKS = flags.DEFINE_integer("blocks", 60, "Timed rounds of blocks.")
_OUT = flags.DEFINE_string("out", None, "JSON output path.")


def main(argv):
  del argv
  config = config_lib.validate(_CONFIG.value)
  graphdef, state, source = mtp.load_workdir_policy(
      config, _WORKDIR.value, which="random" if _RANDOM.value else "auto")
  tokens, lengths = decode_timing.prompt_batches(config, 1, _PROMPT.value + 1)[_PROMPT.value]
  tok = config_lib.settings(config).data.loaded_tokenizer
  stop = (tok.eos_id, tok.call_end_id)
  params = sampling.SamplingParams(temperature=1.0)
  kw = dict(max_new_tokens=_NEW.value, cache_length=tokens.shape[1] + _NEW.value + 8,
            params=params)
  key = jax.random.key(0)
  settings = adaptive.Settings(k_max=config.model.num_draft_steps)
  depths = settings.k_max
  seed = (0.0,) * depths  # no draft pays: K = 0 throughout

  def call():  # the decoder's programs at K = 0: the prefill, one segment to the call's end
    s = speculative.prefill(graphdef, state, tokens, lengths, key, stop_tokens=stop,
                            num_draft_steps=max(depths, 1), draft_prefill=False, **kw)
    return speculative.segment(graphdef, state, s, np.int32(_NEW.value), k=0, params=params,
                               mode="rejection").out

  _, stats = segments.generate(graphdef, state, tokens, lengths, key, stop_tokens=stop,
                               mode="rejection", settings=settings, acceptance=seed, **kw)
  table = stats.table  # calibrated once, before timing

  def host_work():  # what the decoder does per call besides its programs
    estimate = adaptive.AcceptanceEstimate(np.asarray(seed), settings.smoothing)
    adaptive.choose_k(estimate, table, 1, kw["cache_length"], depths,
                      call_tokens=table.tokens_per_row or _NEW.value)
    segments.Stats(k_iterations={}, segments=[], table=table, alphas=list(estimate.alphas))

  def before_dispatch():
    host_work()
    out = call()
    return jax.device_get((out.target_forwards, out.lengths))

  def after_dispatch():
    out = call()
    host_work()
    return jax.device_get((out.target_forwards, out.lengths))

  def program():
    out = call()
    return jax.device_get((out.target_forwards, out.lengths))

  variants = {
      "autoregressive": lambda: jax.block_until_ready(autoregressive.generate(
          graphdef, state, tokens, lengths, key, stop_tokens=stop, **kw)),
      "program": program,
      "before_dispatch": before_dispatch,
      "after_dispatch": after_dispatch,
      "adaptive": lambda: jax.block_until_ready(segments.generate(
          graphdef, state, tokens, lengths, key, stop_tokens=stop, mode="rejection",
          settings=settings, acceptance=seed, **kw)[0]),
  }
  for fn in variants.values():  # compiled and warm
    fn()
    fn()
  names = list(variants)
  per_call = {name: [] for name in names}
  for i in range(_BLOCKS.value):
    for name in (names if i % 2 == 0 else names[::-1]):
      t0 = time.perf_counter()
      for _ in range(_CALLS.value):
        variants[name]()
      per_call[name].append((time.perf_counter() - t0) / _CALLS.value)
  base = float(np.median(per_call["autoregressive"]))
  rows = {name: {"median_s": float(np.median(v)), "ratio": base / float(np.median(v))}
          for name, v in per_call.items()}
  out_tokens = int(np.asarray(call().lengths)[0])
  for name, row in rows.items():
    print(f"{name:16s} {row['median_s'] * 1e3:7.3f} ms per call  {row['ratio']:.3f}x")
  print(f"model: {source}; one row, {out_tokens} tokens per call; {_CALLS.value} calls per "
        f"block, {_BLOCKS.value} blocks")
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump({"command": shlex.join(["python", "experiments/bench_call_overhead.py",
                                        *sys.argv[1:]]),
                 "model": source, "tokens_per_call": out_tokens, "calls": _CALLS.value,
                 "blocks": _BLOCKS.value, "variants": rows}, f, indent=2)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
