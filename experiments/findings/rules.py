"""Every finding's verdict rule, in one place, with its versions.

A rule is a list of versions. Each version has a number, the text the results page prints,
a history note (when it was written, relative to the data it was first applied to) and the
function that decides: from the finding's measured result (a dict the finding module
builds, also written to its json) to (verdict, reason), the verdict one of
VERDICTS. The last version decides the finding's verdict; every older version is
evaluated on the same result too and printed beside it, so a reader sees whether a change
of rule moved the verdict.

Changing what a rule decides means adding a version (the next number) and keeping the old
ones unchanged; tests/test_rules.py pins the text of every version, so an edit in place
fails.

Results the versions read (built by the finding modules):
  F1, F2    {"fits": acceptance_entropy.fits(points)}: per point set ("rl_steps", "rescoring")
            and acceptance ("depth1", "mean"): per mode a line fit (stats.fit_line, or
            stats.fit_series for points in RL-step order), "difference" (the fit of
            greedy_draft - rejection on the same points) and "ratio" (greedy / rejection
            slope with a delta-method standard error)
  F3        objectives.comparison(...): "seeds", "gains_over_ce" (means and standard errors
            of independent seeds), "paired" (per-seed differences against ce, t intervals),
            "best", "e2e_vs_best"
  F4        through_rl.comparison(...): "trends" per arm (change over the run), "held_out_change",
            "control" (difference of differences against frozen_ce), "policy" (how far the
            policy moved), "margin", "steps"
  speedup   bench_rl.run_arms's result: "ratios" (point estimates), "pairs" (paired-by-step
            ratios with 95% intervals), "placement"
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import subprocess
from typing import Any, Callable

Decision = tuple[str, str]
SOURCES = ("rl_steps", "rescoring")
MODES = ("rejection", "greedy_draft")  # the verification modes every finding compares
VERDICTS = ("reproduced", "not reproduced", "inconclusive")

MIN_ENTROPY_RANGE = 0.1     # nats a point set's entropy must span for its fit to count (F1, F2)
MARGIN = 0.02               # acceptance a kept drafter may lose over the run (F4)
MOVED_ENTROPY = 0.05        # nats of fitted batch-entropy change that count as a moving policy
MOVED_PASS_AT_1 = 0.03      # held-out mean pass@1 change that counts as a moving policy
ENTROPY_DRIFT = 0.1         # nats the fitted entropy change's interval must lie beyond (v3+)
MIN_SEEDS = 3               # seeds F3 version 3 needs
MIN_RL_STEPS = 48           # RL steps F4 version 3 needs
PAPER_SPEEDUP = 1.8
SPEEDUP_REPRODUCED = 0.8 * PAPER_SPEEDUP
SPEEDUP_NOT_REPRODUCED = 1.1
PAIRS_HEADLINE = ("speculative_async_vs_autoregressive_async",
                  "speculative_sync_vs_autoregressive_sync")
PAIR_END_TO_END = "speculative_async_vs_autoregressive_sync"


@dataclasses.dataclass(frozen=True)
class Version:
  """One version of a rule: `decide(result) -> (verdict, reason)` does what `text` says."""
  number: int
  text: str
  history: str
  decide: Callable[[dict[str, Any]], Decision]


@dataclasses.dataclass(frozen=True)
class Rule:
  """A finding's rule: its versions, oldest first; the last one is in force."""
  finding: str
  label: str
  versions: tuple[Version, ...]

  @property
  def current(self) -> Version:
    return self.versions[-1]

  def evaluate(self, result: dict[str, Any]) -> dict[str, Any]:
    """Every version's decision on `result`: {"label", "current", "versions": [{"version",
    "text", "history", "verdict", "reason", "commit"}, oldest first]}; "commit" is the git
    commit that added the version's decision function (version_commit; None outside a git
    checkout or before the version is committed)."""
    out = []
    for v in self.versions:
      verdict, reason = v.decide(result)
      if verdict not in VERDICTS:
        raise ValueError(f"rule {self.label} v{v.number} gave verdict={verdict!r}: not one of "
                         f"{VERDICTS}")
      out.append({"version": v.number, "text": v.text, "history": v.history,
                  "verdict": verdict, "reason": reason,
                  "commit": version_commit(v.decide.__name__)})
    return {"label": self.label, "current": self.current.number, "versions": out}


RULES_FILE = "experiments/findings/rules.py"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(*args: str, repo: str = REPO) -> str | None:
  try:
    out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True,
                         timeout=30, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip()


@functools.lru_cache(maxsize=None)
def version_commit(function: str, repo: str = REPO) -> str | None:
  """The first commit whose rules.py defines `function` (a version's decision function,
  e.g. "f1_v3"): when that version was committed. None outside a git checkout, with a
  shallow history, or before it is committed."""
  log = _git("log", "--reverse", "--format=%H", "-S", f"def {function}(", "--", RULES_FILE,
             repo=repo)
  return log.splitlines()[0] if log else None


def artifact_after_rule(rule_commit: str | None, artifact: str, repo: str = REPO) -> bool:
  """Whether the commit that last changed `artifact` (a path in the repository; its content
  as committed) is a strict descendant of `rule_commit`: the data a rule judges was
  committed after the rule. False when either is not committed."""
  last = _git("log", "-1", "--format=%H", "--", artifact, repo=repo)
  if not rule_commit or not last or last == rule_commit:
    return False
  return _git("merge-base", "--is-ancestor", rule_commit, last, repo=repo) is not None


