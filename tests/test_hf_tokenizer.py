"""HFTokenizer on small byte-level BPE tokenizers trained here on our own task text, and the
choice of the tokenizer by `data.tokenizer` (the data settings' `loaded_tokenizer`), handed
to the code that tokenizes: there is no active tokenizer to set or leave behind."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from bebop_jax.stages import config as config_lib
from bebop_jax.data import pipeline
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.data.tokenizer import HFTokenizer, Tokenizer
from bebop_jax.tasks import base, get_task
from bebop_jax.stages import drafter_data

MARKERS = base.SPECIAL_MARKERS
ID_NAMES = ("pad_id", "bos_id", "eos_id", "answer_id", "call_start_id", "call_end_id",
            "result_start_id", "result_end_id")
# The knobs that give demonstrations forks and spaced writing ("3 + 4", "get(a, b)").
KNOBS = {"math": dict(diversity=0.5, spacing=0.5, restate=0.3),
         "code": dict(diversity=0.5, spacing=0.5),
         "agentic": dict(diversity=0.5, spacing=0.5, confirm=0.3)}
# Qwen2/Qwen3's pre-tokenizer regex.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def task_texts(seeds: range) -> list[str]:
  """bos prompt demonstration eos of each task, as the SFT pipeline writes them, with a
  sampled solution path (forks, spaced style) for odd seeds."""
  out = []
  for name, knobs in KNOBS.items():
    task = get_task(name, **knobs)
    for seed in seeds:
      ex = task.sample(seed)
      demo = task.demonstration(ex, seed) if seed % 2 else ex.demonstration
      out.append(base.BOS_MARKER + ex.prompt + demo + base.EOS_MARKER)
  return out


def train(path, *, with_markers: bool, vocab_size: int = 600, qwen_like: bool = False) -> str:
  """A byte-level BPE tokenizer.json trained on task text (markers as special tokens, first,
  or not at all); `qwen_like`: Qwen3's normalizer, pre-tokenizer and own special tokens."""
  tok = tokenizers.Tokenizer(models.BPE())
  if qwen_like:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  else:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(MARKERS) if with_markers else [],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(task_texts(range(200)), trainer)
  if qwen_like:
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=False)])
    tok.enable_truncation(16)  # must not apply to our encode
  path = os.path.join(str(path), "tokenizer.json")
  tok.save(path)
  return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("tokenizers")
  out = {}
  for name, kwargs in (("with_markers", dict(with_markers=True)),
                       ("without_markers", dict(with_markers=False)),
                       ("qwen_like", dict(with_markers=False, qwen_like=True))):
    os.makedirs(root / name)
    out[name] = train(root / name, **kwargs)
  return out


HELD_OUT = task_texts(range(10_000, 10_060))


