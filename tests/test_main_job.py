"""The main job end to end on the tiny configs: SFT -> MTP -> eval, summary keys, reruns."""

import collections
import json
import os
import time

import jax
import numpy as np
import pytest

from bebop_jax.stages import config as config_lib
from bebop_jax.stages import report
from bebop_jax import stages
from bebop_jax.train import checkpoint as checkpoint_lib
from bebop_jax.stages import lineage
from bebop_jax.train import metrics as metrics_lib
from bebop_jax.stages import mtp
from bebop_jax.train import drafter
from bebop_jax.stages import drafter_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(data_dir, name="quickstart_tiny", arg=None):
  config = config_lib.load_file(os.path.join(REPO, "configs", f"{name}.py"), arg)
  config.data.data_dir = str(data_dir)
  return config


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  data_dir = tmp_path_factory.mktemp("data")
  workdir = str(tmp_path_factory.mktemp("job"))
  config = config_lib.validate(_config(data_dir))
  stages.run(config, workdir)
  return data_dir, workdir, config


def test_summary_has_the_documented_keys(job):
  _, workdir, config = job
  s = json.load(open(os.path.join(workdir, "summary.json")))
  k = config.model.num_draft_steps
  assert set(s["eval"]["accuracy"]) == {"math", "code", "agentic"}
  assert all(0 <= v <= 1 for v in s["eval"]["accuracy"].values())
  assert s["mtp"]["loss"] == "e2e_tv" and len(s["mtp"]["acceptance_teacher_forced"]) == k
  for mode in ("rejection", "greedy_draft"):
    acc = s["decode"]["acceptance_online"][mode]
    assert len(acc) == k and all(0 <= a <= 1 for a in acc)
    assert s["decode"]["tokens_per_target_forward"][mode] >= 1
    assert set(s["entropy_fit"][mode]) >= {"slope", "intercept", "r2"}
  assert set(s["decode"]["speedup_vs_autoregressive"]) == {"1", "8"}
  assert all(v > 0 for v in s["decode"]["speedup_vs_autoregressive"].values())
  assert {"sft_s", "mtp_s", "rl_s", "eval_s", "total_s"} <= set(s["timing"])
  compiles = s["timing"]["compile"]
  assert set(compiles) == {"sft", "mtp", "rl", "eval"}
  for stage, c in compiles.items():  # every stage compiles (or loads) its programs
    assert 0 < c["seconds"] < s["timing"][f"{stage}_s"] and c["cache_hits"] >= 0, stage
  rl = s["rl"]
  assert rl["steps"] == config.rl.train.num_steps == len(rl["acceptance_by_step"])
  assert all(len(a) == k for a in rl["acceptance_by_step"])
  for when in ("before", "after"):
    assert set(rl[f"pass_at_1_{when}"]) == {"math", "code", "agentic"}
  assert set(rl["entropy_fit"]) == {"rejection", "greedy_draft"}
  assert set(s["sft"]["entropy"]) == {"math", "code", "agentic"}
  for plot in ("acceptance_by_depth", "acceptance_vs_entropy", "speedup_by_batch",
               "entropy_histogram", "rl_pass_at_1", "rl_reward", "rl_acceptance"):
    assert os.path.getsize(os.path.join(workdir, "plots", f"{plot}.png")) > 1000
  # The eval stage measured the policy the job ends with, the RL stage's final one, and
  # shows the figures of the policy that entered RL beside it.
  assert s["policy"] == {"stage": "rl", "step": config.rl.train.num_steps}
  assert s["eval"]["accuracy"] == rl["pass_at_1_after"]
  assert s["eval"]["accuracy_before_rl"] == rl["pass_at_1_before"]
  assert s["decode"]["acceptance_online"] == rl["acceptance_after"]
  before = s["decode"]["before_rl"]
  assert before["acceptance_online"] == rl["acceptance_before"]
  assert before["acceptance_teacher_forced"] == s["mtp"]["acceptance_teacher_forced_by_mode"]
  for mode in config.rl.eval.modes:
    assert len(s["decode"]["acceptance_teacher_forced"][mode]) == k
  report = open(os.path.join(workdir, "report.md")).read()
  assert "| rejection |" in report and "acceptance_vs_entropy.png" in report
  assert "## RL" in report and "rl_acceptance.png" in report
  assert "## Policy entropy" in report
  assert "| task | before RL | after RL |" in report and "Before RL (online" in report
  assert f"the RL stage's final parameters (step {config.rl.train.num_steps})" in report