def _finite(*xs: float) -> bool:
  return all(x is not None and math.isfinite(x) for x in xs)


def _ci(x: tuple[float, float] | list[float]) -> str:
  return f"[{x[0]:+.3f}, {x[1]:+.3f}]"


# ---------------------------------------------------------------------------- F1 and F2


def _ols_ci(fit: dict[str, Any]) -> list[float]:
  """The uncorrected (independent points) interval of a fit."""
  return fit.get("ols_slope_ci95", fit["slope_ci95"])


def _slope_state(fit: dict[str, Any], ci: list[float], *, guarded: bool) -> str:
  """"falls" (interval below 0), "rises" (above 0), "unclear"; with `guarded`, "narrow" when
  the points span less than MIN_ENTROPY_RANGE of entropy and "uncorrected" when they are a
  series without an autocorrelation correction."""
  if guarded:
    if not _finite(fit.get("x_range", float("nan"))) or fit["x_range"] < MIN_ENTROPY_RANGE:
      return "narrow"
    if fit.get("ordered") and not fit.get("corrected"):
      return "uncorrected"
  lo, hi = ci
  if not _finite(lo, hi):
    return "unclear"
  return "falls" if hi < 0 else "rises" if lo > 0 else "unclear"


def _describe_fit(name: str, fit: dict[str, Any], ci: list[float], state: str) -> str:
  extra = ""
  if "x_range" in fit and _finite(fit["x_range"]):
    extra = f", entropy {fit['x_min']:.3f}-{fit['x_max']:.3f} ({fit['x_range']:.3f} nats)"
  return f"{name} {fit['slope']:+.3f} per nat {_ci(ci)}{extra}: {state}"


def _f1(result: dict[str, Any], *, guarded: bool) -> Decision:
  states, lines = [], []
  for source in SOURCES:
    f = result["fits"][source]["depth1"]
    for mode in MODES:
      ci = f[mode]["slope_ci95"] if guarded else _ols_ci(f[mode])
      state = _slope_state(f[mode], ci, guarded=guarded)
      states.append(state)
      lines.append(_describe_fit(f"{source} {mode}", f[mode], ci, state))
  text = "Depth-1 slopes: " + "; ".join(lines) + "."
  if all(s == "falls" for s in states):
    return "reproduced", "Acceptance falls with entropy in both modes and both point sets. " + text
  if "rises" in states and "falls" not in states:
    return "not reproduced", "Acceptance rises with entropy. " + text
  if guarded and any(s in ("narrow", "uncorrected") for s in states):
    return "inconclusive", ("At least one point set cannot decide (entropy spans less than "
                            f"{MIN_ENTROPY_RANGE} nats, or a series without an "
                            "autocorrelation correction). " + text)
  return "inconclusive", "Not every slope's interval lies below zero. " + text


def f1_v1(result: dict[str, Any]) -> Decision:
  return _f1(result, guarded=False)


def f1_v2(result: dict[str, Any]) -> Decision:
  return _f1(result, guarded=True)


def f2_v1(result: dict[str, Any]) -> Decision:
  states, lines = [], []
  for source in SOURCES:
    r = result["fits"][source]["depth1"]["ratio"]
    ratio, se = r["ratio"], r["ratio_se"]
    if not _finite(ratio, se):
      states.append("unclear")
    else:
      states.append("steeper" if ratio - 2 * se > 1 else "not steeper" if ratio + 2 * se < 1
                    else "unclear")
    lines.append(f"{source} ratio {ratio:.2f} ± {se:.2f}: {states[-1]}")
  text = "Depth-1 slope ratio greedy_draft / rejection: " + "; ".join(lines) + "."
  if all(s == "steeper" for s in states):
    return "reproduced", "Greedy drafts fall more than two standard errors faster in both " \
                         "point sets. " + text
  if all(s == "not steeper" for s in states):
    return "not reproduced", "Greedy drafts fall less steeply in both point sets. " + text
  return "inconclusive", "The slope ratio is not beyond two standard errors of 1 in every " \
                         "point set. " + text


def _gap_decided(states: list[str], text: str) -> Decision | None:
  """F2's verdict when every point set's gap slope agrees ("widens" / "narrows"), else None."""
  if all(s == "widens" for s in states):
    return "reproduced", ("The gap between greedy drafts and rejection sampling widens with "
                          "entropy (95% interval of its slope below zero) in both point sets. "
                          + text)
  if all(s == "narrows" for s in states):
    return "not reproduced", "Greedy drafts fall less steeply in both point sets. " + text
  return None


def _f2_gap(result: dict[str, Any], *, guarded: bool) -> Decision:
  states, lines = [], []
  for source in SOURCES:
    gap = result["fits"][source]["depth1"]["difference"]
    ci = gap["slope_ci95"] if guarded else _ols_ci(gap)
    state = _slope_state(gap, ci, guarded=guarded)
    states.append({"falls": "widens", "rises": "narrows"}.get(state, state))
    lines.append(_describe_fit(f"{source}", gap, ci, states[-1]))
  text = "Slope of the depth-1 gap greedy_draft - rejection: " + "; ".join(lines) + "."
  decided = _gap_decided(states, text)
  if decided:
    return decided
  if guarded and any(s in ("narrow", "uncorrected") for s in states):
    return "inconclusive", ("At least one point set cannot decide (entropy spans less than "
                            f"{MIN_ENTROPY_RANGE} nats, or a series without an "
                            "autocorrelation correction). " + text)
  return "inconclusive", ("The gap's slope is not below zero beyond its 95% interval in every "
                          "point set. " + text)


