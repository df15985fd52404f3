"""The README's key results come from committed artifacts: its generated blocks are what
experiments/key_results.py renders from docs/results/*.json and docs/artifacts/main_job.json,
and every decimal number in them is a number of those files at the printed precision."""

import json
import os
import re

from experiments import key_results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_blocks():
  with open(os.path.join(REPO, "README.md")) as f:
    return key_results.blocks_of(f.read())


def _numbers(tree):
  """Every number in a json tree."""
  if isinstance(tree, dict):
    for v in tree.values():
      yield from _numbers(v)
  elif isinstance(tree, list):
    for v in tree:
      yield from _numbers(v)
  elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
    yield float(tree)


def test_the_readme_blocks_are_rendered_from_the_artifacts():
  blocks = _readme_blocks()
  assert set(blocks) == {"claims", "findings", "main_job", "real_policy"}
  rendered = key_results.render()
  for name, text in rendered.items():
    assert blocks[name] == text, (f"README.md's {name} block is stale: python "
                                  "experiments/key_results.py --write")


def test_every_number_in_the_key_results_is_an_artifact_number_at_its_precision():
  """Independent of the renderer: each decimal in the blocks (a plain value, a percentage, or
  minutes from seconds) rounds from some number of the artifacts."""
  artifacts = [json.load(open(os.path.join(key_results.RESULTS_DIR, f"{n}.json")))
               for n in key_results.FINDINGS]
  artifacts += [json.load(open(p)) for p in (key_results.MAIN_JOB, key_results.SMOLLM2_JOB,
                                             key_results.SMOLLM2_BENCH) if os.path.exists(p)]
  blocks = _readme_blocks()
  # The claims block quotes the paper (its "up to 1.8x") beside the verdict words; the
  # measured numbers are in the other two.
  text = "\n".join(blocks[k] for k in ("findings", "main_job", "real_policy"))
  _assert_artifact_numbers(text, artifacts, at_least=30)


def test_the_results_page_real_policy_section_comes_from_its_artifacts():
  with open(key_results.RESULTS_PAGE) as f:
    blocks = key_results.blocks_of(f.read())
  rendered = key_results.render_results_page()
  assert blocks["real_findings"] == rendered["real_findings"], (
      "docs/results.md's real_findings block is stale: python experiments/key_results.py "
      "--write")
  artifacts = [json.load(open(os.path.join(key_results.REAL_RESULTS_DIR, f"{n}.json")))
               for n in key_results.REAL_FINDINGS]
  _assert_artifact_numbers(blocks["real_findings"], artifacts, at_least=8)


def _assert_artifact_numbers(text, artifacts, at_least):
  values = [v for a in artifacts for v in _numbers(a)]
  found = re.findall(r"([+\-−]?)(\d+\.\d+)(%?)", text)
  assert len(found) > at_least
  for sign, digits, percent in found:
    number = -float(digits) if sign in ("-", "−") else float(digits)
    places = len(digits.split(".")[1])
    scales = (100.0,) if percent else (1.0, 1 / 60)
    ok = any(abs(round(v * s, places) - number) < 0.5 * 10 ** -places
             for v in values for s in scales)
    assert ok, f"{sign}{digits}{percent} in the README is no artifact number"
