import dataclasses

import numpy as np
import pytest

from bebop_jax.data import pipeline
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.tasks import TASK_NAMES, Example, base, get_task


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _equal(a, b):
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _math_only(data, **knobs):
  """`data` with math the only task, its knobs updated by `knobs`."""
  tasks = {n: dataclasses.replace(t, weight=float(n == "math")) for n, t in data.tasks.items()}
  tasks["math"] = dataclasses.replace(tasks["math"], knobs={**tasks["math"].knobs, **knobs})
  return dataclasses.replace(data, tasks=tasks)


def test_sft_features_mask_prompt_and_tool_results():
  tok = tokenizer_lib.load_tokenizer("char")
  demo = f"x{base.CALL_START}get(a, b){base.CALL_END}{base.RESULT_START}42{base.RESULT_END}" \
         f"{base.ANSWER_MARKER}42"
  f = pipeline.sft_features("Q?\n", demo, tok)
  text = [tok.decode([t]) for t in f["tokens"]]
  assert text[0] == base.BOS_MARKER and text[-1] == base.EOS_MARKER
  masked = "".join(t for t, m in zip(text, f["loss_mask"]) if m)
  assert masked == (f"x{base.CALL_START}get(a, b){base.CALL_END}{base.ANSWER_MARKER}42"
                    f"{base.EOS_MARKER}")


def test_tool_result_mask_unterminated_runs_to_end():
  tok = tokenizer_lib.load_tokenizer("char")
  ids = np.array(tok.encode(f"a{base.RESULT_START}bc"))
  assert pipeline.tool_result_mask(ids, tok).tolist() == [False, True, True, True]


@pytest.mark.parametrize("packing", [True, False])
def test_sft_batches_shapes_masks_and_segments(tiny_data, packing):
  ds = pipeline.sft_dataset(tiny_data, batch_size=4, seq_len=192, packing=packing)
  tok = tiny_data.loaded_tokenizer
  for batch in _take(iter(ds), 3):
    assert set(batch) == {"tokens", "segment_ids", "positions", "loss_mask"}
    for v in batch.values():
      assert v.shape == (4, 192) and v.dtype == np.int32
    seg, tokens = batch["segment_ids"], batch["tokens"]
    assert np.all(tokens[seg == 0] == tok.pad_id)
    assert np.all(batch["loss_mask"][seg == 0] == 0)
    # Every segment starts with bos at position 0 and contains exactly one eos (its last).
    for row in range(4):
      for s in set(seg[row].tolist()) - {0}:
        idx = np.nonzero(seg[row] == s)[0]
        assert tokens[row, idx[0]] == tok.bos_id and batch["positions"][row, idx[0]] == 0
        assert np.array_equal(batch["positions"][row, idx], np.arange(len(idx)))
        assert tokens[row, idx[-1]] == tok.eos_id
        assert batch["loss_mask"][row, idx[0]] == 0 and batch["loss_mask"][row, idx[-1]] == 1
        if not packing:
          assert s == 1
  if packing:
    assert (seg.max(axis=1) > 1).any()  # more than one example per row


def test_sft_mixture_uses_all_tasks(tiny_data):
  tok = tiny_data.loaded_tokenizer
  ds = pipeline.sft_dataset(tiny_data, batch_size=8, seq_len=256, packing=False)
  text = " ".join(tok.decode(row, strip_pad=True) for b in _take(iter(ds), 4)
                  for row in b["tokens"])
  assert "Compute:" in text and base.CALL_START in text and "program" in text


def test_sft_resume_from_state_gives_the_next_batch(tiny_data):
  ds = pipeline.sft_dataset(tiny_data, batch_size=4, seq_len=192, seed=3)
  straight = _take(iter(ds), 6)
  for k in (1, 4):
    it = iter(ds)
    _take(it, k)  # batches 0..k-1
    state = it.get_state()
    resumed = iter(ds)
    resumed.set_state(state)
    assert _equal(next(resumed), straight[k])
  # Same seed, same batches; another seed, other batches.
  assert _equal(next(iter(pipeline.sft_dataset(tiny_data, batch_size=4, seq_len=192,
                                               seed=3))), straight[0])
  assert not _equal(next(iter(pipeline.sft_dataset(tiny_data, batch_size=4,
                                                   seq_len=192, seed=4))), straight[0])