def f2_v2(result: dict[str, Any]) -> Decision:
  return _f2_gap(result, guarded=False)


def f2_v3(result: dict[str, Any]) -> Decision:
  return _f2_gap(result, guarded=True)


def entropy_moved(change: dict[str, Any] | None, beyond: float = ENTROPY_DRIFT) -> bool:
  """Whether a fitted entropy change's 95% interval lies entirely beyond +-`beyond` nats."""
  if not change or not _finite(*change["change_ci95"]):
    return False
  lo, hi = change["change_ci95"]
  return lo > beyond or hi < -beyond


def _drift_text(change: dict[str, Any] | None) -> str:
  if not change:
    return "no fitted entropy change (no steps)"
  return (f"fitted entropy change over the run {change['change']:+.3f} nats "
          f"{_ci(change['change_ci95'])}")


def _v3_states(result: dict[str, Any], pick, names: dict[str, str]) -> tuple[list, list, list]:
  """Per point set and mode (or the gap): the slope state under version 3 of F1 (F2's
  version 4), with the reasons a set cannot decide. `pick(fits_of_metric)` gives the fits
  [(label, fit)] to judge; `names` maps "falls"/"rises" to the words of the finding."""
  states, lines, blocked = [], [], []
  drift = result["fits"]["rl_steps"].get("entropy_drift")
  for source in SOURCES:
    for label, fit in pick(result["fits"][source]["depth1"]):
      if source == "rl_steps":
        ci = fit["slope_ci95"]
        if not entropy_moved(drift):
          state = "policy entropy did not move"
          blocked.append(f"the RL-step points' {_drift_text(drift)} does not lie beyond "
                         f"+-{ENTROPY_DRIFT} nats")
        elif not fit.get("corrected"):
          state = "uncorrected"
          blocked.append("the RL-step series was fitted without an autocorrelation correction")
        else:
          state = _slope_state(fit, ci, guarded=False)
        kind = "HAC/AR(1)"
      else:
        b = fit.get("bootstrap")
        ci = b["slope_ci95"] if b else [math.nan, math.nan]
        state = _slope_state(fit, ci, guarded=False) if b else "no bootstrap"
        if not b:
          blocked.append("the re-scoring points have no bootstrap over prompts")
        kind = f"bootstrap over {b['units']} sequences" if b else "none"
      state = names.get(state, state)
      states.append(state)
      lines.append(f"{source} {label} {fit['slope']:+.3f} per nat {_ci(ci)} ({kind}): {state}")
  return states, lines, sorted(set(blocked))


def f1_v3(result: dict[str, Any]) -> Decision:
  states, lines, blocked = _v3_states(
      result, lambda f: [(mode, f[mode]) for mode in MODES], {})
  text = ("Depth-1 slopes: " + "; ".join(lines) + ". RL-step points: " +
          _drift_text(result["fits"]["rl_steps"].get("entropy_drift")) + ".")
  if all(s == "falls" for s in states):
    return "reproduced", "Acceptance falls with entropy in both modes and both point sets. " + text
  if "rises" in states and "falls" not in states:
    return "not reproduced", "Acceptance rises with entropy. " + text
  if blocked:
    return "inconclusive", "A point set cannot decide: " + "; ".join(blocked) + ". " + text
  return "inconclusive", "Not every slope's interval lies below zero. " + text


def f2_v4(result: dict[str, Any]) -> Decision:
  states, lines, blocked = _v3_states(
      result, lambda f: [("gap greedy_draft - rejection", f["difference"])],
      {"falls": "widens", "rises": "narrows"})
  text = ("Slope of the depth-1 gap: " + "; ".join(lines) + ". RL-step points: " +
          _drift_text(result["fits"]["rl_steps"].get("entropy_drift")) + ".")
  decided = _gap_decided(states, text)
  if decided:
    return decided
  if blocked:
    return "inconclusive", "A point set cannot decide: " + "; ".join(blocked) + ". " + text
  return "inconclusive", ("The gap's slope is not below zero beyond its 95% interval in every "
                          "point set. " + text)


_V3_POINTS = (
    "RL-step points (one per step of F4's frozen e2e-TV arm) decide only when the 95% "
    "interval of the fitted change of their batch entropy over the run (a line over the "
    "steps, its interval corrected for autocorrelation: the wider of Newey-West and AR(1)) "
    f"lies entirely beyond +-{ENTROPY_DRIFT} nats; their slope's interval gets the same "
    "correction. Re-scoring points (one per temperature) get the slope's 95% percentile "
    "bootstrap interval over the held-out sequences (2000 resamples; every temperature's "
    "point recomputed from each resample, so the interval includes the prompts' sampling "
    "error).")
_V3_HISTORY = (
    "Written and committed before any data of the runs it decides existed (the entropy gate "
    "on a fitted change with its interval instead of the max - min range, which holds the "
    "batch-to-batch task-mix spread; re-scoring intervals that include sampling error). "
    "Older versions are shown on the same data.")

