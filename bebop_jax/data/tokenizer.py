"""Tokenizers: the interface the project codes against, a character-level one (the default)
and a Hugging Face `tokenizer.json` one, and how a config's data section names one.

Every tokenizer implements `BaseTokenizer`: the task markers of `bebop_jax.tasks.base`
(`SPECIAL_MARKERS`: '<|pad|>', '<|bos|>', '<|eos|>', ...) are single tokens with ids the
interface reports, `encode` is exact (`decode(encode(s)) == s` for the task texts), and
`vocab_size` is the model-facing size: the used ids rounded up to a multiple of
`pad_to_multiple` (128 by default, which shards evenly over tensor axes of 2, 4 or 8 and fills
MXU/tensor-core tiles). The unused ids above the real ones decode to ''; model output is
hostile input, so `decode` never raises for ids in [0, vocab_size).

`Tokenizer` (alias `CharTokenizer`): the special markers first (pad = 0, bos = 1, eos = 2,
...), then '\\n' and the printable ASCII characters (32..126). A character outside the set is
an error at encode time, never dropped.

`HFTokenizer`: a Hugging Face `tokenizer.json` (the `tokenizers` package, imported on first
use). A marker the file lacks is added on load as a special token after its vocabulary, so a
stock Qwen3 tokenizer.json works as it is.

Chat format (`HFTokenizer(path, chat_format=True)`, `data.chat_format`): the checkpoint's own
chat template (tokenizer_config.json beside tokenizer.json, rendered by data/chat.py) frames
every task prompt as a system and a user message followed by the opening of an assistant
turn (`encode_prompt`); a completion writes its answer marker as plain text (a line
"Answer: ...", base.PLAIN_ANSWER) and ends with the template's end-of-turn token, which is
then `eos_id` (`encode_completion`). So a single-turn task needs no token the pretrained
model has not seen. Multi-turn tasks keep their call and result markers (added tokens).

There is no active tokenizer: code that tokenizes is handed one. `load_tokenizer(spec)` gives
it (a config's data settings load theirs, `DataSettings.loaded_tokenizer`: `data.tokenizer`
and `data.chat_format`); a stage gets it once and passes it down (rollout engines, decoding
episodes, the SFT features), and the grain pipelines, which take the data settings, use
their `loaded_tokenizer`.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import os
import re
from typing import Iterable, Sequence

import numpy as np

from bebop_jax.tasks import base

CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))
# The system message of every chat-format prompt.
CHAT_SYSTEM = ("You are a careful assistant. Work step by step, then give the final answer "
               f"on its own line, starting with '{base.PLAIN_ANSWER.strip()}'.")
CHAR = "char"  # the `data.tokenizer` spec of the character-level tokenizer
HF_FILE = "tokenizer.json"


class UnknownTokenError(ValueError):
  """Raised by `token_id` for a piece that is not a token, and by `encode` for text that has
  no tokens."""


class UnknownCharacterError(UnknownTokenError):
  """Raised by `encode` for a character outside the tokenizer's character set."""


def _padded(num_used: int, pad_to_multiple: int) -> int:
  if pad_to_multiple < 1:
    raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
  return -(-num_used // pad_to_multiple) * pad_to_multiple


def _as_ids(ids: Iterable[int] | np.ndarray) -> np.ndarray:
  return np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)


