"""The four-arm RL benchmark (experiments.rl_benchmark) against hand computations: its arithmetic,
the paired intervals against scipy, the interleaved schedule, and run_arms' execution of it
over a scripted stage (a pass over real arms is in test_rl.py)."""

import json
import os

import numpy as np
import pytest
from scipy import stats

from experiments import rl_benchmark as bench
from bebop_jax.stages import config as config_lib
from bebop_jax.stages import rl as stage
from bebop_jax.stages import lineage


def _records(n, rollout, learner, step, staleness=0.0):
  return [{"step": s, "step_s": step + (5.0 if s == 1 else 0.0), "rollout_s": rollout,
           "learner_s": learner - 0.5, "mtp_update_s": 0.5, "sync_s": 0.01,
           "learner_idle_s": 0.0, "rollout_idle_s": 0.0, "staleness_mean": staleness,
           "tokens_per_target_forward": 3.0, "completion_length": 40.0}
          for s in range(1, n + 1)]


def _timed(step_s, rollout_s=None):
  """Records with the given seconds per step ({step: seconds})."""
  rollout_s = rollout_s or {s: t / 2 for s, t in step_s.items()}
  return [{**_records(1, 1.0, 1.0, 1.0)[0], "step": s, "step_s": t, "rollout_s": rollout_s[s]}
          for s, t in sorted(step_s.items())]


def test_amdahl_is_the_definition():
  assert bench.amdahl(0.5, 2.0) == pytest.approx(1 / (0.5 + 0.25))
  assert bench.amdahl(0.0, 10.0) == 1.0 and bench.amdahl(1.0, 3.0) == pytest.approx(3.0)


def test_arm_stats_leave_out_warmup_and_time_the_target():
  evals = {"0": {"pass_at_1": {"math": 0.2, "code": 0.4}},
           "2": {"pass_at_1": {"math": 0.4, "code": 0.4}},
           "4": {"pass_at_1": {"math": 0.6, "code": 0.6}}}
  a = bench.arm_stats(_records(4, 2.0, 3.0, 5.0), evals, warmup=1, target=0.4)
  assert a["step_s"] == 5.0 and a["first_steps_s"] == 10.0  # step 1 held compile
  assert a["steady_steps"] == [2, 3, 4] and a["warmup_steps"] == [1]
  assert a["rollout_share"] == pytest.approx(0.4)
  assert a["held_out"] == [(0, pytest.approx(0.3)), (2, 0.4), (4, 0.6)]
  assert a["time_to_target_s"] == 15.0  # steps 1 (10 s) + 2 (5 s)
  # Step 0 (before training) never counts as reaching the target.
  assert bench.arm_stats(_records(4, 2.0, 3.0, 5.0), evals, warmup=1,
                         target=0.2)["time_to_target_s"] == 15.0
  assert bench.arm_stats(_records(4, 2.0, 3.0, 5.0), evals, warmup=1,
                         target=0.9)["time_to_target_s"] is None


def test_arm_stats_leave_out_the_first_steps_of_every_block():
  times = {s: 5.0 + s for s in range(1, 13)}
  for start in (1, 5, 9):
    times[start] += 100.0  # a stage start
  a = bench.arm_stats(_timed(times), {}, warmup=2, target=None, segment_starts=(1, 5, 9))
  assert a["warmup_steps"] == [1, 2, 5, 6, 9, 10]
  assert a["steady_steps"] == [3, 4, 7, 8, 11, 12]
  assert a["step_s"] == np.median([8.0, 9.0, 12.0, 13.0, 16.0, 17.0])
  assert a["first_steps_s"] == sum(times[s] for s in (1, 2, 5, 6, 9, 10))
  # The held-out clock still counts every step.
  b = bench.arm_stats(_timed(times), {"0": {"pass_at_1": {"m": 0.1}},
                                      "8": {"pass_at_1": {"m": 0.5}}},
                      warmup=2, target=0.5, segment_starts=(1, 5, 9))
  assert b["time_to_target_s"] == pytest.approx(sum(times[s] for s in range(1, 9)))


def test_t_critical_is_the_tabulated_value():
  # Student-t two-sided 95% critical values from a printed table.
  for df, value in ((1, 12.706), (2, 4.303), (5, 2.571), (30, 2.042)):
    assert bench.t_critical(df) == pytest.approx(value, abs=1e-3)


