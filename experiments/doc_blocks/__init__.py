"""Renderers of the generated blocks of docs/ pages, one module per page.

Each module names its page (`DOCUMENT = "docs/<page>.md"`) and has `render()`, returning
{block name: (text, citations)} built with experiments.doc_numbers (Source, Block), so that
every measured number in its blocks records its artifact and key. experiments/key_results.py
writes them all with README.md's (`python experiments/key_results.py --write`).
"""

import importlib
import pkgutil


def renderers() -> dict:
  """{page: render} of every module here."""
  out = {}
  for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
    module = importlib.import_module(f"{__name__}.{info.name}")
    out[module.DOCUMENT] = module.render
  return out
