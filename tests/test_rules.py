"""experiments/findings/rules.py: every version decides as its text says, on hand-built
results; old versions stay as they were; the page shows every version's verdict and a title
computed from the verdicts."""

import hashlib

import numpy as np
import pytest

from experiments.findings import acceptance_entropy, common, objectives, results, rules
from experiments.findings import through_rl

# The text of every version, pinned: an edit in place fails here; a change of rule is a new
# version (add its hash), the old ones untouched.
PINNED = {
    ("F1", 1): "d2974ea671cbfbe0",
    ("F1", 2): "02e42310b3681af7",
    ("F1", 3): "4e0a6a5ce44d36d1",
    ("F2", 1): "bb9fbec22ba29d35",
    ("F2", 2): "b9315209024bb3e3",
    ("F2", 3): "a530f0c48d1e0d7e",
    ("F2", 4): "260b02ce40d11190",
    ("F3", 1): "25c18d257b75d3a4",
    ("F3", 2): "d9546775e5703197",
    ("F3", 3): "64c08cf77afc9408",
    ("F4", 1): "97307bda7904bb85",
    ("F4", 2): "18fdbd2fe32d641e",
    ("F4", 3): "8db27a071e62012c",
    ("Speedup", 1): "fe21beb1c705dec1",
    ("Speedup", 2): "40cd7d92e66eacee",
}


def test_versions_are_numbered_and_old_texts_unchanged():
  seen = {}
  for rule in rules.RULES.values():
    assert [v.number for v in rule.versions] == list(range(1, len(rule.versions) + 1))
    for v in rule.versions:
      seen[(rule.label, v.number)] = hashlib.sha256(v.text.encode()).hexdigest()[:16]
      assert v.history
  assert seen == PINNED
  assert set(rules.RULES) == set(results.PAGE_ORDER)


# ----------------------------------------------------------------------------- F1 and F2


def _points(entropy_span, *, gr_slope=-0.4, rej_slope=-0.2, noise=0.004, seed=0, n=30):
  """Both point sets: RL steps (a series) and re-scoring temperatures, the given entropy
  span, greedy_draft and rejection sharing each point's noise."""
  rng = np.random.default_rng(seed)
  out = {}
  for source, count in (("rl_steps", n), ("rescoring", 5)):
    ent = np.linspace(0.3, 0.3 + entropy_span, count) + rng.normal(0, entropy_span / 50, count)
    shared = rng.normal(0, noise, count)
    rej = 0.95 + rej_slope * ent + shared
    gr = 0.93 + gr_slope * ent + shared + rng.normal(0, noise / 4, count)
    out[source] = {m: {"entropy": ent, "depth1": a, "mean": a}
                   for m, a in (("rejection", rej), ("greedy_draft", gr))}
  return out


def _decide(rule, fit):
  return {v["version"]: v["verdict"] for v in rule.evaluate({"fits": fit})["versions"]}


def test_f1_needs_entropy_that_moves_and_a_corrected_series():
  wide = acceptance_entropy.fits(_points(0.5))
  assert _decide(rules.F1, wide) == {1: "reproduced", 2: "reproduced", 3: "inconclusive"}
  assert wide["rl_steps"]["depth1"]["rejection"]["corrected"]
  # The same falling lines over 0.05 nats: version 1 still says reproduced, version 2 cannot
  # decide on so narrow a span.
  narrow = acceptance_entropy.fits(_points(0.05, noise=0.0005))
  assert narrow["rl_steps"]["depth1"]["rejection"]["slope_ci95"][1] < 0
  assert _decide(rules.F1, narrow) == {1: "reproduced", 2: "inconclusive", 3: "inconclusive"}
  reason = rules.F1.evaluate({"fits": narrow})["versions"][1]["reason"]
  assert "less than 0.1 nats" in reason
  # A series fitted as if its points were independent: version 2 refuses it.
  uncorrected = acceptance_entropy.fits(_points(0.5))
  uncorrected["rl_steps"]["depth1"]["rejection"]["corrected"] = False
  assert _decide(rules.F1, uncorrected)[2] == "inconclusive"
  # Rising acceptance in every wide set: not reproduced by both.
  rising = acceptance_entropy.fits(_points(0.5, gr_slope=0.3, rej_slope=0.2))
  assert _decide(rules.F1, rising) == {1: "not reproduced", 2: "not reproduced",
                                       3: "inconclusive"}