@pytest.mark.parametrize("name", ["with_markers", "without_markers", "qwen_like"])
def test_exact_round_trip_of_held_out_task_texts(files, name):
  tok = HFTokenizer(files[name])
  agentic = [t for t in HELD_OUT if base.CALL_START in t and base.RESULT_START in t]
  assert len(agentic) >= 20  # multi-turn transcripts with tool calls and results
  assert any("get(" in t and ", " in t for t in agentic)  # spaced style
  extra = [" leading and trailing ", "two  spaces\n\n\nand newlines\n", "", "\n",
           "<|call|><|/call|><|result|> <|/result|>", "x<|answer|> 3 <|eos|><|pad|><|pad|>"]
  for text in HELD_OUT + extra:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.num_used for i in ids)
    assert ids.count(tok.call_start_id) == text.count(base.CALL_START)
    assert ids.count(tok.result_end_id) == text.count(base.RESULT_END)
  text = HELD_OUT[0]
  assert len(tok.encode(text)) < len(text) // 2  # it is a real subword tokenizer
  ids = tok.encode("ab", add_bos=True, add_eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  assert tok.decode(ids) == "<|bos|>ab<|eos|>"


@pytest.mark.parametrize("name", ["with_markers", "without_markers", "qwen_like"])
def test_markers_are_single_tokens_with_the_reported_ids(files, name):
  tok = HFTokenizer(files[name])
  ids = [getattr(tok, attr) for attr in ID_NAMES]
  assert ids == [tok.token_id(m) for m in MARKERS] and len(set(ids)) == len(MARKERS)
  assert tok.specials == MARKERS
  for marker, tid in zip(MARKERS, ids):
    assert tok.encode(marker) == [tid]
    # never merged with neighbours, never stripping their spaces
    for left, right in (("x", "y"), (" ", " "), ("|", "|"), ("<|", "|>"), ("\n", "1")):
      got = tok.encode(left + marker + right)
      assert got.count(tid) == 1
      assert got == tok.encode(left) + [tid] + tok.encode(right)
  assert tok.encode("<|call|><|/call|>") == [tok.call_start_id, tok.call_end_id]
  # A partial marker is plain text.
  for partial in ("<|call|", "<|/call|", "|result|>", "<|answer", "<| eos |>"):
    got = tok.encode(partial)
    assert not set(got) & set(ids) and tok.decode(got) == partial
  if name == "with_markers":  # the trainer put them first: the char tokenizer's ids
    assert ids == list(range(len(MARKERS)))


def test_markers_missing_from_the_file_are_added_on_load(files):
  path = files["without_markers"]
  raw = tokenizers.Tokenizer.from_file(path)
  assert all(raw.token_to_id(m) is None for m in MARKERS)
  size = raw.get_vocab_size(with_added_tokens=True)
  before = open(path, encoding="utf-8").read()
  tok = HFTokenizer(path)
  assert [getattr(tok, attr) for attr in ID_NAMES] == list(range(size, size + len(MARKERS)))
  assert tok.num_used == size + len(MARKERS)
  assert open(path, encoding="utf-8").read() == before  # the file is not changed
  # Qwen3-style file: its own special tokens keep their ids, the markers come after them.
  qwen = tokenizers.Tokenizer.from_file(files["qwen_like"])
  own = [qwen.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                        "<think>")]
  tok = HFTokenizer(files["qwen_like"])
  assert [tok.token_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                    "<think>")] == own
  assert tok.pad_id == max(own) + 1 and tok.result_end_id == tok.num_used - 1
  text = "<|im_start|>" + HELD_OUT[-1] + "<|im_end|>"
  assert len(text) > 100 and tok.decode(tok.encode(text)) == text  # no truncation at 16


def test_a_marker_the_file_has_with_other_options_is_made_special(tmp_path, files):
  """A marker that strips the spaces next to it (rstrip/lstrip), or is plain text, keeps
  its id but becomes a special token that strips nothing."""
  tok = tokenizers.Tokenizer.from_file(files["without_markers"])
  tok.add_tokens([tokenizers.AddedToken(base.CALL_START, lstrip=True, rstrip=True,
                                        special=False)])
  old_id = tok.token_to_id(base.CALL_START)
  assert tok.decode(tok.encode("a <|call|> b").ids) != "a <|call|> b"
  path = str(tmp_path / "tokenizer.json")
  tok.save(path)
  hf = HFTokenizer(path)
  assert hf.call_start_id == old_id
  assert hf.decode(hf.encode("a <|call|> b")) == "a <|call|> b"


def test_vocab_is_padded(files):
  tok = HFTokenizer(files["without_markers"])
  assert tok.vocab_size % 128 == 0 and tok.num_used <= tok.vocab_size < tok.num_used + 128
  assert HFTokenizer(files["without_markers"], pad_to_multiple=1).vocab_size == tok.num_used
  assert HFTokenizer(files["without_markers"], pad_to_multiple=1000).vocab_size == 1000
  with pytest.raises(ValueError, match="pad_to_multiple must be >= 1"):
    HFTokenizer(files["without_markers"], pad_to_multiple=0)