_SERIES_NOTE = (
    "Points ordered in RL steps are a series whose noise is autocorrelated: their slope's "
    "interval is the wider of the Newey-West (HAC, Bartlett kernel, floor(4 (n/100)^(2/9)) "
    "lags, t at n - 2 df) and the AR(1) effective-sample-size interval (t at n_eff - 2 df). "
    f"A point set whose entropy spans less than {MIN_ENTROPY_RANGE} nats (max - min), or a "
    "series fitted without that correction, cannot decide: its slope counts as unclear.")

F1 = Rule("acceptance_entropy", "F1", (
    Version(1, (
        "Per point set (RL steps, re-scoring temperatures) and mode (rejection, "
        "greedy_draft), a least-squares line of depth-1 acceptance against mean entropy with "
        "the slope's 95% Student-t interval (n - 2 df, points taken as independent). "
        "Reproduced when every interval lies below zero; not reproduced when one lies above "
        "zero and none below; otherwise inconclusive."),
        "Written with the finding's first code, before any results.", f1_v1),
    Version(2, (
        "As version 1, with the interval of each slope as follows. " + _SERIES_NOTE +
        " Reproduced when every depth-1 slope's interval lies below zero; not reproduced when "
        "one lies above zero and none below; otherwise inconclusive."),
        "Written after version 1's verdicts on an earlier page had been seen (24 RL steps "
        "spanning 0.27-0.35 nats, r2 0.17), to stop a fit over batch-to-batch noise of a "
        "barely moving entropy, with autocorrelated points, from deciding; applied to data "
        "measured afterwards (F4's frozen e2e-TV arm at settings that move the policy).", f1_v2),
    Version(3, (
        "Per point set and mode (rejection, greedy_draft), a least-squares line of depth-1 "
        "acceptance against mean entropy. " + _V3_POINTS + " Reproduced when every slope's "
        "interval lies below zero; not reproduced when one lies above zero and none below; "
        "otherwise inconclusive."), _V3_HISTORY, f1_v3),
))

F2 = Rule("greedy_vs_rejection", "F2", (
    Version(1, (
        "The ratio of the depth-1 slopes greedy_draft / rejection (F1's fits) with a "
        "delta-method standard error that treats the two fits as independent. Reproduced when "
        "the ratio is more than two standard errors above 1 in both point sets; not reproduced "
        "when it is more than two standard errors below 1 in both; otherwise inconclusive."),
        "Written with the finding's first code, before any results.", f2_v1),
    Version(2, (
        "Paired on the same points: the depth-1 gap greedy_draft - rejection is fitted against "
        "entropy, with the slope's 95% Student-t interval (n - 2 df). Reproduced when that "
        "interval lies below zero in both point sets (the gap widens as entropy rises); not "
        "reproduced when it lies above zero in both; otherwise inconclusive."),
        "Changed after the first laptop-scale results had been seen (commit 9541799): on those "
        "results version 1 said inconclusive (ratio 2.25 ± 0.76 on the RL steps) and version 2 "
        "reproduced. The reason given: both modes score the same batches, so their noise is "
        "shared, which the ratio's independent standard error ignores. Both verdicts are shown "
        "here.", f2_v2),
    Version(3, (
        "As version 2, with the interval of the gap's slope as follows. " + _SERIES_NOTE +
        " Reproduced when the gap's slope interval lies below zero in both point sets; not "
        "reproduced when it lies above zero in both; otherwise inconclusive."),
        "Written after version 2's verdicts on an earlier page had been seen, for the same "
        "reason as F1 version 2; applied to data measured afterwards.", f2_v3),
    Version(4, (
        "Paired on the same points: the depth-1 gap greedy_draft - rejection fitted against "
        "entropy. " + _V3_POINTS + " Reproduced when the gap's slope interval lies below "
        "zero in both point sets (the gap widens as entropy rises); not reproduced when it "
        "lies above zero in both; otherwise inconclusive."), _V3_HISTORY, f2_v4),
))


# ---------------------------------------------------------------------------- F3


def f3_v1(result: dict[str, Any]) -> Decision:
  gains, seeds = result["gains_over_ce"], result["seeds"]
  e2e = gains["e2e_tv"]
  g, se = e2e["relative_gain"], e2e["relative_gain_se"]
  best = max(gains, key=lambda k: gains[k]["acceptance_mean"])
  text = (f"e2e-TV against CE: {g:+.1%} ± {se:.1%} (standard error, seeds taken as "
          f"independent) mean acceptance over depths, rejection, {seeds} seeds; best objective "
          f"here: {best}.")
  if seeds < 2 or not _finite(se) or se == 0:
    return "inconclusive", text + " One seed: no error bar."
  if g > 2 * se and gains["tv"]["relative_gain"] > 2 * gains["tv"]["relative_gain_se"]:
    if gains[best]["acceptance_mean"] - e2e["acceptance_mean"] <= 2 * math.hypot(
        gains[best]["acceptance_mean_se"], e2e["acceptance_mean_se"]):
      return "reproduced", text + " Both TV objectives beat CE beyond two standard errors."
    return "inconclusive", text + (" Both TV objectives beat CE, but e2e-TV is not the best "
                                   "within two standard errors.")
  if g < -2 * se:
    return "not reproduced", text + " e2e-TV is worse than CE beyond two standard errors."
  return "inconclusive", text + " The difference is within two standard errors."