def test_f2_versions_ratio_then_paired_gap_then_guards():
  # Greedy falls twice as fast; the modes share their noise: each fit alone is noisy (ratio
  # within two standard errors of 1 on the RL steps), the paired gap is clear.
  fit = acceptance_entropy.fits(_points(0.5, noise=0.06, seed=3))
  ratio = fit["rl_steps"]["depth1"]["ratio"]
  assert ratio["ratio"] - 2 * ratio["ratio_se"] < 1
  assert fit["rl_steps"]["depth1"]["difference"]["slope_ci95"][1] < 0
  assert _decide(rules.F2, fit) == {1: "inconclusive", 2: "reproduced", 3: "reproduced",
                                    4: "inconclusive"}
  narrow = acceptance_entropy.fits(_points(0.05, noise=0.0005))
  assert _decide(rules.F2, narrow)[2] == "reproduced"
  assert _decide(rules.F2, narrow)[3] == "inconclusive"
  swapped = acceptance_entropy.fits(_points(0.5, gr_slope=-0.1, rej_slope=-0.3))
  assert _decide(rules.F2, swapped) == {1: "not reproduced", 2: "not reproduced",
                                        3: "not reproduced", 4: "inconclusive"}


def test_f2_v2_history_discloses_the_change_after_the_first_results():
  v2 = rules.F2.versions[1]
  assert "9541799" in v2.history and "after the first" in v2.history
  assert "inconclusive" in v2.history


# ----------------------------------------------------------------------------- F3


def _objective_rows(seed_effects, gains, jitter=0.0):
  rows = []
  for loss, g in gains.items():
    for k, e in enumerate(seed_effects):
      acc = 0.9 + e + g + jitter * ((3 * k + len(loss)) % 5 - 2)
      rows.append({"loss": loss, "seed": k, "mode": "rejection", "task": "all",
                   "acceptance": [acc] * 3, "tokens_per_target_forward": 3 * acc})
  return rows


def _f3(rows):
  comp = objectives.comparison(rows, objectives.aggregate(rows))
  return {v["version"]: v["verdict"] for v in rules.F3.evaluate(comp)["versions"]}


def test_f3_two_seeds_two_standard_errors_is_not_a_t_interval():
  """Two seeds, e2e_tv and tv 3-4 standard errors above CE: version 1's two-SE rule says
  reproduced; the paired t interval at 1 df (t = 12.7) does not."""
  rows = _objective_rows([0.0, 0.0], {"ce": 0.0, "kl": 0.002, "tv": 0.008, "e2e_tv": 0.010},
                         jitter=0.002)
  assert _f3(rows) == {1: "reproduced", 2: "inconclusive", 3: "inconclusive"}


def test_f3_pairing_by_seed_removes_the_seed_effect():
  """Three seeds whose effect is shared by every loss: unpaired, within two SE; paired,
  every seed shows the gain."""
  rows = _objective_rows([0.0, 0.03, -0.03],
                         {"ce": 0.0, "kl": 0.002, "tv": 0.008, "e2e_tv": 0.010}, jitter=0.0005)
  assert _f3(rows) == {1: "inconclusive", 2: "reproduced", 3: "reproduced"}
  worse = _objective_rows([0.0, 0.03, -0.03],
                          {"ce": 0.0, "kl": 0.002, "tv": 0.008, "e2e_tv": -0.010}, jitter=0.0005)
  assert _f3(worse)[2] == "not reproduced"
  # tv beats e2e_tv in every seed: e2e-TV is below the best, so inconclusive.
  below = _objective_rows([0.0, 0.03, -0.03],
                          {"ce": 0.0, "kl": 0.002, "tv": 0.020, "e2e_tv": 0.010}, jitter=0.0005)
  assert _f3(below)[2] == "inconclusive"


# ----------------------------------------------------------------------------- F4