def test_decode_of_padding_ids_out_of_range_ids_and_hostile_ids(files):
  tok = HFTokenizer(files["with_markers"])
  assert tok.vocab_size > tok.num_used  # 600 used ids -> 640
  padding = list(range(tok.num_used, tok.vocab_size))
  assert tok.decode(padding) == ""
  ab = tok.encode("ab")
  assert tok.decode([ab[0], padding[0]] + ab[1:] + [padding[-1]]) == "ab"
  for bad in ([tok.vocab_size], [-1], [5, tok.vocab_size + 100]):
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {tok.vocab_size}\)"):
      tok.decode(bad)
  # Model output is hostile: any ids in [0, vocab_size) decode, broken UTF-8 included.
  rng = np.random.default_rng(0)
  for _ in range(300):
    ids = rng.integers(0, tok.vocab_size, size=rng.integers(0, 80))
    assert isinstance(tok.decode(ids), str)
    assert isinstance(tok.decode(ids.tolist(), strip_pad=True), str)
  byte_ids = [tok.token_id(c) for c in pre_tokenizers.ByteLevel.alphabet()]
  assert isinstance(tok.decode(byte_ids[::-1] + [tok.call_start_id] + byte_ids), str)
  # strip_pad and decode_batch, as for the char tokenizer
  x, y = tok.encode("x"), tok.encode("y")
  rows = np.array([x + y + [tok.pad_id] * 2, y + [tok.pad_id] * 3])
  assert tok.decode(rows[0], strip_pad=True) == "xy"
  assert tok.decode_batch(rows) == ["xy", "y"]
  assert tok.decode_batch(rows, lengths=[1, 1]) == ["x", "y"]


def test_token_id_of_an_unknown_piece_is_an_error(files):
  tok = HFTokenizer(files["with_markers"])
  with pytest.raises(ValueError, match="is not a token of the vocabulary"):
    tok.token_id("<|no such marker|>")
  assert tok.token_id("Ġ") == tok.encode(" ")[0]  # the file's own spelling of a space