def test_the_eval_stage_measures_the_final_rl_policy(job, tmp_path):
  """The parameters the eval stage measures are exactly those of the RL stage's final
  checkpoint (trunk and MTP modules), not the MTP stage's policy that entered RL. The tiny
  job's RL barely moves the policy, so a copy of its workdir gets a final checkpoint whose
  trunk and MTP modules both differ from the MTP stage's."""
  import shutil  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from bebop_jax.stages import eval as eval_stage  # pylint: disable=g-import-not-at-top
  _, job_workdir, config = job
  steps = config.rl.train.num_steps
  workdir = str(tmp_path / "job")
  for stage in ("sft", "mtp", "rl"):
    shutil.copytree(os.path.join(job_workdir, stage), os.path.join(workdir, stage))
  final = os.path.join(checkpoint_lib.checkpoint_dir(workdir, "rl"), str(steps))
  saved = ocp.PyTreeCheckpointer().restore(os.path.join(final, "state"))
  saved["trunk"] = jax.tree.map(lambda x: x + 1, saved["trunk"])
  saved["mtp"] = jax.tree.map(lambda x: x - 1, saved["mtp"])
  shutil.rmtree(final)
  with checkpoint_lib.Checkpointer(checkpoint_lib.checkpoint_dir(workdir, "rl")) as ckpt:
    ckpt.save(steps, saved, force=True)

  _, params, policy = eval_stage.policy_to_measure(config, workdir)
  assert policy == {"stage": "rl", "step": steps}
  flat = lambda tree: {"/".join(map(str, p)): np.asarray(v) for p, v in
                       ocp.tree.to_flat_dict(checkpoint_lib.to_pure(tree)).items()}
  want = {**flat(saved["trunk"]), **flat(saved["mtp"])}
  got = flat(params)
  assert set(got) == set(want)
  for path, value in got.items():
    np.testing.assert_array_equal(value, want[path], err_msg=path)
  _, entered = lineage.restore_policy(config, workdir, stage="mtp")
  assert all(not np.array_equal(v, got[p]) for p, v in flat(entered).items())


def test_only_the_drafter_changes(job):
  _, workdir, config = job
  summary = lineage.read_summary(workdir, "mtp")
  assert {"alpha_1", "tv_1", "kl_1", "ce_1", "expected_accepted_length"} <= set(
      summary["metrics"])
  _, sft_params = lineage.restore_policy(config, workdir, stage="sft")
  _, params = lineage.restore_policy(config, workdir, stage="mtp")
  flat_sft = dict(jax.tree_util.tree_leaves_with_path(sft_params))
  changed = {jax.tree_util.keystr(p): not np.array_equal(np.asarray(v), np.asarray(flat_sft[p]))
             for p, v in jax.tree_util.tree_leaves_with_path(params)}
  assert any(c for p, c in changed.items() if "mtp" in p)
  assert not any(c for p, c in changed.items() if "mtp" not in p)


def test_the_drafter_stores_its_token_counts_for_a_reduced_draft_vocabulary(job):
  """The MTP stage stores the policy-token counts of its training rollouts; the reduced
  draft vocabulary comes from them, with the stop tokens always in."""
  _, workdir, config = job
  summary = lineage.read_summary(workdir, "mtp")
  counts = np.load(os.path.join(lineage.stage_dir(workdir, "mtp"), lineage.DRAFT_COUNTS))
  assert counts.shape == (config.model.vocab_size,)
  assert int(counts.sum()) == summary["policy_tokens"]
  ids, cover = lineage.draft_vocabulary(workdir, 8, always=(2,))
  assert len(ids) == 8 and 2 in ids.tolist() and list(ids) == sorted(ids)
  top = np.argsort(-counts, kind="stable")[:7]
  assert set(top.tolist()) <= set(ids.tolist()) | {2}
  assert 0 < cover <= 1 and cover == pytest.approx(counts[ids].sum() / counts.sum())


def test_rerun_reuses_everything(job, capsys):
  _, workdir, config = job
  start = time.perf_counter()
  stages.run(config, workdir)
  out = capsys.readouterr().out
  assert "[sft] complete" in out and "[mtp] complete" in out and "[eval] complete" in out
  assert "[rl] complete" in out
  # It ends with the run's summary table, the first run's stage times kept.
  table = out[out.index(f"== {os.path.abspath(workdir)} =="):]
  assert "before RL ->" in table and "summary.json" in table and "time " in table
  assert time.perf_counter() - start < 30
  store = drafter_data.drafter_store(config, workdir)  # the drafter dataset, sampled once
  assert sorted(store.meta()["splits"]) == ["test", "train"]
  assert len(os.listdir(os.path.dirname(store.path))) == 1