def test_rl_prompt_batches_repeat_each_prompt(tiny_data):
  ds = pipeline.rl_prompt_dataset(tiny_data, prompts_per_batch=3, group_size=4,
                                  max_prompt_len=128, seed=1)
  it = iter(ds)
  batches = _take(it, 3)
  tok = tiny_data.loaded_tokenizer
  for b in batches:
    assert b["prompt_tokens"].shape == (12, 128)
    assert b["group_ids"].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    for g in range(3):
      rows = slice(4 * g, 4 * g + 4)
      assert len(set(b["example_json"][rows].tolist())) == 1
      assert (b["prompt_tokens"][rows] == b["prompt_tokens"][4 * g]).all()
    for row in range(12):
      ex = Example.from_json(b["example_json"][row])
      n = b["prompt_lengths"][row]
      assert tok.decode(b["prompt_tokens"][row, :n]) == base.BOS_MARKER + ex.prompt
      assert (b["prompt_tokens"][row, n:] == tok.pad_id).all()
      assert TASK_NAMES[b["task_ids"][row]] == ex.task
      assert get_task(ex.task).reward(ex, ex.demonstration) == 1.0
  state = it.get_state()
  nxt = next(it)
  resumed = iter(ds)
  resumed.set_state(state)
  assert _equal(next(resumed), nxt)


def test_prompt_longer_than_max_is_a_clear_error(tiny_data):
  ds = pipeline.rl_prompt_dataset(tiny_data, prompts_per_batch=2, group_size=1,
                                  max_prompt_len=4)
  with pytest.raises(ValueError, match="more than max_prompt_len=4"):
    next(iter(ds))


def test_test_split_is_held_out(tiny_data):
  for name in TASK_NAMES:
    train = pipeline.task_source(tiny_data, name, "train")
    test = pipeline.eval_examples(tiny_data, name, 1000)
    assert len(test) == tiny_data.num_test
    train_prompts = {bytes(train[i]["prompt"]).decode() for i in range(len(train))}
    assert not train_prompts & {ex.prompt for ex in test}


def test_rl_split_is_disjoint_from_train_and_test(tiny_data):
  """RL learns on prompts SFT never saw and evaluation never shows."""
  rl_prompts = {}
  for name in TASK_NAMES:
    prompts = {}
    for split in ("train", "test", "rl"):
      source = pipeline.task_source(tiny_data, name, split)
      prompts[split] = {bytes(source[i]["prompt"]).decode() for i in range(len(source))}
    assert len(prompts["rl"]) == tiny_data.num_rl
    assert not prompts["rl"] & (prompts["train"] | prompts["test"])
    rl_prompts[name] = prompts["rl"]
  batch = next(iter(pipeline.rl_prompt_dataset(tiny_data, prompts_per_batch=4,
                                               group_size=2, max_prompt_len=128)))
  for raw in batch["example_json"]:  # the RL prompt stream reads the rl split
    ex = Example.from_json(raw)
    assert ex.prompt in rl_prompts[ex.task]


def test_sft_samples_a_fresh_demonstration_at_every_visit(tiny_data):
  """With diversity, the same examples come back with other solution paths in later
  epochs; the stream is still a function of the seed."""
  data = _math_only(tiny_data, diversity=0.8, restate=0.4, spacing=0.4)
  tok = data.loaded_tokenizer

  def texts(seed, batches):
    it = iter(pipeline.sft_dataset(data, batch_size=4, seq_len=64, packing=False,
                                   seed=seed))
    return [tok.decode(row, strip_pad=True) for _ in range(batches)
            for row in next(it)["tokens"]]

  stream = texts(0, 3 * data.num_train // 4)  # three epochs of the math examples
  assert stream == texts(0, 3 * data.num_train // 4)
  by_prompt = {}
  for text in stream:
    prompt, _, demo = text.partition("\n")
    by_prompt.setdefault(prompt, set()).add(demo)
  assert sum(len(d) > 1 for d in by_prompt.values()) > len(by_prompt) // 2
  for text in stream:  # every sampled path ends with the right answer
    body = text.removeprefix("<|bos|>").removesuffix("<|eos|>")
    prompt, _, demo = body.partition("\n")
    value = eval(prompt.removeprefix("Compute: "), {"__builtins__": {}})  # pylint: disable=eval-used
    assert demo.endswith(f"<|answer|>{value}")


def test_the_first_canonical_examples_use_the_canonical_demonstration(tiny_data):
  """data.canonical_examples: a curriculum, one path first, sampled paths afterwards."""
  data = dataclasses.replace(_math_only(tiny_data, diversity=1.0, spacing=0.5),
                             canonical_examples=2 * tiny_data.num_train)
  tok = data.loaded_tokenizer
  it = iter(pipeline.sft_dataset(data, batch_size=4, seq_len=64, packing=False))
  texts = [tok.decode(row, strip_pad=True) for _ in range(data.num_train)
           for row in next(it)["tokens"]]  # four epochs: two canonical, two sampled
  demos = [t.removeprefix("<|bos|>").removesuffix("<|eos|>").partition("\n") for t in texts]
  half = len(demos) // 2
  seen_early = {}
  for prompt, _, demo in demos[:half]:
    seen_early.setdefault(prompt, set()).add(demo)
  assert all(len(d) == 1 for d in seen_early.values())  # one path per problem
  late_new = sum(demo not in seen_early.get(prompt, set()) for prompt, _, demo in demos[half:])
  assert late_new > len(demos[half:]) // 4
