"""The numbers of README.md and docs/ are bound to their artifacts: the generated blocks are
what experiments/key_results.py renders, docs/numbers.json cites each of their numbers by
artifact file and key, and each recomputes from that key at its printed precision
(experiments/doc_numbers.verify, which does not use the renderers). Outside the blocks the
pages hold no measured number."""

import copy
import json
import os
import re

import pytest

from experiments import doc_numbers, key_results

REPO = doc_numbers.REPO


@pytest.fixture(scope="module")
def rendered():
  return doc_numbers.render_all(key_results.DOCUMENTS)


@pytest.fixture(scope="module")
def manifest():
  with open(doc_numbers.MANIFEST) as f:
    return json.load(f)


def test_the_blocks_and_the_manifest_are_what_the_renderers_write(rendered, manifest):
  texts, fresh = rendered
  for doc, blocks in texts.items():
    with open(os.path.join(REPO, doc)) as f:
      present = doc_numbers.blocks_of(f.read())
    for name, text in blocks.items():
      assert present.get(name) == text, (
          f"{doc}'s {name} block is stale: python experiments/key_results.py --write")
  assert fresh == manifest, "docs/numbers.json is stale: python experiments/key_results.py --write"
  assert {"README.md", "docs/results.md"} <= set(manifest)


def test_every_cited_number_recomputes_from_its_artifact_key(manifest):
  assert doc_numbers.verify(manifest) == []
  cited = [c for blocks in manifest.values() for cs in blocks.values() for c in cs]
  assert len(cited) > 100
  assert {c["artifact"] for c in cited} >= {"docs/artifacts/smollm2_main_job.json",
                                            "docs/artifacts/main_job.json"}


def _first(manifest, fmt=".3f"):
  for doc, blocks in manifest.items():
    for name, cited in blocks.items():
      for i, c in enumerate(cited):
        if c["fmt"] == fmt and c["op"] == "value":
          return doc, name, i, c
  raise AssertionError("no cited number to perturb")


def test_a_perturbed_artifact_value_fails_the_check(manifest):
  doc, name, _, c = _first(manifest)
  real = doc_numbers._load_json  # pylint: disable=protected-access

  def load(path):
    tree = real(path)
    if path == c["artifact"]:
      tree = copy.deepcopy(tree)
      node = tree
      for k in c["keys"][0][:-1]:
        node = node[k]
      node[c["keys"][0][-1]] += 0.002  # two units of the printed precision
    return tree

  problems = doc_numbers.verify(manifest, load=load)
  assert problems and all(c["artifact"] in p for p in problems), problems
  assert any(f"prints {c['text']!r}" in p for p in problems), problems


def test_a_hand_edited_or_uncited_number_fails_the_check(manifest):
  doc, name, _, c = _first(manifest)
  with open(os.path.join(REPO, doc)) as f:
    text = f.read()
  body = doc_numbers.blocks_of(text)[name]
  start = body.index(c["text"]) if body[c["offset"]:].startswith(c["text"]) else None
  assert start is not None
  # A digit changed by hand where the manifest cites the number.
  edited = body[:c["offset"]] + c["text"][:-1] + str((int(c["text"][-1]) + 1) % 10) + \
      body[c["offset"] + len(c["text"]):]
  problems = doc_numbers.verify(
      {doc: {name: manifest[doc][name]}},
      read_doc=lambda p: doc_numbers.with_blocks(text, {name: edited}, doc))
  assert any("is not at offset" in p for p in problems), problems
  # A measured-looking number added to the block's end that nothing cites.
  for extra in ("0.42", "1.5x", "37%"):
    problems = doc_numbers.verify(
        {doc: {name: manifest[doc][name]}},
        read_doc=lambda p, e=extra: doc_numbers.with_blocks(text, {name: body + f" ({e})"}, doc))
    assert problems == [f"{doc} block {name}: the number {extra.rstrip('x%')!r} (offset "
                        f"{len(body) + 2}) cites no artifact"], problems


# Pages written whole by a generator: reproduce.py's results pages (their numbers come from
# the findings' json beside them) and the configuration reference (config defaults).
GENERATED_PAGES = ("docs/results.md", "docs/results_real.md", "docs/configs.md")


def _prose(text: str) -> str:
  """`text` without its generated blocks, fenced code, inline code and link targets."""
  text = re.sub(r"<!-- generated:(\w+) -->\n.*?<!-- /generated:\1 -->", "", text, flags=re.S)
  text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  text = re.sub(r"^    .*$", "", text, flags=re.M)  # indented code
  text = re.sub(r"`[^`\n]*`", "", text)
  return re.sub(r"\]\([^)]*\)", "]", text)


def test_the_pages_hold_no_hand_written_measurement():
  pages = ["README.md"] + sorted(
      os.path.join("docs", p) for p in os.listdir(os.path.join(REPO, "docs"))
      if p.endswith(".md") and os.path.join("docs", p) not in GENERATED_PAGES)
  found = {}
  for page in pages:
    with open(os.path.join(REPO, page)) as f:
      prose = _prose(f.read())
    numbers = [m.group(0) for m in doc_numbers._NUMBER.finditer(prose)]  # pylint: disable=protected-access
    if numbers:
      found[page] = numbers
  assert not found, ("measured-looking numbers outside generated blocks (render them in a "
                     f"block from their artifact, experiments/doc_blocks): {found}")


@pytest.mark.parametrize("page", ["docs/results.md", "docs/results_real.md"])
def test_the_results_pages_are_the_sections_of_their_findings_json(page):
  """reproduce.py writes each results page whole; each finding's section on it is what its
  json beside the page (docs/results*/<finding>.json) renders, so the page is not edited by
  hand or stale."""
  from experiments.findings import common  # pylint: disable=g-import-not-at-top
  assets = os.path.splitext(os.path.basename(page))[0]
  with open(os.path.join(REPO, page)) as f:
    text = f.read()
  names = sorted(p for p in os.listdir(os.path.join(REPO, "docs", assets))
                 if p.endswith(".json") and p != "stage_seconds.json")
  # Every finding section on the page has its json (a page made with --only holds some).
  assert len(names) == text.count("\n**Verdict: ") >= 1
  for name in names:
    with open(os.path.join(REPO, "docs", assets, name)) as f:
      finding = common.Finding(**json.load(f))
    section = common.section_markdown(finding, figure_dir=assets)
    assert section in text, f"{page}'s section of {name} is not what its json renders"
