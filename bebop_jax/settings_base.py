"""Typed settings: frozen dataclasses that check themselves, the error they raise, and the
reference rows docs/configs.md is generated from.

A config section (`config.rl`, `config.sft.optim`, ...) is a frozen `Section` dataclass whose
fields are declared with `setting(default, doc, allowed=..., check=...)`: `check` a
predicate of the value, `allowed` what it allows in words (the error text and the
reference's). A section's `__post_init__` runs every field's check, then (in a subclass) its
checks of several fields; checks that span sections are
`bebop_jax.settings.check_across_sections`. Errors name the config key and the value:

    config.rl.group_size=1 is not allowed: must be >= 2 with rl.advantage='grpo': ...

`build(cls, mapping, key)` makes a section from a mapping (a ConfigDict section), nested
sections from their sub-mappings. `reference_rows(cls)` lists its keys with type, doc and
allowed values.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any, Callable, Mapping, NoReturn


class ConfigError(ValueError):
  """A config value or key is not allowed."""


def fail(key: str, value: Any, allowed: str) -> NoReturn:
  raise ConfigError(f"config.{key}={value!r} is not allowed: {allowed}")


# ----------------------------------------------------------------------------- predicates

def is_int(value: Any, bools: bool = False) -> bool:
  """An int (a bool too with `bools`: True is 1, as the checks before these accepted)."""
  return isinstance(value, int) and (bools or not isinstance(value, bool))


def is_number(value: Any) -> bool:
  return isinstance(value, (int, float))


def int_at_least(low: int, bools: bool = False) -> Callable[[Any], bool]:
  return lambda v: is_int(v, bools) and v >= low


def number_at_least(low: float, strict: bool = False) -> Callable[[Any], bool]:
  return lambda v: is_number(v) and (v > low if strict else v >= low)


def in_unit_interval(v: Any) -> bool:
  """In (0, 1] (a top-p, a smoothing weight)."""
  return is_number(v) and 0 < v <= 1


def tuple_of(item: Callable[[Any], bool], non_empty: bool = True) -> Callable[[Any], bool]:
  return lambda v: (isinstance(v, (tuple, list)) and (bool(v) or not non_empty)
                    and all(item(x) for x in v))


# ----------------------------------------------------------------------------- fields

def setting(default: Any, doc: str, *, allowed: str = "",
            check: Callable[[Any], bool] | None = None) -> Any:
  """A documented field: `doc` what it means, `allowed` what `check` accepts, in words
  (the error text and the reference's; "" where the field has no check of its own)."""
  return dataclasses.field(default=default,
                           metadata={"doc": doc, "allowed": allowed, "check": check})


def positive_int(default: int, doc: str) -> Any:
  return setting(default, doc, allowed="must be a positive int", check=int_at_least(1))


def count(default: int, doc: str, note: str = "", bools: bool = True) -> Any:
  """An int >= 0; `note` e.g. " (0 = off)"."""
  return setting(default, doc, allowed=f"must be an int >= 0{note}",
                 check=int_at_least(0, bools))


def flag(default: bool, doc: str, allowed: str = "must be True or False") -> Any:
  return setting(default, doc, allowed=allowed, check=lambda v: isinstance(v, bool))


def choice(default: str, doc: str, options: tuple[str, ...]) -> Any:
  return setting(default, doc, allowed=f"one of {tuple(options)}",
                 check=lambda v: v in tuple(options))


def subset(default: tuple[str, ...], doc: str, options: tuple[str, ...],
           non_empty: bool = True) -> Any:
  """A tuple of names from `options` (non_empty False: () allowed, meaning none)."""
  allowed = (f"a non-empty tuple from {options}" if non_empty
             else f"a tuple from {options} (() = none)")
  return setting(default, doc, allowed=allowed,
                 check=tuple_of(lambda m: m in options, non_empty))


def nested(factory: Callable[[], Any]) -> Any:
  """A field holding a sub-section (documented by its class)."""
  return dataclasses.field(default_factory=factory, metadata={"section": True})


# ----------------------------------------------------------------------------- sections

@dataclasses.dataclass(frozen=True)
class Section:
  """A checked config section. `key` is where it sits in the config ("sft.optim"), named
  by its errors; it defaults to the class's KEY."""
  KEY = ""
  key: str = dataclasses.field(default="", kw_only=True, repr=False, compare=False)

  def __post_init__(self):
    if not self.key:
      object.__setattr__(self, "key", self.KEY)
    check_fields(self)

  def where(self, name: str) -> str:
    """The config key of field `name`."""
    return f"{self.key}.{name}" if self.key else name

  def fail(self, name: str, allowed: str) -> NoReturn:
    fail(self.where(name), getattr(self, name), allowed)


def check_fields(section: Section) -> None:
  """Each field's own check, in field order."""
  for f in dataclasses.fields(section):
    check = f.metadata.get("check")
    if check is None:
      continue
    value = getattr(section, f.name)
    try:
      ok = check(value)
    except (TypeError, ValueError):
      ok = False
    if not ok:
      section.fail(f.name, f.metadata["allowed"])


def _section_type(tp: Any) -> type[Section] | None:
  return tp if isinstance(tp, type) and issubclass(tp, Section) else None


def build(cls: type[Section], values: Mapping[str, Any], key: str, **given: Any) -> Section:
  """`cls` from `values` (a mapping with one entry per field; nested sections are mappings
  too, a dict of sections a mapping of them by name, each given its `name`) at config key
  `key`; `given` fields are taken as they are."""
  hints = typing.get_type_hints(cls)
  kwargs = dict(given)
  for f in dataclasses.fields(cls):
    if not f.init or f.name == "key" or f.name in kwargs:
      continue
    tp, value, where = hints[f.name], values[f.name], f"{key}.{f.name}" if key else f.name
    if _section_type(tp):
      value = build(tp, value, where)
    elif typing.get_origin(tp) is dict:
      item = _section_type(typing.get_args(tp)[1])
      value = ({name: build(item, value[name], f"{where}.{name}", name=name)
                for name in value.keys()} if item else {k: value[k] for k in value.keys()})
    kwargs[f.name] = value
  return cls(**kwargs, key=key)


# ----------------------------------------------------------------------------- reference

@dataclasses.dataclass(frozen=True)
class Row:
  """One key of the config reference."""
  type: str
  doc: str
  allowed: str


def reference_rows(cls: type, prefix: str = "") -> dict[str, Row]:
  """{config key: Row} for the documented fields of `cls` and its nested sections."""
  rows = {}
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    key = f"{prefix}{f.name}"
    if _section_type(hints[f.name]):
      rows.update(reference_rows(hints[f.name], key + "."))
    elif "doc" in f.metadata:
      rows[key] = Row(str(f.type), f.metadata["doc"], f.metadata["allowed"])
  return rows


def docstring_fields(obj: Any) -> dict[str, str]:
  """The `name: text` entries of a Google-style docstring's field lists (Attributes:,
  Difficulty knobs:, ...), continuation lines joined."""
  fields, name = {}, None
  for line in (inspect.getdoc(obj) or "").splitlines():
    entry = re.match(r"^  (\w+): (.*)$", line)
    if entry:
      name = entry.group(1)
      fields[name] = entry.group(2).strip()
    elif name and line.startswith("    "):
      fields[name] += " " + line.strip()
    else:
      name = None
  return {name: text[:-1] if text.endswith(".") else text for name, text in fields.items()}


def signature_rows(cls: type, prefix: str, allowed: str) -> dict[str, Row]:
  """Rows for the keyword parameters of `cls(...)` with defaults: the type from the
  annotation, the doc from the class docstring's field list."""
  docs = docstring_fields(cls)
  return {f"{prefix}{name}": Row(str(p.annotation), docs.get(name, ""), allowed)
          for name, p in inspect.signature(cls).parameters.items()
          if p.default is not inspect.Parameter.empty}