def test_interrupted_mtp_stage_resumes_across_its_warm_start(job, tmp_path):
  """Another loss from the same SFT workdir (as a sweep does: the drafter dataset is not
  sampled again), a warm start of one KL step, stopped after it: the rerun resumes with the
  configured loss. Each step's logged loss is its phase's objective."""
  data_dir, sft_workdir, _ = job
  def config(**train):
    c = _config(data_dir)
    c.stages = ("mtp",)
    c.mtp.loss = "tv"
    c.mtp.warm_start.loss = "kl"
    c.mtp.warm_start.steps = 1
    c.mtp.init_from = sft_workdir
    c.mtp.eval_modes = ("rejection",)
    c.mtp.train.update(dict(log_every=1, **train))
    return config_lib.validate(c)

  workdir = str(tmp_path)
  summary = mtp.run(config(stop_at_step=1), workdir)
  assert not summary["complete"] and summary["steps"] == 1 and lineage.read_summary(workdir, "mtp") is None
  summary = mtp.run(config(), workdir)
  assert summary["complete"] and summary["steps"] == 2 and summary["loss"] == "tv"
  assert summary["schedule"] == [["kl", 1], ["tv", 2]]
  assert summary["timing"]["features_from"] == "stored"  # by the job's MTP stage
  logged = {r["step"]: r for r in metrics_lib.read_metrics(workdir, "mtp") if "loss" in r}
  k = config().model.num_draft_steps
  mean = lambda r, name: np.mean([r[f"{name}_{d}"] for d in range(1, k + 1)])
  assert logged[1]["loss"] == pytest.approx(mean(logged[1], "kl"), rel=1e-5)
  assert logged[2]["loss"] == pytest.approx(mean(logged[2], "tv"), rel=1e-5)
  assert abs(logged[2]["loss"] - mean(logged[2], "kl")) > 1e-3


def test_an_mtp_stage_with_a_reduced_draft_vocabulary(job, tmp_path):
  """mtp.draft_vocab: the drafter is trained and measured on its most frequent tokens (the
  stop tokens in), the ids are stored with it, and the RL stage drafts from them by
  default (rl.rollout.draft_vocab 0)."""
  from bebop_jax.stages import rl as rl_stage  # pylint: disable=g-import-not-at-top
  data_dir, sft_workdir, _ = job
  c = _config(data_dir)
  c.stages = ("mtp",)
  c.mtp.init_from = sft_workdir
  c.mtp.draft_vocab = 12
  c.mtp.eval_modes = ("rejection",)
  c.mtp.train.eval_every = 1
  config = config_lib.validate(c)
  workdir = str(tmp_path)
  # A job run in pieces: the SFT stage's time, from an earlier invocation, is kept.
  with open(os.path.join(workdir, "timing.json"), "w") as f:
    json.dump({"sft_s": 12.5, "compile": {"sft": {"seconds": 1.0}}}, f)
  stages.run(config, workdir)
  timing = json.load(open(os.path.join(workdir, "timing.json")))
  assert timing["sft_s"] == timing["earlier_s"] == 12.5 and timing["mtp_s"] > 0
  assert set(timing["compile"]) == {"sft", "mtp"}
  summary = lineage.read_summary(workdir, "mtp")
  ids = lineage.stored_draft_vocabulary(workdir)
  assert len(ids) == 12 and 2 in ids.tolist()  # the end of sequence can be drafted
  assert 0 < summary["draft_vocab"]["coverage_train"] <= 1
  assert summary["draft_vocab"]["size"] == 12
  online = summary["after"]["online"]["rejection"]
  assert len(online["interval"]) == config.model.num_draft_steps
  assert all(lo <= a <= hi for a, (lo, hi) in zip(online["acceptance"], online["interval"]))
  assert sum(online["attempted"]) > 0
  assert set(summary["after"]["heldout"]) >= {"alpha_1", "alpha_unweighted_1",
                                               "draft_events_1"}
  curve = [r for r in metrics_lib.read_metrics(workdir, "mtp") if "eval/alpha_1" in r]
  assert [r["step"] for r in curve] == [0, 1, 2]
  assert tuple(rl_stage.draft_vocabulary(config, workdir)) == tuple(ids.tolist())