def f3_v2(result: dict[str, Any]) -> Decision:
  seeds, paired = result["seeds"], result["paired"]
  e2e, tv, vs_best = paired["e2e_tv"], paired["tv"], result["e2e_vs_best"]
  best = result["best"]
  text = (f"Paired by seed (same data order and starting drafter), rejection, mean acceptance "
          f"over depths, relative to CE: e2e-TV {e2e['mean']:+.2%} (95% t interval, "
          f"{e2e['df']} df: {e2e['ci95'][0]:+.2%} to {e2e['ci95'][1]:+.2%}), per-step TV "
          f"{tv['mean']:+.2%} ({tv['ci95'][0]:+.2%} to {tv['ci95'][1]:+.2%}); {seeds} seeds; "
          f"best objective here: {best}")
  if best != "e2e_tv":
    text += (f" (e2e-TV - {best}: {vs_best['mean']:+.4f}, {vs_best['ci95'][0]:+.4f} to "
             f"{vs_best['ci95'][1]:+.4f})")
  text += "; the paper: about +10%."
  if seeds < 2 or not _finite(*e2e["ci95"], *tv["ci95"]):
    return "inconclusive", text + " Fewer than two seeds: no interval."
  if e2e["ci95"][1] < 0:
    return "not reproduced", text + " e2e-TV is worse than CE (interval below zero)."
  if e2e["ci95"][0] > 0 and tv["ci95"][0] > 0:
    if best == "e2e_tv" or vs_best["ci95"][1] >= 0:
      return "reproduced", text + (" Both TV objectives beat CE (intervals above zero) and "
                                   "e2e-TV is not below the best objective's interval.")
    return "inconclusive", text + (f" Both TV objectives beat CE, but e2e-TV is below {best} "
                                   "(interval of the difference below zero).")
  return "inconclusive", text + " Not both intervals against CE lie above zero."


def _pct_ci(x) -> str:
  return f"[{x[0]:+.2%}, {x[1]:+.2%}]"


def f3_v3(result: dict[str, Any]) -> Decision:
  seeds, paired = result["seeds"], result["paired"]
  e2e, tv = paired["e2e_tv"], paired["tv"]
  others = result.get("e2e_vs", {})
  pct = lambda x: f"{x['mean']:+.2%} {_pct_ci(x['ci95'])}"
  text = (f"Paired by seed, rejection, mean acceptance over depths, relative to CE: e2e-TV "
          f"{pct(e2e)}, per-step TV {pct(tv)}" +
          "".join(f", {loss} {pct(paired[loss])}" for loss in result.get("losses", [])
                  if loss not in ("ce", "tv", "e2e_tv")) +
          f" (95% t intervals, {e2e['df']} df); e2e-TV minus each other objective: " +
          ", ".join(f"{loss} {d['mean']:+.4f} {_ci(d['ci95'])}" for loss, d in others.items())
          + f"; {seeds} seeds; the paper: about +10% over CE.")
  if seeds < MIN_SEEDS or not _finite(*e2e["ci95"], *tv["ci95"]):
    return "inconclusive", text + f" Fewer than {MIN_SEEDS} seeds."
  if e2e["ci95"][1] < 0:
    return "not reproduced", text + " e2e-TV is worse than CE (interval below zero)."
  beaten_by = [loss for loss, d in others.items() if _finite(*d["ci95"]) and d["ci95"][1] < 0]
  if e2e["ci95"][0] > 0 and tv["ci95"][0] > 0:
    if not beaten_by:
      return "reproduced", text + (" Both TV objectives beat CE (intervals above zero) and no "
                                   "objective beats e2e-TV (no interval of e2e-TV minus it "
                                   "lies below zero).")
    return "inconclusive", text + (" Both TV objectives beat CE, but e2e-TV is below "
                                   + ", ".join(beaten_by) + " (interval below zero).")
  return "inconclusive", text + " Not both intervals against CE lie above zero."


F3 = Rule("objectives", "F3", (
    Version(1, (
        "Relative gain in mean acceptance over depths against CE (rejection, all tasks) with "
        "a standard error that treats the seeds of each objective as independent. Reproduced "
        "when e2e-TV and per-step TV both beat CE by more than two standard errors and e2e-TV "
        "is within two standard errors of the best objective; not reproduced when e2e-TV is "
        "worse than CE by more than two; otherwise inconclusive."),
        "Written with the finding's first code, before any results.", f3_v1),
    Version(2, (
        "Seed k gives every objective the same data order and starting drafter, so objectives "
        "are compared by per-seed differences: the relative gain of each loss over CE in mean "
        "acceptance over depths (rejection, all tasks), seed by seed, with a 95% Student-t "
        "interval at seeds - 1 degrees of freedom. Reproduced when the intervals of e2e-TV - CE "
        "and per-step TV - CE both lie above zero and e2e-TV is the best objective or the "
        "interval of its per-seed difference to the best does not lie below zero; not "
        "reproduced when e2e-TV - CE lies below zero; otherwise inconclusive."),
        "Written after version 1's verdicts on an earlier page had been seen (2 seeds, where "
        "two standard errors are far narrower than a t interval at 1 df); applied to data "
        "measured afterwards, with at least 3 seeds at the laptop scale.", f3_v2),
    Version(3, (
        f"As version 2 over every objective the scale trains (ce, kl, tv, e2e_tv and lk, the "
        f"LK losses' negative log-acceptance), at least {MIN_SEEDS} seeds, each seed the same "
        f"data order and starting drafter for every objective. Reproduced when the paired "
        f"intervals of e2e-TV - CE and per-step TV - CE both lie above zero and no objective "
        f"beats e2e-TV (for no other objective does the per-seed interval of e2e-TV minus it "
        f"lie below zero); not reproduced when e2e-TV - CE lies below zero; otherwise (fewer "
        f"seeds included) inconclusive."),
        "Written and committed before any data of the runs it decides existed: adds the LK "
        "loss, an objective that also targets acceptance directly, as a contender e2e-TV must "
        "not lose to, and a minimum of seeds.", f3_v3),
))