def _f4_arms(*, e2e_slope, ce_slope, entropy_slope, pass_delta=0.0, n=30, seed=0):
  rng = np.random.default_rng(seed)
  steps = np.arange(1, n + 1)
  shared = rng.normal(0, 0.004, n)
  ent = 0.3 + entropy_slope * steps + rng.normal(0, 0.005, n)
  arms = {}
  for arm, slope in (("frozen_e2e_tv", e2e_slope), ("frozen_ce", ce_slope)):
    acc = 0.94 + slope * steps + shared + rng.normal(0, 0.001, n)
    arms[arm] = {"steps": steps.tolist(), "entropy": ent.tolist(),
                 "tf_acceptance": {"rejection": acc[:, None].repeat(3, 1).tolist()},
                 "eval_acceptance": {"rejection": [[0.94] * 3, [0.94 + slope * n] * 3]},
                 "pass_at_1_delta": {"math": {"delta": pass_delta, "se": 0.01}}}
  return arms


def _f4(arms, version=2):
  ev = rules.F4.evaluate(through_rl.comparison(arms))["versions"]
  return {v["version"]: v["verdict"] for v in ev}, ev[version - 1]["reason"]


def test_f4_control_and_a_moving_policy():
  # The policy moves (entropy +0.15 nats over the run), both drafters keep their acceptance.
  kept, _ = _f4(_f4_arms(e2e_slope=0.0, ce_slope=0.0, entropy_slope=0.005))
  assert kept == {1: "reproduced", 2: "reproduced", 3: "inconclusive"}  # 30 steps < 48
  # The policy barely moves: version 1 reproduced, version 2 says the policy barely moved.
  still, reason = _f4(_f4_arms(e2e_slope=0.0, ce_slope=0.0, entropy_slope=0.0))
  assert still == {1: "reproduced", 2: "inconclusive", 3: "inconclusive"}
  assert "barely moved" in reason
  # ... unless its held-out pass@1 moved.
  learned, _ = _f4(_f4_arms(e2e_slope=0.0, ce_slope=0.0, entropy_slope=0.0, pass_delta=0.05))
  assert learned[2] == "reproduced"
  # The control gains 0.06 over the run while e2e-TV stays: e2e-TV loses against the control
  # beyond the margin, which version 1 cannot see.
  lost, reason = _f4(_f4_arms(e2e_slope=0.0, ce_slope=0.002, entropy_slope=0.005))
  assert lost == {1: "reproduced", 2: "not reproduced", 3: "not reproduced"}
  assert "control" in reason
  # e2e-TV itself loses 0.09 over the run: not reproduced by both.
  falls, _ = _f4(_f4_arms(e2e_slope=-0.003, ce_slope=-0.003, entropy_slope=0.005))
  assert falls == {1: "not reproduced", 2: "not reproduced", 3: "not reproduced"}


def test_f4_v3_needs_a_long_run_and_movement_beyond_its_interval():
  """Version 3: at least 48 steps, and a moving policy judged by the interval of the fitted
  entropy change (or of the pass@1 change), not its point estimate."""
  # 60 steps, entropy +0.3 nats over the run, both drafters keep their acceptance.
  moving, _ = _f4(_f4_arms(e2e_slope=0.0, ce_slope=0.0, entropy_slope=0.005, n=60))
  assert moving == {1: "reproduced", 2: "reproduced", 3: "reproduced"}
  # A fitted entropy change of +0.13 nats (beyond version 2's 0.05, and beyond 0.1) with
  # batch noise wide enough that its interval reaches inside +-0.1: version 2 counts the
  # policy as moved, version 3 does not (a point-estimate gate at 0.1 would).
  arms = _f4_arms(e2e_slope=0.0, ce_slope=0.0, entropy_slope=0.0005, n=60, seed=1)
  rng = np.random.default_rng(7)
  for arm in arms.values():
    arm["entropy"] = (np.asarray(arm["entropy"]) + rng.normal(0, 0.15, 60)).tolist()
  policy = through_rl.policy_movement(arms["frozen_e2e_tv"])
  assert policy["entropy_change"] > rules.ENTROPY_DRIFT
  assert policy["entropy_change_ci95"][0] < rules.ENTROPY_DRIFT
  verdicts, reason = _f4(arms, version=3)
  assert verdicts[2] == "reproduced" and verdicts[3] == "inconclusive"
  assert "not tested against a policy that RL changed" in reason
  # A pass@1 change whose interval lies beyond 0.03 counts as movement on its own.
  learned, _ = _f4(_f4_arms(e2e_slope=0.0, ce_slope=0.0, entropy_slope=0.0, n=60,
                            pass_delta=0.08))
  assert learned[3] == "reproduced"
  # Too short a run: inconclusive whatever moved.
  short, reason = _f4(_f4_arms(e2e_slope=0.0, ce_slope=0.0, entropy_slope=0.01, n=20),
                      version=3)
  assert short[3] == "inconclusive" and "Fewer than 48" in reason


