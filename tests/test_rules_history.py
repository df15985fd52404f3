"""Rules before data, from the git history: each verdict's rule version names the commit
that added it (rules.version_commit), and every judged artifact on the results pages that
carries one was committed after it (rules.artifact_after_rule)."""

import glob
import json
import os
import subprocess

import pytest

from experiments.findings import rules

REPO = rules.REPO


def _git(repo, *args):
  return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                        text=True).stdout.strip()


@pytest.fixture
def history(tmp_path):
  """A repository with a rules file whose version 2 is committed before one artifact and
  after another."""
  _git(tmp_path, "init", "-q")
  _git(tmp_path, "config", "user.email", "t@t")
  _git(tmp_path, "config", "user.name", "t")
  rules_file = tmp_path / rules.RULES_FILE
  rules_file.parent.mkdir(parents=True)

  def commit(message):
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", message)
    return _git(tmp_path, "rev-parse", "HEAD")

  rules_file.write_text("def f9_v1(result):\n  pass\n")
  commit("rule v1")
  (tmp_path / "early.json").write_text("{}")
  commit("data judged by v2, made before it")
  rules_file.write_text("def f9_v1(result):\n  pass\n\n\ndef f9_v2(result):\n  pass\n")
  v2 = commit("rule v2")
  (tmp_path / "late.json").write_text("{}")
  commit("data made after v2")
  (tmp_path / "early.json").write_text('{"touched": true}')  # re-committed, not rerun
  return tmp_path, v2


def test_the_version_commit_and_the_order_of_rule_and_data(history):
  repo, v2 = history
  rules.version_commit.cache_clear()
  assert rules.version_commit("f9_v2", repo=str(repo)) == v2
  assert rules.version_commit("f9_v3", repo=str(repo)) is None
  assert rules.artifact_after_rule(v2, "late.json", repo=str(repo))
  assert not rules.artifact_after_rule(v2, "early.json", repo=str(repo))  # uncommitted edit
  assert not rules.artifact_after_rule(None, "late.json", repo=str(repo))
  rules.version_commit.cache_clear()


def test_every_results_artifact_with_a_rule_commit_came_after_its_rule():
  """The findings' json beside the results pages: where the verdict's rule version records
  the commit that added it, the json was committed after that commit."""
  # Artifacts written before rules recorded their commit carry none; every later one is
  # checked.
  for path in sorted(glob.glob(os.path.join(REPO, "docs", "results*", "*.json"))):
    with open(path) as f:
      finding = json.load(f)
    rule = finding.get("rule") or {}
    now = (rule.get("versions") or [{}])[-1]
    if now.get("commit"):
      assert rules.artifact_after_rule(now["commit"], os.path.relpath(path, REPO)), (
          f"{path} is judged by rule {rule['label']} v{now['version']}, committed in "
          f"{now['commit'][:10]}, but was not committed after it")