# ---------------------------------------------------------------------------- F4


def _policy_text(policy: dict[str, Any]) -> str:
  return (f"the policy's batch entropy changed by {policy['entropy_change']:+.3f} nats (line "
          f"over the steps) and its held-out mean pass@1 by {policy['pass_at_1_change']:+.3f}")


def f4_v1(result: dict[str, Any]) -> Decision:
  m = result["margin"]
  t = result["trends"]["frozen_e2e_tv"]
  held = result["held_out_change"]["frozen_e2e_tv"]
  lo, hi = t["ols_change_ci95"]
  text = (f"Frozen e2e-TV drafter, rejection, mean acceptance over depths: fitted change over "
          f"{result['steps']} RL steps {t['change']:+.3f} (95% t interval, steps taken as "
          f"independent, {lo:+.3f} to {hi:+.3f}); held-out change {held:+.3f}.")
  if not _finite(lo, hi):
    return "inconclusive", text + " Too few steps for an interval."
  if lo > -m and held > -m:
    return "reproduced", text + f" It loses less than {m:.2f} (the interval's lower end)."
  if hi < -m:
    return "not reproduced", text + f" It loses more than {m:.2f}."
  return "inconclusive", text + f" The interval straddles a loss of {m:.2f}."


def _f4_fields(result: dict[str, Any]):
  """(margin, the e2e-TV trend, the difference of differences, held-out change, policy)."""
  return (result["margin"], result["trends"]["frozen_e2e_tv"], result["control"],
          result["held_out_change"]["frozen_e2e_tv"], result["policy"])


def _f4_lost(t: dict[str, Any], c: dict[str, Any], m: float) -> Decision | None:
  """F4 v2/v3's first checks, (verdict, the reason's ending): no interval, or the e2e-TV
  drafter losing more than the margin on its own or against the control; None otherwise."""
  (lo, hi), (dlo, dhi) = t["change_ci95"], c["change_ci95"]
  if not _finite(lo, hi, dlo, dhi):
    return "inconclusive", " Too few steps for an interval."
  if hi < -m:
    return "not reproduced", f" The e2e-TV drafter loses more than {m:.2f}."
  if dhi < -m:
    return "not reproduced", (f" The e2e-TV drafter loses more than the CE control, by "
                              f"more than {m:.2f}.")
  return None


def _f4_kept(t: dict[str, Any], c: dict[str, Any], held: float, m: float) -> Decision:
  """F4 v2/v3's last check, once the policy moved: reproduced when every lower end (own
  change, held-out change, against the control) stays above the margin."""
  if t["change_ci95"][0] > -m and held > -m and c["change_ci95"][0] >= -m:
    return "reproduced", (f" It loses less than {m:.2f} and no more than {m:.2f} beyond the "
                          "control (the intervals' lower ends), without online updates, while "
                          "the policy moved.")
  return "inconclusive", (f" An interval reaches below a loss of {m:.2f} (own change or "
                          "against the control), or the held-out change does.")


def f4_v2(result: dict[str, Any]) -> Decision:
  m, t, c, held, policy = _f4_fields(result)
  lo, hi = t["change_ci95"]
  dlo, dhi = c["change_ci95"]
  text = (f"Frozen e2e-TV drafter, rejection, mean acceptance over depths: fitted change over "
          f"{result['steps']} RL steps {t['change']:+.3f} (95% t interval corrected for "
          f"autocorrelation: {lo:+.3f} to {hi:+.3f}); held-out change {held:+.3f}. Against the "
          f"control, the frozen CE drafter on the same prompts and seeds, paired by step "
          f"(difference of differences): {c['change']:+.3f} ({dlo:+.3f} to {dhi:+.3f}). Over "
          f"the run {_policy_text(policy)}.")
  lost = _f4_lost(t, c, m)
  if lost:
    return lost[0], text + lost[1]
  moved = (abs(policy["entropy_change"]) >= MOVED_ENTROPY
           or abs(policy["pass_at_1_change"]) >= MOVED_PASS_AT_1)
  if not moved:
    return "inconclusive", text + (
        f" The policy barely moved (less than {MOVED_ENTROPY} nats of entropy and "
        f"{MOVED_PASS_AT_1} of pass@1): the drafter was not tested against a policy that RL "
        "changed, so keeping its acceptance here says nothing about surviving RL.")
  verdict, why = _f4_kept(t, c, held, m)
  return verdict, text + why


def pass_at_1_moved(policy: dict[str, Any]) -> bool:
  """Whether the held-out mean pass@1 change's 95% interval lies beyond +-MOVED_PASS_AT_1."""
  ci = policy.get("pass_at_1_change_ci95")
  if not ci or not _finite(*ci):
    return False
  return ci[0] > MOVED_PASS_AT_1 or ci[1] < -MOVED_PASS_AT_1