def _units(n=64, temps=(0.5, 0.7, 1.0, 1.3, 1.6), slope=-0.2, gap=-0.1, slope_sd=0.02,
           seed=0):
  """Re-scoring units: per sequence and temperature, entropy and per-depth acceptance sums
  over 10 positions each. Each sequence has its own slope (slope + N(0, slope_sd)) and
  offset, so the mean over sequences is exactly linear in entropy while the slope still
  varies from one sample of prompts to another."""
  rng = np.random.default_rng(seed)
  t = np.asarray(temps)
  ent = 0.5 + 0.8 * (t - t[0])                                            # [temps]
  scatter = rng.normal(0, slope_sd, n)
  own = slope + scatter - scatter.mean()                                  # [n], mean slope
  rej = 0.8 + own[None] * ent[:, None] + rng.normal(0, 0.02, n)[None]     # [temps, n]
  gr = rej + gap * ent[:, None]
  count = np.full(n, 10.0)
  per_depth = lambda a: np.repeat((a * 10.0)[:, :, None], 3, axis=2)      # [temps, n, K]
  return {"temperature": t, "entropy_sum": np.repeat(ent[:, None] * 10.0, n, 1),
          "entropy_count": count, "alpha_sum": {"rejection": per_depth(rej),
                                                "greedy_draft": per_depth(gr)},
          "alpha_count": np.repeat(count[:, None], 3, 1)}


def _rl_points(n, entropy_slope, acc_slope=-0.2, gap=-0.1, seed=0):
  rng = np.random.default_rng(seed)
  steps = np.arange(1, n + 1, dtype=float)
  ent = 0.8 + entropy_slope * steps + rng.normal(0, 0.05, n)
  shared = rng.normal(0, 0.004, n)
  rej = 0.9 + acc_slope * ent + shared
  gr = rej + gap * ent + rng.normal(0, 0.001, n)
  return {m: {"entropy": ent, "depth1": a, "mean": a, "step": steps}
          for m, a in (("rejection", rej), ("greedy_draft", gr))}


