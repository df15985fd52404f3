r"""The MTP loss sweep with seeds: one MTP stage per (start, loss, seed), then a table.

  # warm start (each loss fine-tunes the jointly trained MTP module) and from scratch,
  # 3 seeds each, from the quickstart's SFT stage:
  python experiments/sweep_mtp_losses.py --config=configs/laptop.py \
      --init_from=runs/laptop --starts=warm,scratch --seeds=3 --workdir=runs/sweep

The config's get_sweep(arg) (experiments.sweep: a list of override dicts) names the entries;
without one, mtp.loss goes over bebop_jax.losses.mtp.LOSSES. This script adds seeds, warm
and scratch starts and the aggregate table to a plain `python experiments/sweep.py`. A seed (`mtp.seed`) changes the drafter's initialisation (from
scratch) and the data order; every run starts from the same SFT checkpoint, trains on the
same cached rollouts with the same budget and is evaluated on the same held-out prompts.
Each run goes to <workdir>/<start>/<loss>/seed<k> and is skipped when complete (resumed when
partial). Writes <workdir>/sweep.json (every run and the aggregates), sweep.md (mean and
standard error over seeds of online acceptance per depth and tokens per target forward, in
each evaluated mode, with the difference to `ce` and whether it exceeds two standard errors)
and plots/sweep.png.
"""

from __future__ import annotations

import os  # pylint: disable=g-bad-import-order
import sys

if __package__ in (None, ""):  # run as a script: the checkout's root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json

import numpy as np
from absl import app, flags

from bebop_jax.stages import config as config_lib
from bebop_jax import stages
from experiments.findings.common import mean_se as _mean_se
from bebop_jax.losses.mtp import LOSSES
from bebop_jax.stages import lineage

_CONFIG = flags.DEFINE_string("config", "configs/mtp_small.py", "Experiment config file.")
_ARG = flags.DEFINE_string("config_arg", None, "Argument passed to get_config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/mtp_sweep", "Sweep directory.")
_ONLY = flags.DEFINE_list("only", [], "Run only these losses (default: the whole sweep).")
_INIT_FROM = flags.DEFINE_string("init_from", None, "Override mtp.init_from (the SFT workdir).")
_SEEDS = flags.DEFINE_integer("seeds", 1, "Seeds per (start, loss).")
_STARTS = flags.DEFINE_list("starts", ["config"], "warm (the SFT's jointly trained drafter), "
                            "scratch (re-initialised), or config (as the config says).")


def aggregate(runs: list[dict]) -> list[dict]:
  """Rows (start, drafter, mode) with mean and standard error over seeds, and the
  tokens-per-target-forward difference to ce of the same start and mode."""
  groups: dict[tuple, list[dict]] = {}
  for r in runs:
    groups.setdefault((r["start"], r["drafter"], r["mode"]), []).append(r)
  rows = []
  for (start, drafter, mode), rs in groups.items():
    acc, acc_se = _mean_se([r["acceptance_online"] for r in rs])
    tpf, tpf_se = _mean_se([[r["tokens_per_target_forward"]] for r in rs])
    rows.append({"start": start, "drafter": drafter, "mode": mode, "seeds": len(rs),
                 "acceptance_online": acc.tolist(), "acceptance_online_se": acc_se.tolist(),
                 "tokens_per_target_forward": float(tpf[0]),
                 "tokens_per_target_forward_se": float(tpf_se[0])})
  for row in rows:
    ce = next((r for r in rows if (r["start"], r["drafter"], r["mode"]) ==
               (row["start"], "ce", row["mode"])), None)
    if ce is not None and row["drafter"] != "ce":
      diff = row["tokens_per_target_forward"] - ce["tokens_per_target_forward"]
      se = float(np.hypot(row["tokens_per_target_forward_se"],
                          ce["tokens_per_target_forward_se"]))
      row["vs_ce"] = {"diff": diff, "se": se, "beyond_2se": bool(se > 0 and abs(diff) > 2 * se)}
  return rows


