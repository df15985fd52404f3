r"""Numbers bound to their artifacts: every measured number in a generated block of README.md
or docs/ records the artifact file and the key it was printed from.

A renderer reads an artifact through `Source`, whose nodes remember their key path, and
prints a number with `Block.num(node, fmt)`. The block's text then carries a placeholder that
`Block.text()` replaces by the formatted number, noting its offset. `render_all` writes, beside
the blocks, a manifest (docs/numbers.json): for each document and block, each cited number's
offset, printed text, artifact, key path, format and (for a number derived from several
values) the operation.

`verify` checks a manifest against the documents and the artifacts without the renderers:
each cited text is where the manifest says, equals its value recomputed from the artifact key
at the printed format, and no decimal number in a block (nor any ratio "1.23x" or percentage)
is left uncited. tests/test_doc_numbers.py runs it, and shows that it fails when one
artifact value moves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(REPO, "docs", "numbers.json")

# The operations a derived number may apply to its values (the verifier's own copies live in
# `_OPS` too: they are the definitions, short enough to read).
_OPS: dict[str, Callable[..., float]] = {
    "value": lambda x: x,
    "minutes": lambda s: s / 60.0,
    "sum": lambda *xs: sum(xs),
    "sum_minutes": lambda *xs: sum(xs) / 60.0,
    "mean": lambda *xs: sum(xs) / len(xs),
    "min": lambda *xs: min(xs),
    "max": lambda *xs: max(xs),
    "ratio": lambda a, b: a / b,
    "difference": lambda a, b: a - b,
    "count": lambda *xs: len(xs),
}

# What counts as a measured number in a block: a decimal, or an integer printed as a ratio
# ("2x") or a percentage, except the confidence level of an interval ("95%").
_NUMBER = re.compile(
    r"(?<![\w.])[+\-−]?\d[\d,]*\.\d+|(?<![\w.])[+\-−]?(?!95%)\d+(?=x\b|%)")


def _load_json(path: str) -> Any:
  with open(os.path.join(REPO, path)) as f:
    return json.load(f)


class Source:
  """A node of a JSON artifact that remembers where it came from: `src["a"][0]` is the node
  at key path ("a", 0) of the artifact file `src.artifact` (relative to the repository)."""

  def __init__(self, artifact: str, tree: Any = None, path: tuple = ()):
    self.artifact = artifact
    self.value = _load_json(artifact) if tree is None and not path else tree
    self.path = path

  def __getitem__(self, key) -> "Source":
    return Source(self.artifact, self.value[key], self.path + (key,))

  def get(self, key, default=None):
    if isinstance(self.value, dict) and key in self.value:
      return self[key]
    return default

  def __contains__(self, key) -> bool:
    return key in self.value

  def __iter__(self) -> Iterator:
    """Keys of a dict; child nodes of a list."""
    if isinstance(self.value, dict):
      return iter(self.value)
    return (self[i] for i in range(len(self.value)))

  def __len__(self) -> int:
    return len(self.value)

  def items(self):
    return ((k, self[k]) for k in self.value)

  def __bool__(self) -> bool:
    return bool(self.value)

  def __repr__(self) -> str:
    return f"Source({self.artifact}:{'/'.join(map(str, self.path))})"


@dataclasses.dataclass
class Cited:
  """One printed number: its text at `offset` of its block is `format(op(values), fmt)`,
  where the values sit at `keys` of `artifact`."""
  offset: int
  text: str
  artifact: str
  keys: list
  fmt: str
  op: str = "value"


class Block:
  """A generated block under construction: `num` returns a placeholder for the formatted
  number and records its source; `text(body)` substitutes them and fixes their offsets."""

  def __init__(self):
    self._pending: list[tuple[str, Cited]] = []

  def num(self, *nodes: Source, fmt: str, op: str = "value") -> str:
    if not nodes or not all(isinstance(n, Source) for n in nodes):
      raise TypeError(f"Block.num takes artifact nodes (Source), got {nodes!r}")
    artifacts = {n.artifact for n in nodes}
    if len(artifacts) != 1:
      raise ValueError(f"one cited number comes from one artifact, got {sorted(artifacts)}")
    values = [float(n.value) for n in nodes]
    text = format(_OPS[op](*values), fmt)
    marker = f"\x00{len(self._pending)}\x00"
    self._pending.append((marker, Cited(-1, text, nodes[0].artifact,
                                        [list(n.path) for n in nodes], fmt, op)))
    return marker

  def quote(self, text: str, source: str) -> str:
    """A number that is not measured here (the paper's "up to 1.8x"), with what it quotes."""
    marker = f"\x00{len(self._pending)}\x00"
    self._pending.append((marker, Cited(-1, text, "", [], "", f"quote: {source}")))
    return marker

  def text(self, body: str) -> tuple[str, list[Cited]]:
    """The block's final text and its citations, in order of their offsets."""
    cited, out, pos = [], [], 0
    by_marker = dict(self._pending)
    for m in re.finditer(r"\x00\d+\x00", body):
      out.append(body[pos:m.start()])
      c = dataclasses.replace(by_marker[m.group(0)])
      c.offset = sum(len(s) for s in out)
      out.append(c.text)
      cited.append(c)
      pos = m.end()
    out.append(body[pos:])
    return "".join(out), cited


# ----------------------------------------------------------------------------- blocks in files


def blocks_of(text: str) -> dict[str, str]:
  """{name: the block's text} of every generated block in `text`."""
  return {m.group(1): m.group(2) or "" for m in re.finditer(
      r"<!-- generated:(\w+) -->\n(?:(.*?)\n)?<!-- /generated:\1 -->", text, re.S)}


def with_blocks(text: str, blocks: dict[str, str], what: str) -> str:
  for name, body in blocks.items():
    pattern = re.compile(
        rf"(<!-- generated:{name} -->\n)(?:(.*?)\n)?(<!-- /generated:{name} -->)", re.S)
    if not pattern.search(text):
      raise ValueError(f"{what} has no <!-- generated:{name} --> block")
    text = pattern.sub(
        lambda m, body=body: m.group(1) + (body + "\n" if body else "") + m.group(3), text)
  return text


# A renderer returns {block name: (text, citations)} for one document.
Renderer = Callable[[], dict[str, tuple[str, list[Cited]]]]


def render_all(renderers: dict[str, Renderer]) -> tuple[dict[str, dict[str, str]], dict]:
  """({document: {block: text}}, the manifest) of every document's renderer."""
  texts, manifest = {}, {}
  for doc, renderer in renderers.items():
    rendered = renderer()
    texts[doc] = {name: text for name, (text, _) in rendered.items()}
    manifest[doc] = {name: [dataclasses.asdict(c) for c in cited]
                     for name, (text, cited) in rendered.items()}
  return texts, manifest


# ----------------------------------------------------------------------------- the check


def _lookup(tree: Any, keys: list) -> Any:
  for k in keys:
    tree = tree[k]
  return tree


def verify(manifest: dict, read_doc: Callable[[str], str] | None = None,
           load: Callable[[str], Any] | None = None) -> list[str]:
  """Problems of `manifest` against the documents and artifacts (empty when it holds):
  a cited number not where the manifest puts it, not equal to its artifact value at the
  printed format, or a number in a block that nothing cites."""
  read_doc = read_doc or (lambda p: open(os.path.join(REPO, p)).read())
  cache: dict[str, Any] = {}
  load = load or _load_json

  def artifact(path):
    if path not in cache:
      cache[path] = load(path)
    return cache[path]

  problems = []
  for doc, blocks in manifest.items():
    present = blocks_of(read_doc(doc))
    for name, cited in blocks.items():
      where = f"{doc} block {name}"
      if name not in present:
        problems.append(f"{where}: missing from the document")
        continue
      body = present[name]
      covered = []
      for c in cited:
        start, text = c["offset"], c["text"]
        if body[start:start + len(text)] != text:
          problems.append(f"{where}: {text!r} is not at offset {start} (the block changed by "
                          "hand, or is stale: python experiments/key_results.py --write)")
          continue
        covered.append((start, start + len(text)))
        if c["op"].startswith("quote: "):
          continue
        try:
          values = [float(_lookup(artifact(c["artifact"]), k)) for k in c["keys"]]
          printed = format(_OPS[c["op"]](*values), c["fmt"])
        except (KeyError, IndexError, TypeError, ValueError, OSError) as e:
          problems.append(f"{where}: {text!r} from {c['artifact']} {c['keys']}: {e!r}")
          continue
        if printed != text:
          problems.append(f"{where}: prints {text!r} but {c['artifact']} "
                          f"{c['op']}{tuple(c['keys'])} gives {printed!r}")
      for m in _NUMBER.finditer(body):
        s, e = m.span()
        s += body[s] in "+-−"  # a sign may be the template's
        if not any(a <= s and e <= b for a, b in covered):
          problems.append(f"{where}: the number {m.group(0)!r} (offset {s}) cites no artifact")
  return problems

