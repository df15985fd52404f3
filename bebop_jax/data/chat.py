"""Chat templates: a tokenizer's own Jinja template turns messages into the model's text.

    template = chat.load_template("runs/smollm2_hf")        # tokenizer_config.json's
    prompt = chat.render(template, [{"role": "system", "content": "..."},
                                    {"role": "user", "content": "What is 2 + 3?"}],
                         add_generation_prompt=True)
    end = chat.end_of_turn(template)                         # "<|im_end|>" for ChatML

Rendering uses jinja2's immutable sandbox, as Hugging Face tokenizers do, so a template from
a checkpoint cannot reach Python objects. Nothing here hand-writes a chat format: the text
comes from the template alone.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Mapping, Sequence

CONFIG_FILE = "tokenizer_config.json"
ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
  """A template that cannot be loaded or rendered (names what and why)."""


def load_template(path: str) -> str:
  """The chat template of a tokenizer directory (its tokenizer_config.json) or file."""
  file = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
  try:
    with open(file) as f:
      template = json.load(f).get("chat_template")
  except (OSError, json.JSONDecodeError) as e:
    raise ChatTemplateError(f"cannot read a chat template from {file}: {e}") from e
  if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
    template = next((t.get("template") for t in template if t.get("name") == "default"),
                    None)
  if not isinstance(template, str) or not template:
    raise ChatTemplateError(f"{file} has no chat_template")
  return template


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
  from jinja2 import TemplateError  # pylint: disable=g-import-not-at-top
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=g-import-not-at-top

  def raise_exception(message):
    raise ChatTemplateError(f"the chat template refused the messages: {message}")

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"])
  env.globals["raise_exception"] = raise_exception
  try:
    return env.from_string(template)
  except TemplateError as e:
    raise ChatTemplateError(f"the chat template does not parse: {e}") from e


def render(template: str, messages: Sequence[Mapping[str, str]], *,
           add_generation_prompt: bool = False, **extra) -> str:
  """The text of `messages` ({"role", "content"} each, roles in ROLES) under `template`;
  `add_generation_prompt` appends the opening of an assistant turn."""
  for i, m in enumerate(messages):
    if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
      raise ChatTemplateError(f"message {i} is {dict(m)!r}: each needs a role in {ROLES} "
                              "and a string content")
  from jinja2 import TemplateError  # pylint: disable=g-import-not-at-top
  try:
    return _compiled(template).render(messages=[dict(m) for m in messages],
                                      add_generation_prompt=add_generation_prompt, **extra)
  except TemplateError as e:
    raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e


def end_of_turn(template: str) -> str:
  """The text that closes an assistant turn under `template`: what the template writes after
  an assistant message's content (before any newline)."""
  marker = "\x00CONTENT\x00"
  text = render(template, [{"role": "user", "content": "u"},
                           {"role": "assistant", "content": marker}])
  after = text.split(marker, 1)[1] if marker in text else ""
  end = after.split("\n", 1)[0]
  if not end:
    raise ChatTemplateError("the chat template writes nothing after an assistant message, "
                            "so a completion has no end-of-turn marker")
  return end