def test_pack_rows():
  seqs = [(np.arange(1, n + 1, dtype=np.int32), np.ones(n, np.int32)) for n in (5, 3, 7, 2, 8)]
  rows = drafter.pack_rows(seqs, 10)
  assert rows["tokens"].shape[1] == 10 and len(rows["tokens"]) == 3  # 25 tokens, first fit
  for r in range(len(rows["tokens"])):
    seg = rows["segment_ids"][r]
    for s in set(seg[seg > 0].tolist()):
      idx = np.where(seg == s)[0]
      assert (np.diff(idx) == 1).all()
      np.testing.assert_array_equal(rows["positions"][r, idx], np.arange(len(idx)))
      np.testing.assert_array_equal(rows["tokens"][r, idx], np.arange(1, len(idx) + 1))
  assert rows["loss_mask"].sum() == 25 and (rows["tokens"][rows["segment_ids"] == 0] == 0).all()
  # A sequence longer than a row is cut.
  assert drafter.pack_rows([(np.ones(12, np.int32), np.ones(12, np.int32))], 10)["tokens"].shape \
      == (1, 10)


def test_decode_benchmark_splits_off_the_fixed_per_call_cost(job):
  from bebop_jax.stages import decode_timing  # pylint: disable=g-import-not-at-top
  _, workdir, config = job
  graphdef, state = lineage.restore_policy(config, workdir, stage="mtp")
  rows = decode_timing.run_benchmark(config, graphdef, state, batch_sizes=[2], temperatures=[1.0],
                                 modes=["rejection"], max_new=16, repeats=1, num_prompts=2,
                                 split_fixed_cost=True)
  (row,) = rows
  assert row["prompts"] == 2 and row["spec_tokens"] > row["prompts"]
  # Wall-clock values are not compared (a timed test would be flaky); the bookkeeping is.
  assert row["ar_fixed_seconds"] > 0 and row["spec_fixed_seconds"] > 0
  assert row["ar_fixed_share"] == row["ar_fixed_seconds"] / row["ar_seconds"]
  assert np.isfinite(row["decode_phase_speedup"])
  assert decode_timing.format_row(row).count("|") == decode_timing.header(True).split("\n")[0].count("|")


def test_decode_benchmark_rows_per_draft_vocabulary(job):
  """A reduced draft vocabulary gets its own rows (labelled, without the full head's
  teacher-forced acceptance); the drafts it accepts are inside it."""
  from bebop_jax.stages import decode_timing  # pylint: disable=g-import-not-at-top
  _, workdir, config = job
  graphdef, state = lineage.restore_policy(config, workdir, stage="mtp")
  ids, _ = lineage.draft_vocabulary(workdir, 6, always=(2,))
  rows = decode_timing.run_benchmark(config, graphdef, state, batch_sizes=[2], temperatures=[1.0],
                                 modes=["block"], max_new=16, repeats=1, num_prompts=2,
                                 draft_vocabs={"full": None, "6": ids})
  assert [r.get("draft_vocab") for r in rows] == ["full", "6"]
  assert rows[0]["acceptance_teacher_forced"] is not None
  assert rows[1]["acceptance_teacher_forced"] is None
  assert "block @6" in decode_timing.format_row(rows[1])
  s = metrics_lib.read_json(os.path.join(workdir, "summary.json"))  # the report renders them
  s["decode"]["benchmark"] = rows
  text = report.render_report(s, collections.defaultdict(lambda: "plot.png"))
  assert "| 2 | 2 | block @6 |" in text and text.count("| 2 | 2 | block") == 2


def test_rl_rollouts_with_a_reduced_draft_vocabulary(job):
  """rl.rollout.draft_vocab picks its tokens from the drafter's stored counts (the stop
  tokens in), and the RL stage's speculative engine decodes with it: every mode's held-out
  rollouts, through multi_turn and the jitted loop."""
  from bebop_jax import tasks as tasks_lib  # pylint: disable=g-import-not-at-top
  from bebop_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from bebop_jax.stages import rl as rl_stage  # pylint: disable=g-import-not-at-top
  _, workdir, config = job
  config = config_lib.validate(config.copy_and_resolve_references())
  assert rl_stage.draft_vocabulary(config, workdir) is None  # 0: the whole head
  config.rl.rollout.draft_vocab = 8
  ids = rl_stage.draft_vocabulary(config, workdir)
  data = config_lib.settings(config).data
  tok = data.loaded_tokenizer
  assert len(ids) == 8 and {tok.eos_id, tok.call_end_id} <= set(ids)
  graphdef, params = lineage.restore_policy(config, workdir, stage="mtp")
  task_objs = {"math": tasks_lib.get_task("math", **config.data.tasks["math"].knobs)}
  examples = {"math": pipeline.eval_examples(data, "math", 4)}
  ev = rl_stage.evaluate(config, graphdef, params, examples, task_objs, draft_vocab=ids)
  assert set(ev["modes"]) == set(config.rl.eval.modes)
  config.rl.rollout.draft_vocab = config.model.vocab_size + 1
  with pytest.raises(ValueError, match="rl.rollout.draft_vocab"):
    config_lib.validate(config)


