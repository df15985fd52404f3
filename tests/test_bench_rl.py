"""The four-arm RL benchmark's arithmetic (bebop_jax.bench_rl) against hand computations (a
pass over real arms is in test_rl.py)."""

import pytest

from bebop_jax import bench_rl as bench


def _records(n, rollout, learner, step, staleness=0.0):
  return [{"step": s, "step_s": step + (5.0 if s == 1 else 0.0), "rollout_s": rollout,
           "learner_s": learner - 0.5, "mtp_update_s": 0.5, "sync_s": 0.01,
           "learner_idle_s": 0.0, "rollout_idle_s": 0.0, "staleness_mean": staleness,
           "tokens_per_target_forward": 3.0, "completion_length": 40.0}
          for s in range(1, n + 1)]


def test_amdahl_is_the_definition():
  assert bench.amdahl(0.5, 2.0) == pytest.approx(1 / (0.5 + 0.25))
  assert bench.amdahl(0.0, 10.0) == 1.0 and bench.amdahl(1.0, 3.0) == pytest.approx(3.0)


def test_arm_stats_leave_out_warmup_and_time_the_target():
  evals = {"0": {"pass_at_1": {"math": 0.2, "code": 0.4}},
           "2": {"pass_at_1": {"math": 0.4, "code": 0.4}},
           "4": {"pass_at_1": {"math": 0.6, "code": 0.6}}}
  a = bench.arm_stats(_records(4, 2.0, 3.0, 5.0), evals, warmup=1, target=0.4)
  assert a["step_s"] == 5.0 and a["first_steps_s"] == 10.0  # step 1 held compile
  assert a["rollout_share"] == pytest.approx(0.4)
  assert a["held_out"] == [(0, pytest.approx(0.3)), (2, 0.4), (4, 0.6)]
  assert a["time_to_target_s"] == 15.0  # steps 1 (10 s) + 2 (5 s)
  # Step 0 (before training) never counts as reaching the target.
  assert bench.arm_stats(_records(4, 2.0, 3.0, 5.0), evals, warmup=1,
                         target=0.2)["time_to_target_s"] == 15.0
  assert bench.arm_stats(_records(4, 2.0, 3.0, 5.0), evals, warmup=1,
                         target=0.9)["time_to_target_s"] is None


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


def test_unknown_arm_is_an_error():
  with pytest.raises(ValueError, match="arm='fast_sync' is not allowed"):
    bench.arm_overrides("fast_sync", split=True)


def test_default_target_is_halfway_to_the_best_improvement():
  arm = lambda *curve: {"held_out": list(curve)}
  arms = {"a": arm((0, 0.5), (8, 0.55), (16, 0.6)), "b": arm((0, 0.5), (8, 0.7))}
  assert bench.default_target(arms) == pytest.approx(0.6)
  assert bench.default_target({"a": arm((0, 0.5), (8, 0.45))}) is None
