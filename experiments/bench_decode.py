r"""Autoregressive against speculative (MTP drafts) decoding, one model, one process.

  python experiments/bench_decode.py --config=configs/sft_small.py --workdir=runs/sft_small \
      --batch_sizes=1,8,64 --out=runs/sft_small/bench_decode.json

The model is the workdir's MTP-stage policy if that stage completed there, else its SFT
policy; without either (or with --random_init) a randomly initialised model of the config's
shape is used. Prompts are held-out task prompts. For every batch size,
temperature and verification mode it reports tokens/s of both loops over the same prompts (batch 1
decodes --num_prompts prompts one after another), the speed ratio with its 95% interval over
--repeats passes interleaved in alternating order (the defaults meet the protocol of every
published wall-clock figure: decode_timing.meets_protocol, recorded in each row),
tokens per target forward, and per-depth acceptance online and teacher-forced (the
self-consistency diagnostic). Temperature 0 uses mode "exact"; temperature > 0 the others.

With --episodes (batch sizes), it also times whole agentic episodes (benchmark.
run_episode_benchmark: tool calls answered by the environment, the policy continuing) for
speculative decoding, autoregressive decoding with its cache kept across turns and
autoregressive decoding that re-encodes the whole context every turn, and writes those rows
to the JSON's "results_multi_turn" (--batch_sizes= runs the episodes alone):

  python experiments/bench_decode.py --config=configs/laptop.py --workdir=runs/laptop \
      --batch_sizes= --episodes=1,8,64

With --draft_vocab=full,16384,8192,4096 every mode also runs with a reduced draft
vocabulary of each size (decoding/draft_vocab.py: the drafter's most frequent training
tokens and the stop tokens; the JSON's "draft_vocab_coverage" gives the share of those
tokens each covers); its rows carry "draft_vocab".

With --draft_lengths=1,2,3 every mode also runs at each fixed draft length (rows "k"), and
with --adaptive (or config.decoding.adaptive.enabled) adaptive decoding
(decoding/segments.py: K chosen from live acceptance and an in-process cost table, rows
leaving the batch as they finish), its rows "k": "adaptive" with the iterations run at each
K and the cost table:

  python experiments/bench_decode.py --config=configs/laptop.py --workdir=runs/laptop \
      --batch_sizes=1,8,64 --temperatures=1 --modes=rejection,block --draft_lengths=1,2,3 \
      --adaptive
"""

from __future__ import annotations

import json
import os
import shlex
import sys

if __package__ in (None, ""):  # run as a script: the checkout's root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
from absl import app, flags
from ml_collections import config_flags

from bebop_jax.stages import config as config_lib
from bebop_jax.stages import decode_timing
from bebop_jax.stages import lineage
from bebop_jax.stages import mtp
from experiments import episode_benchmark
from bebop_jax.stages import rollouts

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir holding an SFT checkpoint.")
_BATCH = flags.DEFINE_list("batch_sizes", ["1", "8", "64"], "Batch sizes.")
_TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures.")
_MODES = flags.DEFINE_list("modes", ["rejection", "greedy_draft", "strict", "block"],
                           "Verification modes at temperature > 0.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per row.")
_REPEATS = flags.DEFINE_integer(
    "repeats", decode_timing.MIN_REPEATS, "Timed passes of each arm, interleaved in alternating "
    "order; the ratio's 95% interval is over passes.")
_PROMPTS = flags.DEFINE_integer("num_prompts", decode_timing.MIN_PROMPTS, "Prompts per pass (at "
                                "least one batch): batch 1 decodes them one after another.")
_RANDOM = flags.DEFINE_bool("random_init", False, "Use a randomly initialised model.")
_POLICY = flags.DEFINE_enum("policy", "auto", ["auto", "sft", "mtp"],
                            "Which checkpoint in --workdir: the MTP stage's, the SFT stage's "
                            "(its jointly trained MTP module), or auto (MTP if present).")
_SPLIT = flags.DEFINE_bool(
    "split_fixed_cost", True, "Also time every loop with max_new_tokens=1 (prefill and first "
    "token) and report the decoding phase's speed ratio without that per-call cost.")
_EPISODES = flags.DEFINE_list(
    "episodes", [], "Batch sizes of the multi-turn benchmark (whole agentic episodes, "
    "--num_prompts of them per row); empty: not run.")
