r"""The drafter's learning curve: held-out teacher-forced acceptance per depth against
training tokens, for each objective, from a cold and a warm start.

  python experiments/drafter_learning_curve.py --config=configs/smollm2.py \
      --init_from=runs/smollm2 --workdir=runs/smollm2_curve \
      --out=docs/artifacts/smollm2_drafter_curve

Every run is the config's MTP stage (stages=("mtp",)) on the drafter dataset of the SFT
policy in --init_from, sampled once and shared (the store, bebop_jax/stages/mtp.py), with the config's
optimizer, batch and mtp.init, its online evaluation off, and the held-out acceptance
measured every --eval_every steps (mtp.train.eval_every):
  cold   each objective from the initial drafter for --warm_steps + --steps steps;
  warm   --warm_steps steps of mtp.warm_start.loss, run once and checkpointed, then each
         objective for --steps steps from that checkpoint (a copy of the warm run's workdir
         resumed with the objective: the warm phase is the same for all of them).
Writes <out>.json (every point: run, step, training tokens, reach-weighted and unweighted
acceptance per depth with its draft events) and <out>.png. Runs that completed are reused.
"""

from __future__ import annotations

import ast
import json
import os
import shutil

import numpy as np
from absl import app, flags

from bebop_jax.stages import config as config_lib
from bebop_jax import stages
from bebop_jax.losses.mtp import LOSSES
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.stages import mtp
from bebop_jax.stages import lineage

_CONFIG = flags.DEFINE_string("config", "configs/smollm2.py", "Experiment config file.")
_ARG = flags.DEFINE_string("config_arg", None, "Argument passed to get_config.")
_INIT_FROM = flags.DEFINE_string("init_from", None, "The SFT workdir (mtp.init_from).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/drafter_curve", "Where the runs go.")
_OUT = flags.DEFINE_string("out", None, "Output path without extension (default "
                           "<workdir>/curve).")
_LOSSES = flags.DEFINE_list("losses", list(LOSSES), "Objectives.")
_STARTS = flags.DEFINE_list("starts", ["cold", "warm"], "cold and/or warm.")
_WARM = flags.DEFINE_integer("warm_steps", None, "Warm-start steps (default the config's "
                             "mtp.warm_start.steps).")
_STEPS = flags.DEFINE_integer("steps", None, "Steps of each objective after the warm start "
                              "(default the config's mtp.train.num_steps minus the warm "
                              "steps).")
_OVERRIDES = flags.DEFINE_multi_string("set", [], "key=value config overrides (a Python "
                                       "literal or a string), e.g. --set mtp.init=fresh.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 40, "Held-out acceptance every this many "
                                   "steps.")


def _load():
  overrides = {}
  for item in _OVERRIDES.value:
    key, _, text = item.partition("=")
    try:
      overrides[key] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      overrides[key] = text
  return config_lib.apply_overrides(config_lib.load_file(_CONFIG.value, _ARG.value),
                                    overrides)


def _config(loss: str, warm: int, total: int, **train):
  c = _load()
  c.stages = ("mtp",)
  if _INIT_FROM.value:
    c.mtp.init_from = _INIT_FROM.value
  c.mtp.loss = loss
  c.mtp.warm_start.steps = warm
  c.mtp.eval_before = False
  c.mtp.eval_online = False
  c.mtp.eval_modes = ("rejection",)
  c.mtp.train.num_steps = total
  c.mtp.train.eval_every = _EVAL_EVERY.value
  c.mtp.train.checkpoint_every = min(c.mtp.train.checkpoint_every, total)
  c.mtp.train.update(train)
  return config_lib.validate(c)


def _points(run: str, workdir: str, tokens_per_step: float) -> list[dict]:
  out = []
  for r in metrics_lib.read_metrics(workdir, "mtp"):
    if "eval/alpha_1" not in r:
      continue
    k = sum(1 for key in r if key.startswith("eval/alpha_unweighted_"))
    out.append({"run": run, "step": r["step"], "tokens": r["step"] * tokens_per_step,
                "alpha": [r[f"eval/alpha_{d}"] for d in range(1, k + 1)],
                "alpha_unweighted": [r[f"eval/alpha_unweighted_{d}"] for d in range(1, k + 1)],
                "draft_events": [r[f"eval/draft_events_{d}"] for d in range(1, k + 1)]})
  return out


