"""experiments/reproduce.py at the smoke scale: every finding, figure and results file, with
real numbers, from the command a user runs (one process, one CPU device)."""

import csv
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments.findings import acceptance_entropy, common, results, rules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINDING_KEYS = {"name", "title", "claim", "verdict", "reason", "markdown", "data", "rows",
                "figures", "seconds", "rule"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, one_device_env):
  workdir = tmp_path_factory.mktemp("reproduce")
  page = workdir / "docs" / "results.md"
  # One device, as on a laptop; the suite's fast-compile settings (conftest) kept.
  env = dict(one_device_env)
  proc = subprocess.run(
      [sys.executable, "experiments/reproduce.py", "--scale=smoke", f"--workdir={workdir}",
       f"--results={page}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  return workdir, page, proc.stdout


def _finding(workdir, name):
  with open(workdir / "findings" / f"{name}.json") as f:
    return json.load(f)


def test_every_finding_has_its_files_and_schema(smoke):
  workdir, page, _ = smoke
  for name in results.PAGE_ORDER:
    f = _finding(workdir, name)
    assert set(f) == FINDING_KEYS, name
    assert f["verdict"] in common.VERDICTS
    # The verdict is the rule in force's; every version was evaluated on these data.
    rule = rules.RULES[name]
    assert f["rule"]["current"] == rule.current.number
    assert [v["version"] for v in f["rule"]["versions"]] == [v.number for v in rule.versions]
    assert (f["verdict"], f["reason"]) == (f["rule"]["versions"][-1]["verdict"],
                                           f["rule"]["versions"][-1]["reason"])
    assert f["reason"] and f["claim"] and f["rows"] and f["figures"]
    with open(workdir / "findings" / f"{name}.csv") as fh:
      rows = list(csv.DictReader(fh))
    assert len(rows) == len(f["rows"]) > 0
    for fig in f["figures"]:
      for d in (workdir / "findings", page.parent / "results"):
        import matplotlib.image  # pylint: disable=g-import-not-at-top
        img = matplotlib.image.imread(d / fig)
        assert img.shape[0] > 200 and img.shape[1] > 200 and np.std(img) > 0, fig
    assert (page.parent / "results" / f"{name}.json").exists()


def test_the_page_has_every_section_with_its_verdict(smoke):
  workdir, page, stdout = smoke
  text = page.read_text()
  assert "python experiments/reproduce.py --scale=smoke" in text
  verdicts = [_finding(workdir, name)["verdict"] for name in results.PAGE_ORDER]
  reproduced = sum(v == "reproduced" for v in verdicts)
  count = (f"all {len(verdicts)}" if reproduced == len(verdicts) else
           f"{reproduced} of {len(verdicts)}")
  assert text.splitlines()[0] == (f"# Results: the Bebop paper's findings at smoke scale: "
                                  f"{count} reproduced")
  for name in results.PAGE_ORDER:
    f = _finding(workdir, name)
    assert f"## {f['title']}" in text
    assert f"**Verdict: {f['verdict']}.**" in text
    rule = rules.RULES[name]
    assert f"*Rule {rule.label}, version {rule.current.number}:* {rule.current.text}" in text
    for old in f["rule"]["versions"][:-1]:
      assert f"| {old['version']} | {old['text']}" in text
    for fig in f["figures"]:
      assert f"(results/{fig})" in text
    assert f"[{f['name']}] {f['verdict']}" in stdout


def test_numbers_are_measured_not_constant(smoke):
  workdir, _, _ = smoke
  scale = common.SCALES["smoke"]
  # F3: every (loss, seed) trained and evaluated; the objectives do not all tie.
  obj = _finding(workdir, "objectives")["data"]
  runs = obj["runs"]
  assert {(r["loss"], r["seed"]) for r in runs} == {
      (loss, s) for loss in ("ce", "kl", "tv", "e2e_tv", "lk") for s in range(scale.seeds)}
  assert scale.objectives == ("ce", "kl", "tv", "e2e_tv", "lk")
  accs = [r["acceptance"] for r in runs if r["task"] == "all" and r["mode"] == "rejection"]
  assert np.all((np.asarray(accs) >= 0) & (np.asarray(accs) <= 1))
  assert np.std(accs) > 0
  comp = obj["comparison"]
  assert comp["seeds"] == scale.seeds
  # The from-scratch drafters: their own runs, compared paired by seed as well.
  assert obj["scratch"]["seeds"] == scale.seeds
  assert obj["scratch"]["acceptance_mean"] != comp["acceptance_mean"]
  assert "From scratch" in _finding(workdir, "objectives")["markdown"]
  for loss in ("kl", "tv", "e2e_tv", "lk"):
    assert comp["paired"][loss]["df"] == scale.seeds - 1
  assert set(comp["e2e_vs"]) == {"ce", "kl", "tv", "lk"}
  # F1/F2: raising the temperature raises the policy's entropy; the RL-step points are the
  # entropy RL run's, fitted as a series; every fit reports the entropy range it covers.
  f1 = _finding(workdir, acceptance_entropy.NAME_F1)["data"]
  pts = f1["points"]
  for mode in common.MODES:
    ent = pts["rescoring"][mode]["entropy"]
    assert pts["rescoring"][mode]["temperature"] == list(scale.temperatures)
    assert all(b > a for a, b in zip(ent, ent[1:])), ent
    assert pts["rl_steps"][mode]["step"] == list(range(1, scale.rl_steps + 1))
  fits = f1["fits"]
  assert np.isfinite(fits["rescoring"]["depth1"]["rejection"]["slope"])
  for source in acceptance_entropy.SOURCES:
    ent = pts[source]["rejection"]["entropy"]
    assert f1["entropy_ranges"][source]["x_range"] == pytest.approx(max(ent) - min(ent))
    assert fits[source]["depth1"]["rejection"]["x_range"] == pytest.approx(max(ent) - min(ent))
  series = fits["rl_steps"]["depth1"]["rejection"]
  assert series["ordered"] and series["corrected"] and "residual_lag1_autocorrelation" in series
  assert not fits["rescoring"]["depth1"]["rejection"]["ordered"]
  # The re-scoring slopes' bootstrap over the held-out sequences, and the RL run's fitted
  # entropy change, which F1 version 3 decides on.
  boot = fits["rescoring"]["depth1"]["rejection"]["bootstrap"]
  assert boot["units"] >= 2 and boot["draws"] > 0
  assert boot["slope_ci95"][0] <= boot["slope_ci95"][1]
  assert fits["rescoring"]["depth1"]["difference"]["bootstrap"]["units"] == boot["units"]
  drift = fits["rl_steps"]["entropy_drift"]
  assert drift["span"] == scale.rl_steps - 1 and len(drift["change_ci95"]) == 2
  # F4: every arm ran every step; the online and periodic arms pay for their MTP updates.
  arms = _finding(workdir, "through_rl")["data"]["arms"]
  assert set(arms) == set(scale.drafter_arms)
  for a in arms.values():
    assert a["steps"] == list(range(1, scale.rl_steps + 1))
  f4 = _finding(workdir, "through_rl")["data"]
  assert f4["control"]["arm"] == "frozen_ce"
  assert f4["control"]["steps"] == list(range(1, scale.rl_steps + 1))
  assert {"entropy_change", "pass_at_1_change"} <= set(f4["policy"])
  total = {n: a["mtp_update_s_total"] for n, a in arms.items()}
  frozen = max(t for n, t in total.items() if n.startswith("frozen"))
  assert min(t for n, t in total.items() if not n.startswith("frozen")) > 2 * frozen, total
  # Speed: four arms with their own step times.
  speed = _finding(workdir, "speedup")["data"]
  assert len(speed["arms"]) == 4 and all(a["step_s"] > 0 for a in speed["arms"].values())
  assert len({a["step_s"] for a in speed["arms"].values()}) == 4
  assert speed["placement"]["mode"] in ("colocated", "split")


def test_a_rerun_reuses_every_stage(smoke):
  workdir, _, _ = smoke
  before = json.loads((workdir / "stage_seconds.json").read_text())
  ctx = common.Context(str(workdir), "smoke")
  assert ctx.drafter("e2e_tv", 1) == str(workdir / "objectives" / "e2e_tv" / "seed1")
  ctx.drafter_arm("frozen_ce")  # complete: nothing runs
  assert json.loads((workdir / "stage_seconds.json").read_text()) == before
  assert set(before) >= {"base", "warm", "speedup", "objectives_scratch/ce/seed0",
                         *(f"through_rl/{a}" for a in common.SCALES["smoke"].drafter_arms)}


def test_warm_objectives_start_from_the_shared_warm_drafter(smoke):
  """F3's warm runs start from warm/'s drafter (mtp.drafter_from): its MTP modules over the
  SFT policy's trunk; scratch runs from a fresh one; a missing warm stage is an error."""
  from bebop_jax.stages import lineage  # pylint: disable=g-import-not-at-top
  from bebop_jax.stages import mtp as mtp_stage  # pylint: disable=g-import-not-at-top
  workdir, _, _ = smoke
  ctx = common.Context(str(workdir), "smoke")
  warm = str(workdir / "warm")
  for loss in ctx.scale.objectives:
    for start, top, source in (("warm", "objectives", warm), ("scratch", "objectives_scratch", "")):
      summary = lineage.read_summary(str(workdir / top / loss / "seed0"), "mtp")
      assert summary["drafter_from"] == source and summary["schedule"] == [[loss, 1]], (loss, start)
  config = ctx.drafter_config("ce", 0)
  _, sft = lineage.restore_policy(config, str(workdir / "base"), stage="sft")
  _, trained = lineage.restore_policy(config, warm, stage="mtp")
  merged = mtp_stage._drafter_from(config, warm, sft)  # pylint: disable=protected-access
  flat = lambda s: {tuple(p): np.asarray(v[...]) for p, v in s.flat_state()}
  merged, sft, trained = flat(merged), flat(sft), flat(trained)
  assert merged.keys() == sft.keys()
  moved = 0
  for path, value in merged.items():
    want = trained[path] if "mtp" in path else sft[path]
    np.testing.assert_array_equal(value, want, err_msg=str(path))
    moved += "mtp" in path and not np.array_equal(trained[path], sft[path])
  assert moved  # the warm stage trained the MTP modules away from the SFT policy's
  with pytest.raises(FileNotFoundError, match="mtp.drafter_from=.*holds no completed MTP"):
    mtp_stage._drafter_from(config, str(workdir / "nowhere"), sft)  # pylint: disable=protected-access


def test_an_interrupted_stage_counts_its_attempts_to_their_last_logged_step(tmp_path):
  """A stage resumed after an interruption: its seconds are the completing attempt's plus
  each earlier attempt's, from its start to its last metrics.jsonl entry before the next."""
  ctx = common.Context(str(tmp_path), "smoke")
  stage = tmp_path / "base"
  stage.mkdir()
  times = [100.0, 130.0, 160.0, 400.0, 450.0]  # attempt 1 logs to 160, attempt 2 from 400
  stage.joinpath("metrics.jsonl").write_text(
      "".join(json.dumps({"stage": "sft", "step": i, "time": t}) + "\n"
              for i, t in enumerate(times)))
  (tmp_path / "stage_attempts.json").write_text(json.dumps({"base": [90.0, 390.0]}))
  ctx.record("base", 75.0)
  assert ctx.seconds() == {"base": 75.0 + (160.0 - 90.0)}
  assert ctx.resumed() == {"base": 2}
  assert common.interrupted_seconds(str(stage), [90.0]) == 0.0  # one attempt: none cut short


def test_learning_curves_average_the_held_out_evals_over_seeds(tmp_path):
  """F3's learning curves: per objective and eval step, the mean over depths of each run's
  eval/alpha_k, then mean and standard error over seeds; step 0 the warm start's end when
  the runs did not evaluate there; steps not every seed evaluated are left out."""
  from experiments.findings import objectives  # pylint: disable=g-import-not-at-top
  ctx = common.Context(str(tmp_path), "smoke")
  write = lambda path, rows: (path.mkdir(parents=True, exist_ok=True), path.joinpath(
      "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)))
  ev = lambda step, *alphas: {"stage": "mtp", "step": step, "time": 0.0, **{
      f"eval/alpha_{k}": a for k, a in enumerate(alphas, 1)}, "eval/draft_events_1": 9.0}
  write(tmp_path / "warm", [ev(1, 0.5, 0.3)])
  for loss in ctx.scale.objectives:
    for seed in range(2):
      rows = [ev(1, 0.6 + 0.1 * seed, 0.4), {"stage": "mtp", "step": 1, "time": 0.0,
                                             "loss": 1.0}]
      if seed == 0:
        rows.append(ev(2, 0.9, 0.9))  # only seed 0 evaluated step 2
      write(tmp_path / "objectives" / loss / f"seed{seed}", rows)
  curves = objectives.learning_curves(ctx)
  assert set(curves) == set(ctx.scale.objectives)
  c = curves["e2e_tv"]
  assert c["steps"] == [0, 1] and c["seeds"] == 2
  np.testing.assert_allclose(c["mean"], [0.4, np.mean([0.5, 0.55])])
  np.testing.assert_allclose(c["se"], [0.0, np.std([0.5, 0.55], ddof=1) / np.sqrt(2)])
  assert "| e2e_tv | 0.400±0.000 | 0.525±0.025 |" in objectives.curves_table(curves)


def test_bad_scale_and_arm_are_refused(tmp_path):
  with pytest.raises(ValueError, match="scale='huge' is not allowed: one of"):
    common.Context(str(tmp_path), "huge")
  with pytest.raises(ValueError, match="arm='nope' is not allowed"):
    common.Context(str(tmp_path), "smoke").drafter_arm("nope")
  smoke = common.SCALES["smoke"]
  for arms in (("frozen_e2e_tv", "online_e2e_tv"), ("frozen_ce", "frozen_e2e_tv", "nope")):
    with pytest.raises(ValueError, match="with frozen_e2e_tv and frozen_ce among them"):
      dataclasses.replace(smoke, drafter_arms=arms)


def test_drafter_arms_take_the_scale_settings(tmp_path):
  """The laptop scale's F4 arms (the frozen e2e_tv one gives F1/F2's RL-step points): their
  steps, learning rate and clip from the scale, from the seed-0 drafter of their loss (the
  config only; nothing runs); F3 trains warm and scratch drafters over 3 seeds."""
  ctx = common.Context(str(tmp_path), "laptop")
  ctx.drafter = lambda loss, seed, start="warm": str(tmp_path / "objectives" / loss /
                                                     f"seed{seed}")
  c = ctx.drafter_arm_config("frozen_e2e_tv")
  s = common.SCALES["laptop"]
  assert c.rl.init_from == str(tmp_path / "objectives" / "e2e_tv" / "seed0")
  assert c.rl.train.num_steps == s.rl_steps
  assert c.rl.optim.learning_rate == s.rl_learning_rate != ctx.config().rl.optim.learning_rate
  assert c.rl.clip_high == s.rl_clip_high
  assert c.rl.mtp.strategy == "frozen"
  assert s.seeds >= 3 and s.objective_starts == ("warm", "scratch")
  assert ctx.drafter_config("ce", 1, "scratch").mtp.init == "fresh"
  assert ctx.drafter_config("ce", 1).mtp.init == "sft"
  # Every step of an objective's budget trains with that objective (no warm-start phase).
  real = common.Context(str(tmp_path), "real")
  c = real.drafter_config("tv", 2)
  assert c.mtp.warm_start.steps == 0 and c.mtp.loss == "tv"
  assert c.mtp.drafter_from == str(tmp_path / "warm")
  real.drafter = lambda loss, seed, start="warm": str(tmp_path / "objectives" / loss /
                                                      f"seed{seed}")
  r = real.drafter_arm_config("frozen_ce")
  s = common.SCALES["real"]
  assert r.rl.prompts_per_batch == s.rl_prompts_per_batch and r.rl.train.num_steps >= 48
  assert r.rl.entropy_coef == (s.rl_entropy_coef or 0.0)
  w = real.warm_config()
  assert (w.mtp.loss, w.mtp.train.num_steps) == ("kl", common.SCALES["real"].warm_steps)


def test_fit_line_against_numpy():
  rng = np.random.default_rng(0)
  x = rng.uniform(0, 2, 40)
  y = 0.9 - 0.2 * x + rng.normal(0, 0.02, 40)
  f = common.fit_line(x, y)
  slope, intercept = np.polyfit(x, y, 1)
  assert f["slope"] == pytest.approx(slope) and f["intercept"] == pytest.approx(intercept)
  # The interval covers the true slope and is slope +- t * se.
  assert f["slope_ci95"][0] < -0.2 < f["slope_ci95"][1]
  assert f["slope_ci95"][1] - f["slope"] == pytest.approx(2.0244 * f["slope_se"], rel=1e-3)
  r = acceptance_entropy.slope_ratio({"slope": -0.4, "slope_se": 0.04},
                                     {"slope": -0.2, "slope_se": 0.02})
  assert r["ratio"] == pytest.approx(2.0)
  assert r["ratio_se"] == pytest.approx(2.0 * np.hypot(0.1, 0.1))