def table(rows: list[dict]) -> str:
  pm = lambda m, s: f"{m:.3f}±{s:.3f}"
  lines = ["| start | drafter | mode | seeds | acceptance online per depth | tokens / target "
           "forward | vs ce |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    acc = " / ".join(pm(m, s) for m, s in zip(r["acceptance_online"],
                                               r["acceptance_online_se"]))
    vs = r.get("vs_ce")
    vs_text = (f"{vs['diff']:+.3f}±{vs['se']:.3f}{' (> 2 SE)' if vs['beyond_2se'] else ''}"
               if vs else "")
    lines.append(f"| {r['start']} | {r['drafter']} | {r['mode']} | {r['seeds']} | {acc} | "
                 f"{pm(r['tokens_per_target_forward'], r['tokens_per_target_forward_se'])} | "
                 f"{vs_text} |")
  return "\n".join(lines)


def plot(rows: list[dict], path: str, mode: str = "rejection"):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = [r for r in rows if r["mode"] == mode]
  starts = sorted({r["start"] for r in rows})
  drafters = list(dict.fromkeys(r["drafter"] for r in rows))
  fig, ax = plt.subplots(figsize=(7, 4))
  width = 0.8 / max(len(starts), 1)
  for i, start in enumerate(starts):
    vals = [next((r for r in rows if r["start"] == start and r["drafter"] == d), None)
            for d in drafters]
    ax.bar(np.arange(len(drafters)) + i * width,
           [v["tokens_per_target_forward"] if v else np.nan for v in vals], width,
           yerr=[v["tokens_per_target_forward_se"] if v else 0 for v in vals], capsize=3,
           label=start)
  ax.set_xticks(np.arange(len(drafters)) + width * (len(starts) - 1) / 2)
  ax.set_xticklabels(drafters)
  ax.set_ylabel(f"tokens per target forward ({mode}; mean ± SE over seeds)")
  ax.legend()
  ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  base = os.path.abspath(_WORKDIR.value)
  sweep = config_lib.load_sweep(_CONFIG.value, _ARG.value,
                               default=[{"mtp.loss": loss} for loss in LOSSES])
  runs = []
  for start in _STARTS.value:
    if start not in ("warm", "scratch", "config"):
      raise app.UsageError(f"--starts={start!r} is not allowed: warm, scratch or config")
    before_done = False
    for entry in sweep:
      for seed in range(_SEEDS.value):
        config = config_lib.apply_overrides(
            config_lib.load_file(_CONFIG.value, _ARG.value), entry)
        if _INIT_FROM.value:
          config.mtp.init_from = _INIT_FROM.value
        if start != "config":
          config.mtp.init = "fresh" if start == "scratch" else "sft"
        config.mtp.seed = seed
        # The SFT drafter is the same for every warm run: evaluate it once.
        config.mtp.eval_before = config.mtp.eval_before and not before_done and \
            config.mtp.init == "sft"
        config.stages = ("mtp",)
        config = config_lib.validate(config)
        name = config.mtp.loss
        if _ONLY.value and name not in _ONLY.value:
          continue
        workdir = os.path.join(base, start, name, f"seed{seed}")
        os.makedirs(workdir, exist_ok=True)
        stages.run(config, workdir)
        s = lineage.read_summary(workdir, "mtp")
        evals = [(name, s["after"])]
        if s.get("before") and not before_done and config.mtp.init == "sft":
          evals.append(("sft (joint ce)", s["before"]))  # the same for every seed
          before_done = True
        for drafter, ev in evals:
          for mode, online in ev["online"].items():
            runs.append({"start": start, "drafter": drafter, "mode": mode, "seed": seed,
                         "acceptance_online": online["acceptance"],
                         "tokens_per_target_forward": online["tokens_per_target_forward"],
                         "accuracy": online["accuracy"], "workdir": workdir})
  rows = aggregate(runs)
  md = table(rows)
  print(md)
  with open(os.path.join(base, "sweep.md"), "w") as f:
    f.write(md + "\n")
  with open(os.path.join(base, "sweep.json"), "w") as f:
    json.dump({"rows": rows, "runs": runs}, f, indent=2)
  if rows:
    plot(rows, os.path.join(base, "plots", "sweep.png"))
  print(f"wrote {base}/sweep.md, sweep.json, plots/sweep.png")


if __name__ == "__main__":
  app.run(main)