def main(argv):
  del argv
  base = _load()
  warm = base.mtp.warm_start.steps if _WARM.value is None else _WARM.value
  steps = (base.mtp.train.num_steps - warm) if _STEPS.value is None else _STEPS.value
  total = warm + steps
  os.makedirs(_WORKDIR.value, exist_ok=True)
  runs = {}
  if "warm" in _STARTS.value and warm:
    shared = os.path.join(_WORKDIR.value, "warm_phase")
    if lineage.read_summary(shared, "mtp") is None:
      # Any objective: the run stops where the warm phase ends, so it never trains it.
      summary = mtp.run(_config(_LOSSES.value[0], warm, total, stop_at_step=warm), shared)
      if summary.get("complete"):
        raise RuntimeError("the warm phase ran to the end: --steps must be > 0")
  for start in _STARTS.value:
    for loss in _LOSSES.value:
      workdir = os.path.join(_WORKDIR.value, start, loss)
      if start == "warm" and warm and not os.path.isdir(os.path.join(workdir, "mtp")):
        shutil.copytree(shared, workdir)  # the warm phase's checkpoint and metrics
      config = _config(loss, warm if start == "warm" else 0, total)
      stages.run(config, workdir)
      runs[f"{start}/{loss}"] = workdir
  points, info = [], {}
  for name, workdir in runs.items():
    s = lineage.read_summary(workdir, "mtp")
    tokens_per_step = s["policy_tokens"] / s["rows"] * base.mtp.batch_size
    points += _points(name, workdir, tokens_per_step)
    info[name] = {"schedule": s["schedule"], "init": s["init"], "steps": s["steps"],
                  "steady_step_time_s": s.get("steady_step_time_s"),
                  "tokens_per_step": tokens_per_step, "policy_tokens": s["policy_tokens"],
                  "rows": s["rows"], "draft_vocab": s["draft_vocab"],
                  "final": s["after"].get("heldout")}
  out = _OUT.value or os.path.join(_WORKDIR.value, "curve")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  result = {"config": _CONFIG.value, "overrides": _OVERRIDES.value,
            "init_from": _INIT_FROM.value, "warm_steps": warm,
            "steps": steps, "batch_size": base.mtp.batch_size,
            "learning_rate": base.mtp.optim.learning_rate,
            "measure": "held-out teacher-forced rejection-sampling acceptance per depth, "
                       "reach-weighted (alpha) and unweighted, at mtp.temperature",
            "runs": info, "points": points}
  with open(out + ".json", "w") as f:
    json.dump(result, f, indent=1)
  _plot(result, out + ".png")
  for name, r in info.items():
    final = r["final"] or {}
    print(f"{name:16s} " + " / ".join(f"{final.get(f'alpha_{d}', float('nan')):.3f}"
                                      for d in range(1, 4)))
  print(f"wrote {out}.json and {out}.png")


def _plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  runs = sorted({p["run"] for p in result["points"]})
  k = len(result["points"][0]["alpha"]) if result["points"] else 0
  fig, axes = plt.subplots(1, max(k, 1), figsize=(4.2 * max(k, 1), 3.6), sharey=True)
  axes = np.atleast_1d(axes)
  colors = dict(zip(LOSSES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
  for run in runs:
    start, loss = run.split("/")
    pts = sorted((p for p in result["points"] if p["run"] == run), key=lambda p: p["step"])
    x = [p["tokens"] / 1e3 for p in pts]
    for d in range(k):
      axes[d].plot(x, [p["alpha"][d] for p in pts], color=colors.get(loss),
                   linestyle="-" if start == "warm" else ":", marker=".",
                   label=f"{loss} ({start})")
  if result["warm_steps"] and result["runs"]:  # where the warm runs switch objective
    per_step = next(iter(result["runs"].values()))["tokens_per_step"]
    for ax in axes:
      ax.axvline(result["warm_steps"] * per_step / 1e3, color="grey", lw=0.8, ls="--")
  for d, ax in enumerate(axes):
    ax.set_title(f"depth {d + 1}")
    ax.set_xlabel("training policy tokens (thousands)")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("held-out acceptance (reach-weighted)")
  axes[-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  app.run(main)