def test_paired_interval_is_the_t_interval_over_block_means_of_log_ratios():
  """Two arms interleaved in 3 blocks of 4 steps, warm-up 1 per block, a step missing in each
  arm and one step only B has: the speedup of A over B against scipy's one-sample t interval
  over the blocks' mean log ratios of the steps both arms count."""
  rng = np.random.default_rng(0)
  a_times = {s: 2.0 * np.exp(rng.normal(0, 0.1)) for s in range(1, 13)}
  b_times = {s: 3.0 * np.exp(rng.normal(0, 0.1)) for s in range(1, 13)}
  for start in (1, 5, 9):  # stage starts: left out, or the ratio would be near 1
    a_times[start] += 30.0
    b_times[start] += 60.0
  del a_times[7], b_times[11]
  records = {"speculative_async": _timed(a_times), "autoregressive_sync": _timed(b_times)}
  steady = {arm: bench.arm_stats(r, {}, warmup=1, target=None,
                                 segment_starts=(1, 5, 9))["steady_steps"]
            for arm, r in records.items()}
  assert steady["speculative_async"] == [2, 3, 4, 6, 8, 10, 11, 12]
  pairs = bench.paired_ratios(records, steady, block_steps=4)
  p = pairs["speculative_async_vs_autoregressive_sync"]
  # The definition: per block the mean of log(t_B / t_A) over steps both arms count.
  paired = [s for s in (2, 3, 4, 6, 8, 10, 12)]
  blocks = [[np.log(b_times[s] / a_times[s]) for s in paired if (s - 1) // 4 == k]
            for k in range(3)]
  assert [len(b) for b in blocks] == [3, 2, 2]
  means = np.array([np.mean(b) for b in blocks])
  ci = stats.ttest_1samp(means, 0.0).confidence_interval(0.95)
  assert p["measured"] == pytest.approx(np.exp(means.mean()), rel=1e-12)
  assert p["ci95"] == pytest.approx([np.exp(ci.low), np.exp(ci.high)], rel=1e-12)
  assert (p["steps"], p["blocks"], p["df"], p["arms"], p["of"]) == (
      7, 3, 2, ["speculative_async", "autoregressive_sync"], "step_s")
  assert p["median_ratio"] == pytest.approx(
      np.median([b_times[s] for s in steady["autoregressive_sync"]]) /
      np.median([a_times[s] for s in steady["speculative_async"]]))
  assert 1.0 < p["ci95"][0] < p["measured"] < p["ci95"][1] < 2.25  # A is about 1.5x faster
  # Only the pairs whose arms are both present.
  assert set(pairs) == {"speculative_async_vs_autoregressive_sync"}
  # Arms not interleaved: one unit, the mean over steps, no interval.
  one = bench.paired_ratios(records, steady, block_steps=4, interleaved=["speculative_async"])
  logs = [np.log(b_times[s] / a_times[s]) for s in paired]
  q = one["speculative_async_vs_autoregressive_sync"]
  assert q["measured"] == pytest.approx(np.exp(np.mean(logs))) and q["ci95"] is None
  assert (q["blocks"], q["steps"]) == (1, 7)


def test_decode_speedup_pairs_rollout_seconds_of_the_sync_arms():
  steps = range(1, 9)
  ar = {s: 4.0 + 0.1 * s for s in steps}
  sp = {s: 2.0 + 0.3 * (s % 2) for s in steps}
  records = {"autoregressive_sync": _timed({s: 10.0 for s in steps}, ar),
             "speculative_sync": _timed({s: 8.0 for s in steps}, sp)}
  steady = {arm: [2, 3, 4, 6, 7, 8] for arm in records}
  pairs = bench.paired_ratios(records, steady, block_steps=4)
  d = pairs["decode_speedup"]
  means = np.array([np.mean([np.log(ar[s] / sp[s]) for s in (2, 3, 4)]),
                    np.mean([np.log(ar[s] / sp[s]) for s in (6, 7, 8)])])
  ci = stats.ttest_1samp(means, 0.0).confidence_interval(0.95)
  assert d["of"] == "rollout_s" and d["arms"] == ["speculative_sync", "autoregressive_sync"]
  assert d["measured"] == pytest.approx(np.exp(means.mean()))
  assert d["ci95"] == pytest.approx([np.exp(ci.low), np.exp(ci.high)])
  assert pairs["speculative_sync_vs_autoregressive_sync"]["measured"] == pytest.approx(1.25)


def test_compare_gives_each_ratio_and_its_bound():
  evals = {"0": {"pass_at_1": {"math": 0.5}}}
  stat = lambda r, l, s: bench.arm_stats(_records(4, r, l, s), evals, warmup=1, target=None)
  arms = {"autoregressive_sync": stat(6.0, 2.0, 8.0), "speculative_sync": stat(3.0, 2.0, 5.0),
          "autoregressive_async": stat(6.0, 2.0, 6.5), "speculative_async": stat(3.0, 2.0, 3.5)}
  r = bench.compare(arms)
  assert r["decode_speedup"] == pytest.approx(2.0)
  assert r["speculative_sync"]["measured"] == pytest.approx(8 / 5)
  assert r["speculative_sync"]["amdahl"] == pytest.approx(1 / (1 - 0.75 + 0.75 / 2))
  assert r["autoregressive_async"]["overlap_bound"] == pytest.approx(8 / 6)
  assert r["speculative_async"]["measured"] == pytest.approx(5 / 3.5)
  assert r["end_to_end"]["measured"] == pytest.approx(8 / 3.5)
  assert r["end_to_end"]["bound"] == pytest.approx(8 / 3)
  text = bench.markdown(arms, r, 0.5)
  assert "| speculative_async | 3.50 |" in text and "Amdahl bound 1.60x" in text


def test_schedule_alternates_the_order_and_covers_every_step_once():
  plan = bench.schedule(bench.ARMS, 10, 4)
  orders = [[e["arm"] for e in plan if e["block"] == b] for b in range(3)]
  assert orders == [list(bench.ARMS), list(reversed(bench.ARMS)), list(bench.ARMS)]
  for arm in bench.ARMS:
    ranges = [(e["first_step"], e["last_step"]) for e in plan if e["arm"] == arm]
    assert ranges == [(1, 4), (5, 8), (9, 10)]
    covered = [s for lo, hi in ranges for s in range(lo, hi + 1)]
    assert sorted(covered) == list(range(1, 11)) and len(set(covered)) == len(covered)
  assert [e["position"] for e in plan[4:8]] == [0, 1, 2, 3]
  # Block size 0 or >= the steps: one block, the arms one after the other.
  for block_steps in (0, 10, 50):
    one = bench.schedule(bench.ARMS, 10, block_steps)
    assert [(e["arm"], e["first_step"], e["last_step"]) for e in one] == [
        (a, 1, 10) for a in bench.ARMS]


class _ScriptedStage:
  """stage.run for run_arms without JAX: writes the metrics, evals and summary a real stage
  would, each arm `factor` seconds per step (x 1.1 on odd steps) and 50 s more at every stage
  start; raises at `crash` = (arm, step) after logging the steps before it."""

  FACTOR = {"autoregressive_sync": 4.0, "speculative_sync": 3.0, "speculative_async": 2.0}

  def __init__(self, crash=None):
    self.done, self.calls, self.crash = {}, [], crash

  def steps_done(self, arm_dir):
    return self.done.get(os.path.basename(arm_dir), 0)

  def run(self, cfg, arm_dir):
    arm = os.path.basename(arm_dir)
    first, stop = self.done.get(arm, 0) + 1, cfg.rl.train.stop_at_step
    self.calls.append((arm, first, stop))
    os.makedirs(lineage.stage_dir(arm_dir, "rl"), exist_ok=True)
    for s in range(first, stop + 1):
      if (arm, s) == self.crash:
        self.crash = None
        raise RuntimeError("preempted")
      seconds = self.FACTOR[arm] * (1.1 if s % 2 else 1.0) + (50.0 if s == first else 0.0)
      with open(os.path.join(arm_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({**_timed({s: seconds})[0], "stage": "rl"}) + "\n")
      self.done[arm] = s
    evals = {"0": {"pass_at_1": {"math": 0.5}}}
    with open(os.path.join(lineage.stage_dir(arm_dir, "rl"), "evals.json"), "w") as f:
      json.dump(evals, f)
    if stop == cfg.rl.train.num_steps:
      with open(os.path.join(lineage.stage_dir(arm_dir, "rl"), "summary.json"), "w") as f:
        json.dump({"steps": stop, "complete": True, "timing": {"compile_s": 1.0}}, f)
      return {"steps": stop, "complete": True}
    return {"steps": stop, "complete": False}


def _bench_config(steps):
  config = config_lib.base_config()
  config.stages = ("rl",)
  config.rl.train.num_steps = steps
  return config


def test_run_arms_runs_the_blocks_in_alternating_order_and_resumes_the_schedule(
    tmp_path, monkeypatch):
  """Three arms, 10 steps in blocks of 4, warm-up 1, a preemption of speculative_sync in
  block 1: the stage starts follow the schedule, the rerun resumes it where it stopped, and
  the steps after every start (the restart too) are left out, so the paired speedups are the
  arms' speed ratios exactly."""
  arms = ["autoregressive_sync", "speculative_sync", "speculative_async"]
  fake = _ScriptedStage(crash=("speculative_sync", 7))
  monkeypatch.setattr(stage, "run", fake.run)
  monkeypatch.setattr(bench, "_steps_done", fake.steps_done)
  with pytest.raises(RuntimeError, match="preempted"):
    bench.run_arms(_bench_config(10), str(tmp_path), arms, split=False, warmup=1,
                   block_steps=4)
  out = bench.run_arms(_bench_config(10), str(tmp_path), arms, split=False, warmup=1,
                       block_steps=4)
  ar, sp, spa = arms
  assert fake.calls == [(ar, 1, 4), (sp, 1, 4), (spa, 1, 4),  # block 0
                        (spa, 5, 8), (sp, 5, 8),  # block 1 until the preemption
                        (sp, 7, 8), (ar, 5, 8),  # the rerun
                        (ar, 9, 10), (sp, 9, 10), (spa, 9, 10)]  # block 2
  sched = out["schedule"]
  assert (sched["block_steps"], sched["blocks"], sched["warmup"]) == (4, 3, 1)
  assert sched["order"] == [arms, arms[::-1], arms]
  assert [(s["arm"], s["block"], s["first_step"], s["last_step"]) for s in sched["segments"]] == [
      (a, b, lo, hi) for (a, lo, hi), b in zip(fake.calls, (0, 0, 0, 1, 1, 1, 1, 2, 2, 2))]
  assert sched["segments"][4]["seconds"] is None  # the preempted start
  assert out["arms"][sp]["steady_steps"] == [2, 3, 4, 6, 8, 10]
  assert out["arms"][ar]["steady_steps"] == [2, 3, 4, 6, 7, 8, 10]
  assert all(a["interleaved"] for a in out["arms"].values())
  f = _ScriptedStage.FACTOR
  for name, p in out["pairs"].items():
    a, b = p["arms"]
    expected = f[b] / f[a]
    assert p["measured"] == pytest.approx(expected) and p["blocks"] == 3, name
    assert p["ci95"] == pytest.approx([expected, expected]), name
  assert set(out["pairs"]) == {"speculative_sync_vs_autoregressive_sync",
                               "speculative_async_vs_autoregressive_sync",
                               "speculative_async_vs_speculative_sync", "decode_speedup"}
  assert out["placement"]["mode"] == "colocated"
  json.dumps(out)
  # A third call finds every arm complete and runs nothing; another block size is refused.
  assert bench.run_arms(_bench_config(10), str(tmp_path), arms, split=False, warmup=1,
                        block_steps=4)["pairs"] == out["pairs"]
  assert len(fake.calls) == 10
  with pytest.raises(ValueError, match="scheduled in blocks of 4 steps"):
    bench.run_arms(_bench_config(10), str(tmp_path), arms, split=False, warmup=1, block_steps=5)
  with pytest.raises(ValueError, match="every block would be all warm-up"):
    bench.run_arms(_bench_config(10), str(tmp_path / "other"), arms, split=False, warmup=4,
                   block_steps=4)


def _placement(mode, platform, devices):
  return {"mode": mode, "devices": devices, "platform": platform,
          "simulated": platform == "cpu" and devices > 1, "cpu_cores": 2}


def test_the_placement_line_calls_split_on_simulated_cpu_devices_a_structural_check():
  assert "structural check" in bench.placement_line(_placement("split", "cpu", 2))
  assert "split sub-meshes" in bench.placement_line(_placement("split", "gpu", 2))
  for p in (_placement("split", "gpu", 2), _placement("colocated", "cpu", 2),
            _placement("colocated", "cpu", 1), _placement("colocated", "tpu", 8)):
    assert "structural check" not in bench.placement_line(p), p
  p = bench.placement(split=True)  # the test process: 8 simulated CPU devices (conftest)
  assert p == {"mode": "split", "devices": 8, "platform": "cpu", "simulated": True,
               "cpu_cores": os.cpu_count()}


def test_markdown_puts_the_headline_pairs_first_with_their_intervals():
  pair = lambda a, b, m, ci: {"measured": m, "ci95": ci, "steps": 18, "blocks": 6, "df": 5,
                              "median_ratio": m + 0.01, "arms": [a, b], "of": "step_s"}
  pairs = {f"{a}_vs_{b}": pair(a, b, 1.1 + i / 10, [1.0 + i / 10, 1.2 + i / 10])
           for i, (a, b) in enumerate(bench.OTHER_PAIRS + bench.HEADLINE_PAIRS)}
  pairs["decode_speedup"] = {**pair("speculative_sync", "autoregressive_sync", 1.3, None),
                             "of": "rollout_s", "blocks": 1}
  arms = {"autoregressive_sync": bench.arm_stats(_records(4, 6.0, 2.0, 8.0), {}, warmup=1,
                                                 target=None)}
  sched = {"arms": list(bench.ARMS), "block_steps": 8, "blocks": 6, "warmup": 2,
           "order": [list(bench.ARMS), list(reversed(bench.ARMS))] * 3}
  text = bench.markdown(arms, {}, None, pairs=pairs, placement=_placement("split", "cpu", 2),
                        schedule=sched)
  rows = [line for line in text.splitlines() if " vs " in line and line.startswith("|")]
  assert rows[0] == ("| **speculative_async vs autoregressive_async** | 1.30x | 1.20-1.40 | "
                     "6 | 18 | 1.31x |")
  assert [r.split(" | ")[0] for r in rows] == [
      "| **speculative_async vs autoregressive_async**",
      "| **speculative_sync vs autoregressive_sync**",
      "| **speculative_async vs autoregressive_sync**",
      "| autoregressive_async vs autoregressive_sync", "| speculative_async vs speculative_sync",
      "| speculative_sync vs autoregressive_sync (rollout s)"]
  assert "| 1.30x | none (one block) |" in rows[-1]
  assert "structural check" in text.splitlines()[0]
  assert "6 blocks of 8 steps, the order alternating ABCD, DCBA" in text


def test_unknown_arm_is_an_error():
  with pytest.raises(ValueError, match="arm='fast_sync' is not allowed"):
    bench.arm_overrides("fast_sync", split=True)


def test_default_target_is_halfway_to_the_best_improvement():
  arm = lambda *curve: {"held_out": list(curve)}
  arms = {"a": arm((0, 0.5), (8, 0.55), (16, 0.6)), "b": arm((0, 0.5), (8, 0.7))}
  assert bench.default_target(arms) == pytest.approx(0.6)
  assert bench.default_target({"a": arm((0, 0.5), (8, 0.45))}) is None


def test_adaptive_arms_are_speculative_rollouts_with_the_adaptive_draft_length():
  from bebop_jax.stages import config as config_lib  # pylint: disable=g-import-not-at-top
  base = config_lib.base_config()
  for arm in bench.ALL_ARMS:
    cfg = bench.apply_overrides(base, bench.arm_overrides(arm, split=False))
    engine, mode = arm.split("_")
    assert cfg.rl.rollout.engine == ("autoregressive" if engine == "autoregressive"
                                     else "speculative")
    assert cfg.decoding.adaptive.enabled == (engine == "adaptive")
    assert cfg.rl.asynchronous.enabled == (mode == "async")