def f4_v3(result: dict[str, Any]) -> Decision:
  m, t, c, held, policy = _f4_fields(result)
  pass_ci = policy.get("pass_at_1_change_ci95") or [math.nan, math.nan]
  text = (f"Frozen e2e-TV drafter, rejection, mean acceptance over depths: fitted change over "
          f"{result['steps']} RL steps {t['change']:+.3f} {_ci(t['change_ci95'])} (95%, "
          f"corrected for autocorrelation); held-out change {held:+.3f}. Against the frozen CE "
          f"control, paired by step: {c['change']:+.3f} {_ci(c['change_ci95'])}. Over the run "
          f"the policy's batch entropy changed by {policy['entropy_change']:+.3f} nats "
          f"{_ci(policy['entropy_change_ci95'])} and its held-out mean pass@1 by "
          f"{policy['pass_at_1_change']:+.3f} {_ci(pass_ci)}.")
  lost = _f4_lost(t, c, m)
  if lost:
    return lost[0], text + lost[1]
  if result["steps"] < MIN_RL_STEPS:
    return "inconclusive", text + f" Fewer than {MIN_RL_STEPS} RL steps."
  change = {"change": policy["entropy_change"], "change_ci95": policy["entropy_change_ci95"]}
  if not (entropy_moved(change) or pass_at_1_moved(policy)):
    return "inconclusive", text + (
        f" Neither the entropy change's interval lies beyond +-{ENTROPY_DRIFT} nats nor the "
        f"pass@1 change's beyond +-{MOVED_PASS_AT_1}: the drafter was not tested against a "
        "policy that RL changed.")
  verdict, why = _f4_kept(t, c, held, m)
  return verdict, text + why


F4 = Rule("through_rl", "F4", (
    Version(1, (
        f"The frozen e2e-TV drafter's fitted change in mean teacher-forced acceptance over the "
        f"RL run (rejection; line over steps, 95% Student-t interval with steps taken as "
        f"independent). Reproduced when the interval lies above -{MARGIN} and its held-out "
        f"acceptance loses less than {MARGIN}; not reproduced when the interval lies below "
        f"-{MARGIN}; otherwise inconclusive."),
        "Written with the finding's first code, before any results.", f4_v1),
    Version(2, (
        f"The frozen e2e-TV drafter's fitted change in mean teacher-forced acceptance over the "
        f"RL run (rejection), with a 95% t interval corrected for autocorrelation (Newey-West "
        f"or AR(1), the wider), and against a control that can lose: the frozen CE drafter on "
        f"the same prompts and rollout seeds, paired by step (per step e2e-TV - CE, fitted over "
        f"steps the same way: a difference of differences). Not reproduced when the e2e-TV "
        f"interval lies below -{MARGIN} or the difference of differences lies below -{MARGIN}. "
        f"Otherwise, when the policy barely moved (fitted change of its batch entropy under "
        f"{MOVED_ENTROPY} nats and of its held-out mean pass@1 under {MOVED_PASS_AT_1}, both in "
        f"magnitude), inconclusive, saying so. Reproduced when the e2e-TV interval lies above "
        f"-{MARGIN}, its held-out acceptance loses less than {MARGIN} and the difference of "
        f"differences' interval does not reach below -{MARGIN}; otherwise inconclusive."),
        "Written after version 1's verdicts on an earlier page had been seen (no control, "
        "steps taken as independent, a policy whose entropy moved 0.03 nats); applied to data "
        "measured afterwards.", f4_v2),
    Version(3, (
        f"As version 2 (the e2e-TV drafter's fitted change and the difference of differences "
        f"against the frozen CE control, margin {MARGIN}), with the policy's movement judged "
        f"by intervals, not point estimates, over a long run: needs at least {MIN_RL_STEPS} "
        f"RL steps, and the policy counts as moved only when the 95% interval of the fitted "
        f"change of its batch entropy (a line over the steps, corrected for autocorrelation) "
        f"lies entirely beyond +-{ENTROPY_DRIFT} nats, or the 95% interval of its held-out "
        f"mean pass@1 change (paired before/after on the same prompts) lies entirely beyond "
        f"+-{MOVED_PASS_AT_1}. Not reproduced as in version 2; otherwise inconclusive when "
        f"the run is shorter or the policy did not move; reproduced as in version 2."),
        "Written and committed before any data of the runs it decides existed: a 'moved' "
        "gate on point estimates let noise count as movement (at real scale the entropy "
        "change was -0.158 [-0.455, +0.139]).", f4_v3),
))


# ---------------------------------------------------------------------------- speedup


def speedup_v1(result: dict[str, Any]) -> Decision:
  e2e = result["ratios"].get("end_to_end")
  if not e2e:
    return "inconclusive", "No end-to-end ratio was measured."
  text = (f"Speculative async against autoregressive sync: {e2e['measured']:.2f}x per RL step "
          f"(point estimate of the median step times; the paper: up to {PAPER_SPEEDUP:.1f}x).")
  if e2e["measured"] >= SPEEDUP_REPRODUCED:
    return "reproduced", text
  if e2e["measured"] <= SPEEDUP_NOT_REPRODUCED:
    return "not reproduced", text
  return "inconclusive", text + " Faster, but well short of the paper's figure."