_EPISODE_MAX_NEW = flags.DEFINE_integer(
    "episode_max_new_tokens", 160, "Completion budget of an episode (policy turns and "
    "environment replies).")
_DRAFT_VOCAB = flags.DEFINE_list(
    "draft_vocab", ["full"],
    "Draft vocabularies: 'full' (the whole head) and/or sizes V_d of a reduced one, the "
    "drafter's most frequent training tokens plus the stop tokens (mtp.draft_vocabulary).")
_LENGTHS = flags.DEFINE_list(
    "draft_lengths", [], "Fixed draft lengths K to run each mode with (rows labelled k); "
    "empty: the drafter's K only. K = 0 is the autoregressive loop (ratio 1).")
_ADAPTIVE = flags.DEFINE_bool(
    "adaptive", None, "Also run adaptive decoding (config.decoding.adaptive's settings); "
    "default: config.decoding.adaptive.enabled.")
_OUT = flags.DEFINE_string("out", None, "JSON output path (default <workdir>/bench_decode.json).")


def main(argv):
  del argv
  config = config_lib.validate(_CONFIG.value)
  graphdef, state, source = mtp.load_workdir_policy(
      config, _WORKDIR.value, which="random" if _RANDOM.value else _POLICY.value)
  print(f"model: {source}; device: {jax.devices()[0].device_kind}")
  draft_vocabs, coverage = {}, {}
  for label in _DRAFT_VOCAB.value:
    if label == "full":
      draft_vocabs[label] = None
      continue
    if not label.isdigit():
      raise ValueError(f"--draft_vocab={label!r} is not allowed: 'full' or a size")
    tok = config_lib.settings(config).data.loaded_tokenizer
    ids, coverage[label] = lineage.draft_vocabulary(_WORKDIR.value, int(label),
                                                always=(tok.eos_id, tok.call_end_id))
    draft_vocabs[label] = ids
    print(f"draft vocabulary {label}: covers {coverage[label]:.1%} of the drafter's training "
          "tokens")
  use_adaptive = (config.decoding.adaptive.enabled if _ADAPTIVE.value is None
                  else _ADAPTIVE.value)
  if _BATCH.value:
    print(decode_timing.header(_SPLIT.value))
  results = decode_timing.run_benchmark(
      config, graphdef, state, batch_sizes=[int(b) for b in _BATCH.value],
      temperatures=[float(t) for t in _TEMPS.value], modes=list(_MODES.value),
      max_new=_MAX_NEW.value, repeats=_REPEATS.value,
      num_prompts=_PROMPTS.value, split_fixed_cost=_SPLIT.value,
      draft_vocabs=draft_vocabs, draft_lengths=[int(k) for k in _LENGTHS.value],
      adaptive_settings=rollouts.adaptive_settings(config) if use_adaptive else None)
  episodes = {}
  if _EPISODES.value:
    print(f"\nmulti-turn: whole agentic episodes\n{episode_benchmark.episode_header()}")
    episodes = {"episode_max_new_tokens": _EPISODE_MAX_NEW.value,
                "results_multi_turn": episode_benchmark.run_episode_benchmark(
                    config, graphdef, state, batch_sizes=[int(b) for b in _EPISODES.value],
                    temperatures=[float(t) for t in _TEMPS.value], modes=list(_MODES.value),
                    max_new_tokens=_EPISODE_MAX_NEW.value, repeats=_REPEATS.value,
                    num_prompts=_PROMPTS.value)}
  short = [r for r in results if not r["meets_protocol"]]
  if short:
    print(f"{len(short)} of {len(results)} rows fall short of the protocol (at least "
          f"{decode_timing.MIN_REPEATS} passes over {decode_timing.MIN_PROMPTS} prompts and "
          f"{decode_timing.MIN_TOKENS} tokens per arm): raise --repeats, --num_prompts or "
          "--max_new_tokens before publishing them")
  out = _OUT.value or os.path.join(_WORKDIR.value or ".", "bench_decode.json")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump({"command": shlex.join(["python", "experiments/bench_decode.py", *sys.argv[1:]]),
               "model": source, "device": jax.devices()[0].device_kind,
               "max_new_tokens": _MAX_NEW.value, "results": results,
               **({"draft_vocab_coverage": coverage} if coverage else {}), **episodes}, f,
              indent=2)
  print(f"wrote {out}")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
