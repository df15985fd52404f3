"""experiments/reproduce.py at the smoke scale: every finding, figure and results file, with
real numbers, from the command a user runs (one process, one CPU device)."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bebop_jax.findings import acceptance_entropy, common, results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINDING_KEYS = {"name", "title", "claim", "verdict", "reason", "markdown", "data", "rows",
                "figures", "seconds"}


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
  for name in results.PAGE_ORDER:
    f = _finding(workdir, name)
    assert f"## {f['title']}" in text
    assert f"**Verdict: {f['verdict']}.**" in text
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
      (loss, s) for loss in ("ce", "kl", "tv", "e2e_tv") for s in range(scale.seeds)}
  accs = [r["acceptance"] for r in runs if r["task"] == "all" and r["mode"] == "rejection"]
  assert np.all((np.asarray(accs) >= 0) & (np.asarray(accs) <= 1))
  assert np.std(accs) > 0
  # F1/F2: raising the temperature raises the policy's entropy; fits are finite.
  pts = _finding(workdir, acceptance_entropy.NAME_F1)["data"]["points"]
  for mode in common.MODES:
    ent = pts["rescoring"][mode]["entropy"]
    assert pts["rescoring"][mode]["temperature"] == list(scale.temperatures)
    assert all(b > a for a, b in zip(ent, ent[1:])), ent
    assert len(pts["rl_steps"][mode]["entropy"]) == scale.rl_steps
  fits = _finding(workdir, acceptance_entropy.NAME_F1)["data"]["fits"]
  assert np.isfinite(fits["rescoring"]["depth1"]["rejection"]["slope"])
  # F4: every arm ran every step; the online and periodic arms pay for their MTP updates.
  arms = _finding(workdir, "through_rl")["data"]["arms"]
  assert set(arms) == set(common.DRAFTER_ARMS)
  for a in arms.values():
    assert a["steps"] == list(range(1, scale.rl_steps + 1))
  total = {n: a["mtp_update_s_total"] for n, a in arms.items()}
  frozen = max(t for n, t in total.items() if n.startswith("frozen"))
  assert min(t for n, t in total.items() if not n.startswith("frozen")) > 2 * frozen, total
  # Speed: four arms with their own step times.
  speed = _finding(workdir, "speedup")["data"]
  assert len(speed["arms"]) == 4 and all(a["step_s"] > 0 for a in speed["arms"].values())
  assert len({a["step_s"] for a in speed["arms"].values()}) == 4


def test_a_rerun_reuses_every_stage(smoke):
  workdir, _, _ = smoke
  before = json.loads((workdir / "stage_seconds.json").read_text())
  ctx = common.Context(str(workdir), "smoke")
  assert ctx.drafter("e2e_tv", 1) == str(workdir / "objectives" / "e2e_tv" / "seed1")
  ctx.drafter_arm("frozen_ce")  # complete: nothing runs
  assert json.loads((workdir / "stage_seconds.json").read_text()) == before
  assert set(before) >= {"base", "speedup", *(f"through_rl/{a}" for a in common.DRAFTER_ARMS)}


def test_bad_scale_and_arm_are_refused(tmp_path):
  with pytest.raises(ValueError, match="scale='huge' is not allowed: one of"):
    common.Context(str(tmp_path), "huge")
  with pytest.raises(ValueError, match="arm='nope' is not allowed"):
    common.Context(str(tmp_path), "smoke").drafter_arm("nope")


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


def test_f2_verdict_is_paired_on_the_same_points():
  """Greedy acceptance falls twice as fast as rejection's, with batch noise shared by both
  modes: the paired gap finds it although each fit alone is noisy."""
  rng = np.random.default_rng(1)
  points = {}
  for source in acceptance_entropy.SOURCES:
    ent = np.linspace(0.2, 1.0, 12)
    shared = rng.normal(0, 0.05, 12)  # the same batches score both modes
    rej = 0.95 - 0.05 * ent + shared
    gr = 0.90 - 0.10 * ent + shared + rng.normal(0, 0.002, 12)
    points[source] = {m: {"entropy": ent, "depth1": a, "mean": a}
                      for m, a in (("rejection", rej), ("greedy_draft", gr))}
  fit = acceptance_entropy.fits(points)
  (_, _), (v2, reason) = acceptance_entropy.verdicts(fit)
  assert v2 == "reproduced", reason
  gap = fit["rescoring"]["depth1"]["difference"]
  assert gap["slope_ci95"][0] < -0.05 < gap["slope_ci95"][1]
  for source in points:  # swap the modes: the gap narrows, so not reproduced
    p = points[source]
    p["rejection"], p["greedy_draft"] = p["greedy_draft"], p["rejection"]
  (_, _), (v2, _) = acceptance_entropy.verdicts(acceptance_entropy.fits(points))
  assert v2 == "not reproduced"