def _pair_text(name: str, p: dict[str, Any]) -> str:
  df = f", {p['df']} df" if "df" in p else ""
  return (f"{name.replace('_vs_', ' vs ').replace('_', ' ')} {p['measured']:.2f}x (95% t "
          f"interval {p['ci95'][0]:.2f} to {p['ci95'][1]:.2f}{df}, {p.get('steps', '?')} paired "
          "steps)")


def structural_only(placement: dict[str, Any]) -> bool:
  """Split placement on simulated devices: the code path runs, the times say nothing."""
  return placement.get("mode") == "split" and bool(placement.get("simulated"))


def _has_interval(p: dict[str, Any] | None) -> bool:
  return bool(p) and p.get("measured") is not None and bool(p.get("ci95")) and _finite(
      *p["ci95"])


def speedup_v2(result: dict[str, Any]) -> Decision:
  pairs = result.get("pairs") or {}
  placement = result.get("placement") or {}
  needed = (*PAIRS_HEADLINE, PAIR_END_TO_END)
  have = [p for p in needed if _has_interval(pairs.get(p))]
  missing = [p for p in needed if p not in have]
  text = ("Paired by step: " + "; ".join(_pair_text(p, pairs[p]) for p in have) +
          f" (the paper: up to {PAPER_SPEEDUP:.1f}x end to end)." if have else "")
  if structural_only(placement):
    return "inconclusive", (text + (" " if text else "") +
        f"Placement: split over {placement.get('devices')} simulated devices sharing "
        f"{placement.get('cpu_cores')} CPU cores: a structural check that the split learner "
        "and rollout sub-meshes run, not a speed result.")
  if missing:
    return "inconclusive", (text + (" " if text else "") +
                            "No paired 95% interval was measured for " + ", ".join(missing) +
                            " (arms run one after the other, or a single block).")
  lo, hi = pairs[PAIR_END_TO_END]["ci95"]
  if lo >= SPEEDUP_REPRODUCED and all(pairs[p]["ci95"][0] > 1 for p in PAIRS_HEADLINE):
    return "reproduced", text
  if hi <= SPEEDUP_NOT_REPRODUCED:
    return "not reproduced", text
  return "inconclusive", text + (
      f" The end-to-end interval does not lie at or above {SPEEDUP_REPRODUCED:.2f}x with both "
      "speculative-against-autoregressive intervals above 1x, nor at or below "
      f"{SPEEDUP_NOT_REPRODUCED:.1f}x.")


SPEEDUP = Rule("speedup", "Speedup", (
    Version(1, (
        f"The ratio of median step times, speculative async against autoregressive sync (a "
        f"point estimate). Reproduced at {SPEEDUP_REPRODUCED:.2f}x (0.8 x the paper's "
        f"{PAPER_SPEEDUP}x) or more; not reproduced at {SPEEDUP_NOT_REPRODUCED}x or less; "
        f"otherwise inconclusive."),
        "Written with the finding's first code, before any results.", speedup_v1),
    Version(2, (
        f"The four arms run interleaved in blocks and every ratio of step times comes with a "
        f"95% interval paired by step (the per-step log ratios averaged per block, Student-t "
        f"over blocks; bebop_jax/bench_rl.py). Reproduced when the interval of speculative async against "
        f"autoregressive sync lies at or above {SPEEDUP_REPRODUCED:.2f}x (0.8 x the paper's "
        f"{PAPER_SPEEDUP}x) and the intervals of speculative against autoregressive at equal "
        f"scheduling (async vs async, sync vs sync) both lie above 1x; not reproduced when the "
        f"end-to-end interval lies at or below {SPEEDUP_NOT_REPRODUCED}x; otherwise "
        f"inconclusive. Split placement on simulated devices (sharing the same CPU cores) is a "
        f"structural check, not a speed result: inconclusive."),
        "Written after version 1's verdicts on an earlier page had been seen (a point "
        "estimate of 1.49x with no interval); applied to data measured afterwards.",
        speedup_v2),
))


RULES: dict[str, Rule] = {r.finding: r for r in (F1, F2, F3, F4, SPEEDUP)}


def decide(finding: str, result: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
  """(verdict, reason) of the rule in force for `finding`, and every version's evaluation
  (Rule.evaluate)."""
  evaluation = RULES[finding].evaluate(result)
  now = evaluation["versions"][-1]
  return now["verdict"], now["reason"], evaluation


def markdown(evaluation: dict[str, Any]) -> str:
  """The rule block of a finding's section: the rule in force (text, version, history) and
  the verdict of every older version on the same data."""
  versions = evaluation["versions"]
  now = versions[-1]
  commit = now.get("commit")
  lines = [f"*Rule {evaluation['label']}, version {now['version']}:* {now['text']} "
           f"*History:* {now['history']}" +
           (f" *Committed in* `{commit[:10]}`." if commit else "")]
  if len(versions) > 1:
    lines.append("")
    lines.append("The same data under the older versions of this rule:")
    lines.append("")
    lines.append("| version | rule | verdict | why |")
    lines.append("|---|---|---|---|")
    for v in versions[:-1]:
      lines.append(f"| {v['version']} | {v['text']} {v['history']} | **{v['verdict']}** | "
                   f"{v['reason']} |")
    moved = [v["version"] for v in versions[:-1] if v["verdict"] != now["verdict"]]
    lines.append("")
    lines.append(
        "The change of rule moved this verdict: version " + ", ".join(map(str, moved)) +
        f" says otherwise than version {now['version']}." if moved else
        "Every older version gives the same verdict on these data.")
  return "\n".join(lines)