def test_f1_f2_v3_gate_on_the_fitted_entropy_change_and_bootstrap_prompts():
  units = _units()
  rescoring = acceptance_entropy.points_from_units(units, np.arange(64))
  # RL steps whose entropy moves +0.6 nats over 60 steps; both sets fall, the gap widens.
  moving = acceptance_entropy.fits({"rl_steps": _rl_points(60, 0.01), "rescoring": rescoring},
                                   units, draws=300)
  assert rules.entropy_moved(moving["rl_steps"]["entropy_drift"])
  boot = moving["rescoring"]["depth1"]["rejection"]["bootstrap"]
  assert boot["units"] == 64 and boot["slope_ci95"][1] < 0
  assert _decide(rules.F1, moving)[3] == "reproduced"
  assert _decide(rules.F2, moving)[4] == "reproduced"
  # A flat entropy whose batch noise spans well over 0.1 nats (max - min): versions 2 and 3
  # of F2 (F1's 2) pass it on the range; version 3 (F2's 4) sees no fitted change.
  flat = acceptance_entropy.fits({"rl_steps": _rl_points(60, 0.0), "rescoring": rescoring},
                                 units, draws=300)
  assert flat["rl_steps"]["depth1"]["rejection"]["x_range"] > 0.1
  assert not rules.entropy_moved(flat["rl_steps"]["entropy_drift"])
  f1, f2 = _decide(rules.F1, flat), _decide(rules.F2, flat)
  assert f1[2] == "reproduced" and f1[3] == "inconclusive"
  assert f2[3] == "reproduced" and f2[4] == "inconclusive"
  reason = rules.F1.evaluate({"fits": flat})["versions"][2]["reason"]
  assert "does not lie beyond +-0.1 nats" in reason
  # Prompts whose own slopes scatter widely around a small mean slope: the mean over
  # prompts is exactly linear in entropy, so the t interval over the five temperature points
  # (how far they sit from a line) is as narrow as rounding and lies below zero; resampling
  # the prompts moves the slope, and the bootstrap interval includes zero.
  few = _units(n=8, slope=-0.02, gap=-0.01, slope_sd=0.15, seed=3)
  noisy = acceptance_entropy.fits(
      {"rl_steps": _rl_points(60, 0.01),
       "rescoring": acceptance_entropy.points_from_units(few, np.arange(8))}, few, draws=300)
  r = noisy["rescoring"]["depth1"]["rejection"]
  assert r["slope_ci95"][1] < 0 < r["bootstrap"]["slope_ci95"][1]
  assert _decide(rules.F1, noisy)[3] == "inconclusive"


def test_f3_v3_needs_three_seeds_and_no_objective_above_e2e_tv():
  gains = {"ce": 0.0, "kl": 0.002, "tv": 0.008, "e2e_tv": 0.010, "lk": 0.004}
  three = _objective_rows([0.0, 0.03, -0.03], gains, jitter=0.0005)
  assert _f3(three) == {1: "inconclusive", 2: "reproduced", 3: "reproduced"}
  # The LK loss beats e2e-TV in every seed: version 3 says e2e-TV is below it.
  lk_best = _objective_rows([0.0, 0.03, -0.03], {**gains, "lk": 0.020}, jitter=0.0005)
  comp = objectives.comparison(lk_best, objectives.aggregate(lk_best))
  assert comp["losses"] == ["ce", "kl", "tv", "e2e_tv", "lk"]
  assert comp["e2e_vs"]["lk"]["ci95"][1] < 0
  ev = rules.F3.evaluate(comp)["versions"]
  assert ev[2]["verdict"] == "inconclusive" and "below lk" in ev[2]["reason"]
  # Two seeds: version 3 asks for three.
  two = _objective_rows([0.0, 0.03], gains, jitter=0.0005)
  assert _f3(two)[3] == "inconclusive"


# ----------------------------------------------------------------------------- speedup


def _speed(e2e, e2e_ci, headline_ci=(1.2, 1.4), placement=None):
  pair = lambda m, ci: {"measured": m, "ci95": list(ci), "steps": 16}
  return {"ratios": {"end_to_end": {"measured": e2e, "bound": 1.8}},
          "pairs": {"speculative_async_vs_autoregressive_async": pair(1.3, headline_ci),
                    "speculative_sync_vs_autoregressive_sync": pair(1.3, headline_ci),
                    "speculative_async_vs_autoregressive_sync": pair(e2e, e2e_ci)},
          "placement": placement or {"mode": "colocated", "devices": 1, "simulated": False,
                                     "cpu_cores": 2}}


def _speed_decide(result):
  ev = rules.SPEEDUP.evaluate(result)["versions"]
  return {v["version"]: v["verdict"] for v in ev}, ev[-1]["reason"]