class BaseTokenizer(abc.ABC):
  """What the project needs of a tokenizer; call sites see only this.

  Attributes:
    specials: the task markers (`base.SPECIAL_MARKERS`), each one token.
    num_used: ids [0, num_used) are tokens; [num_used, vocab_size) are unused and decode to ''.
    vocab_size: the model-facing size, num_used rounded up to `pad_to_multiple`.
    fingerprint: names what the ids mean ('char', or 'hf-' and a hash of the tokenizer.json),
      for cache keys of tokenized data: ids of one tokenizer are garbage to another.
  """

  specials: tuple[str, ...]
  num_used: int
  vocab_size: int
  fingerprint: str

  pad_id = property(lambda self: self.token_id(base.PAD_MARKER))
  bos_id = property(lambda self: self.token_id(base.BOS_MARKER))
  eos_id = property(lambda self: self.token_id(base.EOS_MARKER))
  answer_id = property(lambda self: self.token_id(base.ANSWER_MARKER))
  call_start_id = property(lambda self: self.token_id(base.CALL_START))
  call_end_id = property(lambda self: self.token_id(base.CALL_END))
  result_start_id = property(lambda self: self.token_id(base.RESULT_START))
  result_end_id = property(lambda self: self.token_id(base.RESULT_END))

  @abc.abstractmethod
  def token_id(self, piece: str) -> int:
    """The id of one token (a special marker, or a piece of the vocabulary)."""

  def encode_prompt(self, prompt: str) -> list[int]:
    """Token ids a task prompt conditions the policy on: bos, then the prompt."""
    return self.encode(prompt, add_bos=True)

  def encode_completion(self, text: str) -> list[int]:
    """Token ids of a completion in the task text format, ending with eos."""
    return self.encode(text, add_eos=True)

  @abc.abstractmethod
  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Token ids of `text`; markers such as '<|call|>' become one token each."""

  @abc.abstractmethod
  def decode(self, ids: Iterable[int] | np.ndarray, *, strip_pad: bool = False) -> str:
    """Text of `ids`. Unused padding ids decode to ''; out-of-range ids are a ValueError."""

  def _check_range(self, arr: np.ndarray) -> None:
    if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
      raise ValueError(f"token ids must be in [0, {self.vocab_size}), got range "
                       f"[{arr.min()}, {arr.max()}]")

  def decode_batch(self, ids: np.ndarray, lengths: Sequence[int] | None = None) -> list[str]:
    """Decodes each row of a [B, L] array, up to `lengths[b]` tokens when given (else with
    the pad tokens removed)."""
    ids = np.asarray(ids)
    if lengths is None:
      return [self.decode(row, strip_pad=True) for row in ids]
    return [self.decode(row[:n]) for row, n in zip(ids, lengths)]


class Tokenizer(BaseTokenizer):
  """Character-level tokenizer; special markers such as '<|eos|>' are single tokens."""

  fingerprint = CHAR

  def __init__(self, pad_to_multiple: int = 128):
    self.specials = base.SPECIAL_MARKERS
    self._pieces = list(self.specials) + list(CHARACTERS)
    self._id = {piece: i for i, piece in enumerate(self._pieces)}
    self.num_used = len(self._pieces)
    self.vocab_size = _padded(self.num_used, pad_to_multiple)
    # Longest markers first so that no marker is split into a shorter one.
    self._split = re.compile("(" + "|".join(
        re.escape(m) for m in sorted(self.specials, key=len, reverse=True)) + ")")
    self._decode_table = np.array(self._pieces + [""] * (self.vocab_size - self.num_used),
                                  dtype=object)

  def __repr__(self) -> str:
    return f"Tokenizer(char, vocab_size={self.vocab_size})"

  def token_id(self, piece: str) -> int:
    """The id of one character or special marker."""
    if piece not in self._id:
      raise UnknownCharacterError(f"{piece!r} is not a token of the vocabulary")
    return self._id[piece]

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Token ids of `text`; markers such as '<|call|>' become one token each.

    Raises:
      UnknownCharacterError: naming the first character outside the character set, its
        position, and the allowed set.
    """
    ids = [self.bos_id] if add_bos else []
    for i, part in enumerate(self._split.split(text)):
      if i % 2:  # a marker
        ids.append(self._id[part])
        continue
      for c in part:
        tid = self._id.get(c)
        if tid is None or len(c) != 1:
          pos = text.find(c)
          raise UnknownCharacterError(
              f"character {c!r} (U+{ord(c):04X}) at position {pos} of the text is not in the "
              "tokenizer's character set: allowed are '\\n', printable ASCII (U+0020..U+007E) "
              f"and the markers {', '.join(self.specials)}")
        ids.append(tid)
    if add_eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids: Iterable[int] | np.ndarray, *, strip_pad: bool = False) -> str:
    """Text of `ids`. Unused padding ids decode to ''; out-of-range ids are an error."""
    arr = _as_ids(ids)
    self._check_range(arr)
    if strip_pad:
      arr = arr[arr != self.pad_id]
    return "".join(self._decode_table[arr].tolist())