def test_a_tokenizer_that_does_not_round_trip_is_rejected(tmp_path):
  tok = tokenizers.Tokenizer(models.BPE())
  tok.normalizer = normalizers.Lowercase()
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(task_texts(range(20)), trainers.BpeTrainer(
      vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  tok.save(str(tmp_path / "tokenizer.json"))
  with pytest.raises(ValueError, match="does not round-trip text exactly"):
    HFTokenizer(str(tmp_path))
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
    HFTokenizer(str(tmp_path / "bad.json"))


def test_load_tokenizer(files, tmp_path):
  char = tokenizer_lib.load_tokenizer("char")
  assert isinstance(char, Tokenizer) and tokenizer_lib.load_tokenizer("char") is char
  assert config_lib.settings(config_lib.base_config()).data.loaded_tokenizer is char  # default
  path = files["with_markers"]
  tok = tokenizer_lib.load_tokenizer(path)
  assert tokenizer_lib.load_tokenizer(os.path.dirname(path)) is tok  # the directory; cached
  assert tok.fingerprint.startswith("hf-") and tok.fingerprint != "char"
  assert tok.fingerprint != tokenizer_lib.load_tokenizer(files["without_markers"]).fingerprint
  with pytest.raises(FileNotFoundError, match="no file or directory"):
    tokenizer_lib.load_tokenizer(str(tmp_path / "missing.json"))
  with pytest.raises(FileNotFoundError, match="holds no tokenizer.json"):
    tokenizer_lib.load_tokenizer(str(tmp_path))


def _config(spec: str, vocab_size: int = 640):
  """The base config with `data.tokenizer=spec` (our tokenizers pad to 640 ids)."""
  config = config_lib.base_config()
  config.data.tokenizer = spec
  config.model.vocab_size = vocab_size
  return config


def test_the_config_chooses_the_tokenizer(files):
  char = tokenizer_lib.load_tokenizer("char")
  assert config_lib.base_config().data.tokenizer == "char"
  config = _config(files["with_markers"])
  assert config_lib.validate(config) is config  # checks it (loading the file), sets nothing
  hf = config_lib.settings(config).data.loaded_tokenizer
  assert isinstance(hf, HFTokenizer) and hf.path == files["with_markers"]
  assert config_lib.settings(config).data.loaded_tokenizer is hf  # loaded once
  assert hf.encode("ab") != char.encode("ab")
  # the code handed it uses it: the SFT features and their tool-result mask
  prompt, demo = "What is x?\n", "<|call|>get(x,age)<|/call|><|result|>7<|/result|><|answer|>7"
  feats = pipeline.sft_features(prompt, demo, hf)
  assert feats["tokens"].tolist() == hf.encode(prompt, add_bos=True) + hf.encode(
      demo, add_eos=True)
  result = hf.encode("<|result|>7<|/result|>")
  masked = [t for t, m in zip(feats["tokens"], feats["loss_mask"]) if not m]
  assert masked == hf.encode(prompt, add_bos=True) + result
  # No tokenizer is taken from anywhere else: it is a required argument.
  with pytest.raises(TypeError, match="tokenizer"):
    pipeline.sft_features(prompt, demo)  # pylint: disable=no-value-for-parameter
  with pytest.raises(TypeError, match="tokenizer"):
    pipeline.tool_result_mask(feats["tokens"])  # pylint: disable=no-value-for-parameter
  # Validating the HF config changed nothing for a char config.
  assert config_lib.settings(config_lib.base_config()).data.loaded_tokenizer is char
  assert pipeline.sft_features(prompt, demo, char)["tokens"].tolist() == char.encode(
      prompt, add_bos=True) + char.encode(demo, add_eos=True)


def test_data_tokenizer_errors_name_the_key_and_the_path(files, tmp_path):
  missing = str(tmp_path / "nowhere" / "tokenizer.json")
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(_config(missing))
  assert str(e.value).startswith(f"config.data.tokenizer={missing!r} is not allowed: ")
  assert "no such file or directory" in str(e.value)
  with pytest.raises(config_lib.ConfigError, match="holds no tokenizer.json"):
    config_lib.validate(_config(str(tmp_path)))
  vocab = HFTokenizer(files["with_markers"]).vocab_size
  with pytest.raises(config_lib.ConfigError, match=rf"config.model.vocab_size=128 .*must be "
                     rf">= the tokenizer's {vocab} \(data.tokenizer="):
    config_lib.validate(_config(files["with_markers"], vocab_size=128))


def test_stages_run_tokenizes_with_the_config_tokenizer_and_leaves_nothing_behind(
    files, tiny_data_config, tmp_path, monkeypatch):
  """stages.run hands each stage the config; what a stage tokenizes (here the RL prompt
  batches of the data section) is in the config's data.tokenizer, and a run with an HF
  config leaves nothing behind: a char run after it tokenizes in the char vocabulary."""
  from bebop_jax import stages  # pylint: disable=g-import-not-at-top
  from bebop_jax.tasks import Example  # pylint: disable=g-import-not-at-top
  seen = []

  def data_stage(config, workdir):
    del workdir
    batch = next(iter(pipeline.rl_prompt_dataset(config_lib.settings(config).data,
                                                 prompts_per_batch=2, group_size=1,
                                                 max_prompt_len=512)))
    prompts = [Example.from_json(x).prompt for x in batch["example_json"]]
    seen.append([row[:n].tolist() for row, n in zip(batch["prompt_tokens"],
                                                    batch["prompt_lengths"])])
    seen.append(prompts)

  monkeypatch.setitem(stages.STAGE_FNS, "data", data_stage)
  runs = {}
  for name, spec in (("hf", files["without_markers"]), ("char", "char")):
    config = _config(spec)
    config.data = tiny_data_config.copy_and_resolve_references()
    config.data.tokenizer = spec
    config_lib.validate(config)
    (tmp_path / name).mkdir()
    stages.run(config, str(tmp_path / name), release_compiled=False)
    tokens, prompts = seen[-2:]
    tok = tokenizer_lib.load_tokenizer(spec)
    assert tokens == [tok.encode_prompt(p) for p in prompts]
    runs[spec] = tokens
  hf = tokenizer_lib.load_tokenizer(files["without_markers"])
  assert isinstance(hf, HFTokenizer) and runs[files["without_markers"]] != runs["char"]
  # The module holds no tokenizer of its own that a run could switch.
  assert not [name for name, value in vars(tokenizer_lib).items()
              if isinstance(value, tokenizer_lib.BaseTokenizer)]


def test_cached_rollouts_are_keyed_by_the_tokenizer(files):
  """The MTP stage caches rollout token ids (bebop_jax/stages/mtp.py); the TFDS datasets hold text."""
  keys = {spec: drafter_data.store_key(_config(spec))
          for spec in ("char", files["with_markers"], files["without_markers"])}
  assert len(set(keys.values())) == 3
  assert drafter_data.store_key(config_lib.base_config()) == keys["char"]


def test_the_char_tokenizer_implements_the_interface():
  tok = tokenizer_lib.load_tokenizer("char")
  assert isinstance(tok, tokenizer_lib.BaseTokenizer) and tok.fingerprint == "char"
  assert [getattr(tok, attr) for attr in ID_NAMES] == list(range(len(MARKERS)))
  assert json.dumps(tok.specials) == json.dumps(list(MARKERS))


# ------------------------------------------------------------------ chat format

# ChatML, as SmolLM2's and Qwen's checkpoints carry it.
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_dir(files, tmp_path_factory):
  """The Qwen-like tokenizer (it has <|im_start|> and <|im_end|>) with a ChatML template."""
  root = tmp_path_factory.mktemp("chat")
  with open(files["qwen_like"]) as f, open(root / "tokenizer.json", "w") as g:
    g.write(f.read())
  (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
  return str(root)


def test_the_chat_format_renders_prompts_through_the_template(chat_dir):
  from bebop_jax.data import chat  # pylint: disable=g-import-not-at-top
  tok = tokenizer_lib.load_tokenizer(chat_dir, chat_format=True)
  plain = tokenizer_lib.load_tokenizer(chat_dir)
  assert tok.eos_id == tok.encode("<|im_end|>")[0] != plain.eos_id
  assert tok.fingerprint != plain.fingerprint  # cached token ids differ
  ex = get_task("math").sample(5)
  want = chat.render(CHATML, [{"role": "system", "content": tokenizer_lib.CHAT_SYSTEM},
                              {"role": "user", "content": ex.prompt.rstrip("\n")}],
                     add_generation_prompt=True)
  assert tok.decode(tok.encode_prompt(ex.prompt)) == want
  assert want.endswith("<|im_start|>assistant\n") and ex.prompt.rstrip() in want
  # Without the chat format, bos and the prompt as before.
  assert plain.encode_prompt(ex.prompt) == plain.encode(ex.prompt, add_bos=True)


@pytest.mark.parametrize("name", ["math", "code", "agentic"])
def test_chat_completions_answer_in_plain_text_and_end_at_the_end_of_turn(chat_dir, name):
  tok = tokenizer_lib.load_tokenizer(chat_dir, chat_format=True)
  task = get_task(name, **KNOBS[name])
  added = {tok.token_id(m) for m in MARKERS}
  for seed in range(6):
    ex = task.sample(seed)
    demo = task.demonstration(ex, seed)
    ids = tok.encode_completion(demo)
    assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
    text = tok.decode(ids[:-1])
    assert base.ANSWER_MARKER not in text and "\n" + base.PLAIN_ANSWER in "\n" + text
    assert task.reward(ex, text) == 1.0  # the reward reads the plain answer line
    if name != "agentic":  # single-turn: no token the pretrained model has not seen
      assert not added & set(ids) and not added & set(tok.encode_prompt(ex.prompt))
    # The SFT features train on the assistant turn only, its end of turn included.
    feats = pipeline.sft_features(ex.prompt, demo, tok)
    n = len(tok.encode_prompt(ex.prompt))
    assert feats["tokens"].tolist() == tok.encode_prompt(ex.prompt) + ids
    assert not feats["loss_mask"][:n].any() and feats["loss_mask"][-1]


def test_chat_format_errors_are_named(files, chat_dir):
  with pytest.raises(ValueError, match="has no chat_template|cannot read a chat template"):
    tokenizer_lib.load_tokenizer(files["qwen_like"], chat_format=True)
  with pytest.raises(ValueError, match="the 'char' tokenizer has none"):
    tokenizer_lib.load_tokenizer("char", chat_format=True)
  config = _config(files["qwen_like"])
  config.data.chat_format = True
  with pytest.raises(config_lib.ConfigError, match=r"config.data.tokenizer=.* the chat "
                     r"format \(data.chat_format\) needs a chat template"):
    config_lib.validate(config)
  config = _config(chat_dir)
  config.data.chat_format = True
  config_lib.validate(config)
  assert config_lib.settings(config).data.loaded_tokenizer.end_of_turn == "<|im_end|>"


def test_plain_answer_lines_are_found_where_the_marker_is():
  find = base.extract_final_answer
  assert find("=9\nAnswer: 9") == find("=9\n<|answer|>9") == "9"
  assert find("Answer:9") == "9" and find("a\nAnswer: 1\nb") == "1\nb"
  assert find("Answers: 3") is None and find("x Answer: 3") is None  # not at a line start
  assert find("Answer: 1\n<|answer|>2") == "1\n<|answer|>2"  # the first one counts
  assert find("<|answer|>2\nAnswer: 1") == "2\nAnswer: 1"
  assert find("\nAnswer: " + "7" * 300) is None  # bounded, as with the marker
