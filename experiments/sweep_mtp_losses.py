r"""The MTP loss sweep: one MTP stage per entry of the config file's SWEEP, then a table.

  python experiments/sweep_mtp_losses.py --config=configs/mtp_small.py \
      --workdir=runs/mtp_small
  # warm start: each loss fine-tunes the quickstart's jointly trained MTP module
  python experiments/sweep_mtp_losses.py --config=configs/quickstart.py \
      --init_from=runs/quickstart --workdir=runs/sweep_quickstart

A config without SWEEP sweeps mtp.loss over all of bebop_jax.losses.mtp.LOSSES.
Each run goes to <workdir>/<loss> and is skipped when complete (resumed when partial); every
run starts from the same SFT checkpoint and trains on the same cached rollouts with the same
budget. Writes <workdir>/sweep.json, <workdir>/sweep.md and <workdir>/plots/sweep.png: per
loss, per-depth acceptance online (speculative decoding on held-out prompts) and
teacher-forced, and tokens per target forward, in each evaluated mode; the SFT drafter (joint
cross-entropy during SFT) is the first row.
"""

from __future__ import annotations

import importlib.util
import json
import os

from absl import app, flags

from bebop_jax import config as config_lib
from bebop_jax import stages
from bebop_jax.losses.mtp import LOSSES

_CONFIG = flags.DEFINE_string("config", "configs/mtp_small.py", "Config file with SWEEP.")
_ARG = flags.DEFINE_string("config_arg", None, "Argument passed to get_config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/mtp_small", "Sweep directory.")
_ONLY = flags.DEFINE_list("only", [], "Run only these losses (default: the whole SWEEP).")
_INIT_FROM = flags.DEFINE_string("init_from", None, "Override mtp.init_from (the SFT workdir).")


def _load(path: str):
  spec = importlib.util.spec_from_file_location("sweep_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _set(config, key: str, value):
  *parents, last = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[last] = value


def _row(name: str, ev: dict, mode: str) -> dict:
  online = ev["online"][mode]
  return {"drafter": name, "mode": mode, "acceptance_online": online["acceptance"],
          "acceptance_teacher_forced": ev["teacher_forced"][mode]["alpha"],
          "tokens_per_target_forward": online["tokens_per_target_forward"],
          "accuracy": online["accuracy"]}


def table(rows: list[dict]) -> str:
  fmt = lambda xs: "/".join(f"{x:.3f}" for x in xs)
  lines = ["| drafter | mode | acceptance online | teacher-forced | tokens / target forward |",
           "|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['drafter']} | {r['mode']} | {fmt(r['acceptance_online'])} | "
                 f"{fmt(r['acceptance_teacher_forced'])} | "
                 f"{r['tokens_per_target_forward']:.2f} |")
  return "\n".join(lines)


def plot(rows: list[dict], path: str, mode: str = "rejection"):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = [r for r in rows if r["mode"] == mode]
  fig, ax = plt.subplots(figsize=(6, 4))
  for r in rows:
    depths = range(1, len(r["acceptance_online"]) + 1)
    ax.plot(depths, r["acceptance_online"], marker="o",
            label=f"{r['drafter']} ({r['tokens_per_target_forward']:.2f} tok/fwd)")
  ax.set_xlabel("draft depth k")
  ax.set_ylabel(f"online acceptance ({mode})")
  ax.set_xticks(list(depths))
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  module = _load(_CONFIG.value)
  base = os.path.abspath(_WORKDIR.value)
  rows, summaries = [], {}
  sweep = getattr(module, "SWEEP", None) or [{"mtp.loss": loss} for loss in LOSSES]
  for entry in sweep:
    config = module.get_config(_ARG.value)
    if _INIT_FROM.value:
      config.mtp.init_from = _INIT_FROM.value
    for key, value in entry.items():
      _set(config, key, value)
    config.stages = ("mtp",)
    config = config_lib.validate(config)
    name = config.mtp.loss
    if _ONLY.value and name not in _ONLY.value:
      continue
    workdir = os.path.join(base, name)
    os.makedirs(workdir, exist_ok=True)
    stages.run(config, workdir)
    from bebop_jax.train import mtp  # pylint: disable=g-import-not-at-top
    summaries[name] = mtp.read_summary(workdir)
  first = next(iter(summaries.values()), None)
  modes = list(first["after"]["online"]) if first else []
  if first and first.get("before"):
    rows += [_row("sft (joint ce)", first["before"], m) for m in modes]
  for name, s in summaries.items():
    rows += [_row(name, s["after"], m) for m in modes]
  md = table(rows)
  print(md)
  with open(os.path.join(base, "sweep.md"), "w") as f:
    f.write(md + "\n")
  with open(os.path.join(base, "sweep.json"), "w") as f:
    json.dump({"rows": rows, "timing": {n: s["timing"] for n, s in summaries.items()}}, f,
              indent=2)
  if rows:
    plot(rows, os.path.join(base, "plots", "sweep.png"))
  print(f"wrote {base}/sweep.md, sweep.json, plots/sweep.png")


if __name__ == "__main__":
  app.run(main)