def test_speedup_decides_on_intervals_and_placement():
  # A point estimate of 1.5x whose interval reaches 1.2x: version 1 reproduced, version 2 not
  # (the interval does not lie at or above 1.44x).
  assert _speed_decide(_speed(1.5, (1.2, 1.8)))[0] == {1: "reproduced", 2: "inconclusive"}
  assert _speed_decide(_speed(1.6, (1.5, 1.7)))[0] == {1: "reproduced", 2: "reproduced"}
  # Speculative no faster at equal scheduling: not every headline interval above 1.
  assert _speed_decide(_speed(1.6, (1.5, 1.7), headline_ci=(0.9, 1.3)))[0][2] == "inconclusive"
  assert _speed_decide(_speed(1.05, (1.0, 1.1)))[0] == {1: "not reproduced",
                                                       2: "not reproduced"}
  split = {"mode": "split", "devices": 2, "simulated": True, "cpu_cores": 2}
  verdicts, reason = _speed_decide(_speed(1.6, (1.5, 1.7), placement=split))
  assert verdicts[2] == "inconclusive" and "not a speed result" in reason
  no_pairs = {"ratios": {"end_to_end": {"measured": 1.6}}}
  assert _speed_decide(no_pairs)[0] == {1: "reproduced", 2: "inconclusive"}


# ----------------------------------------------------------------------------- the page


def _finding(name, result):
  verdict, reason, evaluation = rules.decide(name, result)
  title = {"acceptance_entropy": "F1: a", "greedy_vs_rejection": "F2: b", "objectives": "F3: c",
           "through_rl": "F4: d", "speedup": "Speedup: e"}[name]
  return common.Finding(name, title, "claim", verdict, reason, "body", {}, [{"x": 1}], [],
                        rule=evaluation)


def _page(tmp_path, findings):
  ctx = common.Context(str(tmp_path / "work"), "smoke")
  for f in findings:
    common.write_finding(f, ctx.out_dir)
  path = tmp_path / "page" / "results.md"
  path.parent.mkdir()
  return results.write_page(ctx, findings, str(path), "python experiments/reproduce.py", 1.0)


def test_the_page_shows_old_verdicts_and_a_computed_title(tmp_path):
  f12 = acceptance_entropy.fits(_points(0.5, noise=0.06, seed=3))  # F2 moved by v2
  arms = _f4_arms(e2e_slope=0.0, ce_slope=0.0, entropy_slope=0.0)  # the policy barely moved
  rows = _objective_rows([0.0, 0.03, -0.03],
                         {"ce": 0.0, "kl": 0.002, "tv": 0.008, "e2e_tv": 0.010}, jitter=0.0005)
  findings = [
      _finding("acceptance_entropy", {"fits": f12}),
      _finding("greedy_vs_rejection", {"fits": f12}),
      _finding("objectives", objectives.comparison(rows, objectives.aggregate(rows))),
      _finding("through_rl", through_rl.comparison(arms)),
      _finding("speedup", _speed(1.5, (1.2, 1.8))),
  ]
  verdicts = [f.verdict for f in findings]
  # F2: version 1 inconclusive, versions 2 and 3 reproduced, version 4 (points without
  # steps or a bootstrap over prompts) inconclusive.
  assert verdicts == ["inconclusive", "inconclusive", "reproduced", "inconclusive",
                      "inconclusive"]
  text = _page(tmp_path, findings)
  assert text.splitlines()[0] == ("# Results: the Bebop paper's findings at smoke scale: "
                                  "1 of 5 reproduced")
  assert "reproduced: 1 (F3); inconclusive: 4 (F1, F2, F4, Speedup)" in text
  # F2's section prints the rule in force and the older versions with their verdicts; the
  # change from versions 2 and 3 moved the verdict.
  section = text.split("## F2: b")[1].split("## F3")[0]
  assert f"*Rule F2, version 4:* {rules.F2.current.text}" in section
  assert f"| 1 | {rules.F2.versions[0].text}" in section
  assert "| **inconclusive** |" in section and "| **reproduced** |" in section
  assert "moved this verdict: version 2, 3" in section
  assert ("| F2 v4 | v1: inconclusive, v2: reproduced, v3: reproduced |"
          in text.split("## ")[0])
  # All reproduced: the title says so.
  for f in findings:
    f.verdict = "reproduced"
  text = _page(tmp_path / "again", findings)
  assert text.splitlines()[0].endswith("at smoke scale: all 5 reproduced")
  mixed = findings[:2] + [common.Finding("x", "X: y", "c", "not reproduced", "r", "", {}, [], [])]
  assert results.title(mixed, "laptop") == ("# Results: the Bebop paper's findings at laptop "
                                            "scale: 2 of 3 reproduced")