CharTokenizer = Tokenizer

# Texts every HFTokenizer must round-trip exactly (all characters of the task texts, the
# markers next to text, spaces and newlines at the ends and repeated), checked on load: a
# tokenizer that normalizes, strips or adds spaces would silently change what rewards read.
_PROBES = (
    CHARACTERS,
    "".join(base.SPECIAL_MARKERS) + " " + " x ".join(base.SPECIAL_MARKERS) + " ",
    " leading space, two  spaces,\n\n  a blank line and a trailing space ",
    "\n<|call|>get(a, b)<|/call|>\n<|result|> 26 <|/result|><|answer|>-3<|eos|>",
    "<|call| <|/call <|result||> |> <| <|answer|",  # partial markers are plain text
)


class HFTokenizer(BaseTokenizer):
  """A Hugging Face `tokenizer.json`, with the task markers as added special tokens.

  On load every marker of `base.SPECIAL_MARKERS` becomes an added special token that is
  matched in the raw text before normalization and pre-tokenization (so it is always one
  token, never split and never merged with its neighbours) and strips no spaces around it: a
  marker the file lacks is appended after its ids (in `SPECIAL_MARKERS` order), one it has
  keeps its id. The file's own special tokens stay as they are; its truncation, padding and
  post-processor (e.g. a BOS template) are not applied: `encode` adds bos / eos only when
  asked. The file on disk is not changed.

  Decoding keeps special tokens and applies only the file's decoder, so nothing strips or
  adds spaces for byte-level BPE tokenizers (Qwen3, GPT-2 style); a tokenizer that does not
  round-trip the probe texts exactly (lower-casing, a decoder that cleans up spaces) is
  rejected on load with a ValueError.
  """

  def __init__(self, path: str, pad_to_multiple: int = 128, chat_format: bool = False):
    import tokenizers  # pylint: disable=g-import-not-at-top  # only when an HF file is chosen
    self.path = resolve_tokenizer_path(path)
    with open(self.path, "rb") as f:
      raw = f.read()
    try:
      tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # pylint: disable=broad-except  # the library raises plain Exception
      raise ValueError(f"{self.path} is not a Hugging Face tokenizer.json the tokenizers "
                       f"package can load: {e}") from e
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = False  # markers in the text are markers
    tok.add_special_tokens([
        tokenizers.AddedToken(m, special=True, normalized=False, single_word=False,
                              lstrip=False, rstrip=False) for m in base.SPECIAL_MARKERS])
    self._tok = tok
    self.specials = base.SPECIAL_MARKERS
    self._marker_ids = {m: tok.token_to_id(m) for m in self.specials}
    self.num_used = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    self.vocab_size = _padded(self.num_used, pad_to_multiple)
    self.fingerprint = "hf-" + hashlib.sha256(raw).hexdigest()[:16]
    self._unk_id = self._find_unk_id(raw)
    self._check_round_trip()
    self.chat_template = self.end_of_turn = None
    if chat_format:
      self._load_chat_format()

  def _load_chat_format(self) -> None:
    from bebop_jax.data import chat  # pylint: disable=g-import-not-at-top
    try:
      template = chat.load_template(os.path.dirname(self.path))
      end = chat.end_of_turn(template)
    except chat.ChatTemplateError as e:
      raise chat.ChatTemplateError(
          f"the chat format (data.chat_format) needs a chat template in "
          f"{chat.CONFIG_FILE} beside {self.path}: {e}") from e
    if len(self.encode(end)) != 1:
      raise ValueError(f"{self.path}: the chat template's end of turn {end!r} is not one "
                       f"token (got {self.encode(end)}), so decoding cannot stop at it")
    self.chat_template, self.end_of_turn = template, end
    self._eot_id = self.encode(end)[0]
    self.fingerprint += "-chat-" + hashlib.sha256(
        (template + CHAT_SYSTEM).encode()).hexdigest()[:8]

  @property
  def eos_id(self) -> int:  # chat format: the template's end of turn
    return self._eot_id if self.end_of_turn else self.token_id(base.EOS_MARKER)

  def encode_prompt(self, prompt: str) -> list[int]:
    """Chat format: the template's rendering of a system message (CHAT_SYSTEM) and the
    prompt as the user message, with the opening of the assistant turn. Otherwise bos and
    the prompt."""
    if not self.end_of_turn:
      return super().encode_prompt(prompt)
    from bebop_jax.data import chat  # pylint: disable=g-import-not-at-top
    text = chat.render(self.chat_template,
                       [{"role": "system", "content": CHAT_SYSTEM},
                        {"role": "user", "content": prompt.rstrip("\n")}],
                       add_generation_prompt=True)
    return self.encode(text)

  def encode_completion(self, text: str) -> list[int]:
    """Chat format: the answer marker written as plain text (base.PLAIN_ANSWER) and the
    template's end of turn as eos. Otherwise the text and eos."""
    if not self.end_of_turn:
      return super().encode_completion(text)
    return self.encode(to_plain_answer(text)) + [self._eot_id]

  def __repr__(self) -> str:
    return (f"HFTokenizer({self.path!r}, {self.num_used} tokens, "
            f"vocab_size={self.vocab_size})")

  def _find_unk_id(self, raw: bytes) -> int | None:
    """The model's unknown-token id (None: it has none, e.g. byte-level BPE)."""
    model = json.loads(raw).get("model") or {}
    if isinstance(model.get("unk_id"), int):  # Unigram
      return model["unk_id"]
    unk = model.get("unk_token")
    return self._tok.token_to_id(unk) if isinstance(unk, str) else None

  def _check_round_trip(self) -> None:
    for marker, tid in self._marker_ids.items():
      if tid is None or self.encode(marker) != [tid]:
        raise ValueError(f"{self.path}: the marker {marker!r} does not encode to one token "
                         f"(got {self.encode(marker)})")
    for probe in _PROBES:
      try:
        got = self.decode(self.encode(probe))
      except UnknownTokenError as e:
        got = f"<encode failed: {e}>"
      if got != probe:
        raise ValueError(
            f"{self.path} does not round-trip text exactly: decode(encode({probe!r})) gave "
            f"{got!r}; bebop_jax needs decode(encode(s)) == s (rewards read decoded text), "
            "which byte-level BPE tokenizers (ByteLevel pre-tokenizer and decoder, as in "
            "Qwen3 or GPT-2) give; normalizers that change ASCII text, decoders that strip or "
            "clean up spaces and unknown-token models do not")

  def token_id(self, piece: str) -> int:
    """The id of a special marker, or of a piece of the vocabulary in the file's own
    spelling (a byte-level BPE writes a leading space as 'Ġ')."""
    tid = self._marker_ids.get(piece)
    if tid is None:
      tid = self._tok.token_to_id(piece)
    if tid is None:
      raise UnknownTokenError(f"{piece!r} is not a token of the vocabulary of {self.path}")
    return tid

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Token ids of `text`; markers such as '<|call|>' become one token each.

    Raises:
      UnknownTokenError: for text the vocabulary has no token for (only tokenizers with an
        unknown token; byte-level BPE encodes every string), naming its position.
    """
    enc = self._tok.encode(text, add_special_tokens=False)
    ids = enc.ids
    if self._unk_id is not None and self._unk_id in ids:
      start, end = enc.offsets[ids.index(self._unk_id)]
      raise UnknownTokenError(
          f"text {text[start:end]!r} at position {start} has no token in {self.path} (it "
          "would encode to the unknown token)")
    if add_bos:
      ids.insert(0, self.bos_id)
    if add_eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids: Iterable[int] | np.ndarray, *, strip_pad: bool = False) -> str:
    """Text of `ids`. Unused padding ids decode to ''; out-of-range ids are an error. Any
    sequence of valid ids decodes (bytes that are not UTF-8 become U+FFFD)."""
    arr = _as_ids(ids).reshape(-1)
    self._check_range(arr)
    if strip_pad:
      arr = arr[arr != self.pad_id]
    arr = arr[arr < self.num_used]  # unused padding ids
    ids = arr.tolist()
    try:
      return self._tok.decode(ids, skip_special_tokens=False)
    except Exception:  # pylint: disable=broad-except  # hostile ids never raise
      return "".join(self._decode_one(i) for i in ids)

  def _decode_one(self, tid: int) -> str:
    try:
      return self._tok.decode([tid], skip_special_tokens=False)
    except Exception:  # pylint: disable=broad-except
      return ""


def resolve_tokenizer_path(spec: str) -> str:
  """The absolute path of the tokenizer.json that `spec` (the file, or a directory holding
  one; '~' expanded) names.

  Raises:
    FileNotFoundError: naming the path when there is no such file.
  """
  path = os.path.expanduser(spec)
  shown = repr(spec) if path == spec else f"{spec!r} (= {path!r})"
  if os.path.isdir(path):
    path = os.path.join(path, HF_FILE)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"the directory {shown} holds no {HF_FILE}")
  elif not os.path.isfile(path):
    raise FileNotFoundError(f"there is no file or directory {shown}")
  return os.path.abspath(path)


def to_plain_answer(text: str) -> str:
  """`text` with its answer marker written as plain text: base.PLAIN_ANSWER at the start of
  a line (the chat format's answer line)."""
  head, marker, tail = text.partition(base.ANSWER_MARKER)
  if not marker:
    return text
  sep = "" if not head or head.endswith("\n") else "\n"
  return head + sep + base.PLAIN_ANSWER + tail


@functools.lru_cache(maxsize=8)
def _load_hf(path: str, mtime_ns: int, size: int, pad_to_multiple: int,
             chat_format: bool) -> HFTokenizer:
  del mtime_ns, size  # cache keys only: a changed file is loaded again
  return HFTokenizer(path, pad_to_multiple=pad_to_multiple, chat_format=chat_format)


def load_tokenizer(spec: str, *, pad_to_multiple: int = 128,
                   chat_format: bool = False) -> BaseTokenizer:
  """The tokenizer `data.tokenizer` names: 'char' (the shared character-level tokenizer
  with the default padding), or the path of a Hugging Face tokenizer.json or of a directory
  holding one (loaded once per file version), in the chat format when `chat_format`.

  Raises:
    FileNotFoundError: for a path with no tokenizer.json, naming it.
    ValueError: for a file that does not load or does not round-trip text exactly, or (chat
      format) a directory without a usable chat template.
  """
  if not isinstance(spec, str) or not spec:
    raise ValueError(f"a tokenizer spec is {CHAR!r} or the path of a {HF_FILE} (or of a "
                     f"directory holding one), got {spec!r}")
  if spec == CHAR:
    if chat_format:
      raise ValueError("the chat format needs a Hugging Face tokenizer with a chat template; "
                       f"the {CHAR!r} tokenizer has none")
    return _char_default() if pad_to_multiple == 128 else Tokenizer(pad_to_multiple)
  path = resolve_tokenizer_path(spec)
  st = os.stat(path)
  return _load_hf(path, st.st_mtime_ns, st.st_size, pad_to_multiple, bool(chat_format))


@functools.cache
def _char_default() -> Tokenizer:
  """The one character-level tokenizer with the default padding (it holds no state)."""
  return Tokenizer()