def test_the_run_ends_with_a_short_summary_table(tmp_path):
  (tmp_path / "report.md").write_text("r")
  s = {"rl": {"pass_at_1_before": {"math": 0.5, "code": 0.25},
              "pass_at_1_after": {"math": 0.625, "code": 0.375},
              "pass_at_1_delta": {"math": {"delta": 0.125, "se": 0.03125},
                                  "code": {"delta": 0.125, "se": 0.0625}}},
       "mtp": {"acceptance_teacher_forced": [0.9, 0.8, 0.7]},
       "decode": {"tokens_per_target_forward": {"rejection": 3.25},
                  "speedup_vs_autoregressive": {"1": 1.25, "8": 0.75}}}
  text = report.run_summary(str(tmp_path), s, {"sft_s": 60.0, "rl_s": 120.0})
  lines = text.splitlines()
  assert len(lines) <= 12
  assert "pass@1 code  " in lines[0] and "0.250 before RL -> 0.375 after (+0.125 ± 0.062" \
      in lines[0]
  assert "0.90 / 0.80 / 0.70 per depth" in text and "rejection 3.25" in text
  assert "batch 1 1.25x, batch 8 0.75x" in text
  assert "sft 1.0 min, rl 2.0 min (total 3.0 min)" in text
  assert f"report                   {tmp_path / 'report.md'}" in text
  assert "summary.json" not in text  # not written: not listed
  # Only what ran is shown.
  assert report.run_summary(str(tmp_path), None, {"sft_s": 30.0}).splitlines()[0].startswith(
      "time")
  # After RL the drafter's figures are the final policy's, those before RL beside them.
  s["decode"].update(acceptance_teacher_forced={"rejection": [0.875, 0.75, 0.625]},
                     before_rl={"acceptance_teacher_forced": {"rejection": [0.9, 0.8, 0.7]},
                                "tokens_per_target_forward": {"rejection": 3.5}})
  text = report.run_summary(str(tmp_path), s, {"sft_s": 60.0, "rl_s": 120.0})
  assert len(text.splitlines()) <= 12
  assert "0.90 / 0.80 / 0.70 before RL -> 0.88 / 0.75 / 0.62 per depth (teacher-forced, " \
      "rejection)" in text
  assert "rejection 3.50 before RL -> 3.25" in text


def test_the_drafter_learning_curve(job, tmp_path, one_device_env):
  """experiments/drafter_learning_curve.py: the warm phase runs once and each warm run
  resumes from its checkpoint with its objective (the same first point as the warm phase),
  the cold run trains the objective from the start; the json has a point per evaluation."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  data_dir, sft_workdir, _ = job
  out = str(tmp_path / "curve")
  subprocess.run([sys.executable, "experiments/drafter_learning_curve.py",
                  "--config=configs/quickstart_tiny.py", f"--set=data.data_dir={data_dir}",
                  "--set=mtp.optim.warmup_steps=0",  # the first step moves the drafter
                  f"--init_from={sft_workdir}", f"--workdir={tmp_path / 'runs'}",
                  f"--out={out}", "--losses=tv", "--warm_steps=1", "--steps=1",
                  "--eval_every=1"], cwd=REPO, env=one_device_env, check=True,
                 capture_output=True)
  result = json.load(open(out + ".json"))
  assert os.path.exists(out + ".png")
  assert result["runs"]["warm/tv"]["schedule"] == [["kl", 1], ["tv", 2]]
  assert result["runs"]["cold/tv"]["schedule"] == [["tv", 2]]
  points = {(p["run"], p["step"]): p for p in result["points"]}
  assert set(points) == {(r, s) for r in ("cold/tv", "warm/tv") for s in (0, 1, 2)}
  assert points["cold/tv", 0]["alpha"] == points["warm/tv", 0]["alpha"]  # the same drafter
  assert points["warm/tv", 1]["alpha"] != points["cold/tv", 1]["alpha"]  # kl against tv
  for p in result["points"]:
    assert p["tokens"] == p["step"] * result["runs"][p["run"]]["tokens_per_step"]
    assert all(n > 0 for n in p["draft_events"])
