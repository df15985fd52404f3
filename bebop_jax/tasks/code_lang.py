"""A tiny list-processing language for the code task: syntax tree, canonical formatting,
tokenizer and parser (the interpreter is `bebop_jax.tasks.code_interp`).

A program is a pipeline of stages applied left to right to a list of ints:

  map(x*2+1) | filter(x%3!=0) | sort | take(3)

Grammar (whitespace between tokens is ignored):

  program := stage ('|' stage)*             a reducer may only be the last stage
  stage   := 'map' '(' expr ')'             each x := expr            (x in scope)
           | 'filter' '(' cond ')'          keep x where cond         (x in scope)
           | 'sort' | 'rev'                 ascending sort / reverse
           | 'take' '(' INT ')'             first n elements (xs[:n])
           | 'drop' '(' INT ')'             all but the first n (xs[n:])
           | 'sum' | 'max' | 'min' | 'len'  reducers: list -> int
           | 'fold' '(' expr ',' expr ')'   a := init; for x in xs: a := step (reducer;
                                            init has no variables, step sees a and x)
  expr    := expr 'or' expr | expr 'and' expr | 'not' expr
           | expr CMP expr | expr ('+'|'-') expr | expr ('*'|'//'|'%') expr
           | '-' expr | INT | 'x' | 'a' | '(' expr ')'
           | 'until' '(' cond ',' expr ')'  from x, while not cond: x := expr; value x

Precedence, loosest first (as in Python): or, and, not, comparisons (< > <= >= == !=, not
chainable), + -, * // %, unary -. Binary operators are left-associative. Expressions are
statically typed: arithmetic and comparisons take ints, and/or/not take bools, map/fold
need an int, filter/until conditions a bool.

Parse bounds (module constants, overridable per call): source length (MAX_SOURCE_CHARS),
nesting depth of the parser and height of expression trees (MAX_DEPTH), integer magnitude
(MAX_INT; literals are range-checked by their digit count before conversion; the
interpreter checks every arithmetic result against the same bound).

No Python eval/exec/compile is used: the parser is hand-written recursive descent with
precedence climbing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

# Bounds.
MAX_SOURCE_CHARS = 512
MAX_DEPTH = 32
MAX_INT = 10**9

INT = "int"
BOOL = "bool"

REDUCER_NAMES = ("sum", "max", "min", "len")
STAGE_NAMES = ("map", "filter", "sort", "rev", "take", "drop") + REDUCER_NAMES + ("fold",)
KEYWORDS = frozenset(STAGE_NAMES + ("until", "and", "or", "not", "x", "a"))


class ParseError(ValueError):
  """The source is not a valid program (syntax, types, scope or a bound)."""


# ----------------------------------------------------------------------------------------
# Syntax tree.


@dataclasses.dataclass(frozen=True)
class Num:
  value: int


@dataclasses.dataclass(frozen=True)
class Var:
  name: str  # "x" or "a"


@dataclasses.dataclass(frozen=True)
class Neg:
  operand: "Expr"


@dataclasses.dataclass(frozen=True)
class BinOp:
  op: str  # + - * // %
  left: "Expr"
  right: "Expr"


@dataclasses.dataclass(frozen=True)
class Compare:
  op: str  # < > <= >= == !=
  left: "Expr"
  right: "Expr"


@dataclasses.dataclass(frozen=True)
class BoolOp:
  op: str  # and, or
  left: "Expr"
  right: "Expr"


@dataclasses.dataclass(frozen=True)
class Not:
  operand: "Expr"


@dataclasses.dataclass(frozen=True)
class Until:
  cond: "Expr"
  body: "Expr"


Expr = Union[Num, Var, Neg, BinOp, Compare, BoolOp, Not, Until]


@dataclasses.dataclass(frozen=True)
class Map:
  expr: Expr


@dataclasses.dataclass(frozen=True)
class Filter:
  cond: Expr


@dataclasses.dataclass(frozen=True)
class Sort:
  pass


@dataclasses.dataclass(frozen=True)
class Rev:
  pass


@dataclasses.dataclass(frozen=True)
class Take:
  n: int


@dataclasses.dataclass(frozen=True)
class Drop:
  n: int


@dataclasses.dataclass(frozen=True)
class Reduce:
  op: str  # one of REDUCER_NAMES


@dataclasses.dataclass(frozen=True)
class Fold:
  init: Expr
  step: Expr


Stage = Union[Map, Filter, Sort, Rev, Take, Drop, Reduce, Fold]
Value = Union[int, list]  # a program's input/output: list[int] or (after a reducer) int


def is_reducer(stage: Stage) -> bool:
  """Returns whether `stage` turns a list into an int (and so must end a pipeline)."""
  return isinstance(stage, (Reduce, Fold))


@dataclasses.dataclass(frozen=True)
class Program:
  """A parsed pipeline; str() gives its canonical source."""
  stages: tuple[Stage, ...]

  @property
  def returns_int(self) -> bool:
    """Returns whether the program ends with a reducer."""
    return bool(self.stages) and is_reducer(self.stages[-1])

  def __str__(self) -> str:
    return format_program(self)


# ----------------------------------------------------------------------------------------
# Formatting (canonical source text).

_OR_PREC, _AND_PREC, _NOT_PREC, _CMP_PREC, _ADD_PREC, _MUL_PREC, _NEG_PREC, _ATOM_PREC = (
    1, 2, 3, 4, 5, 6, 7, 8)
_BINARY_PREC = {"or": _OR_PREC, "and": _AND_PREC,
                "<": _CMP_PREC, ">": _CMP_PREC, "<=": _CMP_PREC, ">=": _CMP_PREC,
                "==": _CMP_PREC, "!=": _CMP_PREC,
                "+": _ADD_PREC, "-": _ADD_PREC, "*": _MUL_PREC, "//": _MUL_PREC,
                "%": _MUL_PREC}
_ARITH_OPS = frozenset(("+", "-", "*", "//", "%"))
_CMP_OPS = frozenset(("<", ">", "<=", ">=", "==", "!="))


def _wrap(text: str, prec: int, min_prec: int) -> str:
  """Returns `text` parenthesised iff its precedence is below `min_prec`."""
  return text if prec >= min_prec else f"({text})"


def _format(node: Expr) -> tuple[str, int]:
  """Returns (source text, precedence of its outermost operator) of an expression."""
  if isinstance(node, Num):
    return (str(node.value), _ATOM_PREC) if node.value >= 0 else (str(node.value), _NEG_PREC)
  if isinstance(node, Var):
    return node.name, _ATOM_PREC
  if isinstance(node, Neg):
    text, prec = _format(node.operand)
    return "-" + _wrap(text, prec, _NEG_PREC), _NEG_PREC
  if isinstance(node, Not):
    text, prec = _format(node.operand)
    return "not " + _wrap(text, prec, _NOT_PREC), _NOT_PREC
  if isinstance(node, Until):
    return f"until({format_expr(node.cond)}, {format_expr(node.body)})", _ATOM_PREC
  if isinstance(node, (BinOp, Compare, BoolOp)):
    prec = _BINARY_PREC[node.op]
    left, left_prec = _format(node.left)
    right, right_prec = _format(node.right)
    # Left-associative: a right operand of equal precedence needs parentheses; comparisons
    # don't chain, so neither operand of one may be a bare comparison.
    left = _wrap(left, left_prec, prec + 1 if prec == _CMP_PREC else prec)
    right = _wrap(right, right_prec, prec + 1)
    sep = f" {node.op} " if node.op in ("and", "or") else node.op
    return left + sep + right, prec
  raise TypeError(f"not an expression: {node!r}")


def format_expr(node: Expr) -> str:
  """Returns the canonical source text of an expression."""
  return _format(node)[0]


def format_stage(stage: Stage) -> str:
  """Returns the canonical source text of one stage, e.g. `map(x*2)`."""
  if isinstance(stage, Map):
    return f"map({format_expr(stage.expr)})"
  if isinstance(stage, Filter):
    return f"filter({format_expr(stage.cond)})"
  if isinstance(stage, Sort):
    return "sort"
  if isinstance(stage, Rev):
    return "rev"
  if isinstance(stage, Take):
    return f"take({stage.n})"
  if isinstance(stage, Drop):
    return f"drop({stage.n})"
  if isinstance(stage, Reduce):
    return stage.op
  if isinstance(stage, Fold):
    return f"fold({format_expr(stage.init)}, {format_expr(stage.step)})"
  raise TypeError(f"not a stage: {stage!r}")


def format_program(program: Program) -> str:
  """Returns the canonical source text of a program, stages joined by ' | '."""
  return " | ".join(format_stage(stage) for stage in program.stages)


def format_value(value: Value) -> str:
  """Returns a list as `[1,-2,3]` (no spaces) and an int as its decimal text."""
  if isinstance(value, list):
    return "[" + ",".join(str(v) for v in value) + "]"
  return str(value)


# ----------------------------------------------------------------------------------------
# Tokenizer.


@dataclasses.dataclass(frozen=True)
class Token:
  kind: str  # "int", "name", "op" or "end"
  text: str
  pos: int


_TWO_CHAR_OPS = frozenset(("//", "<=", ">=", "==", "!="))
_ONE_CHAR_OPS = frozenset("()|,+-*%<>")
_WHITESPACE = frozenset(" \t\r\n")
_DIGITS = frozenset("0123456789")
_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_NAME_CHARS = _NAME_START | _DIGITS


def _scan(source: str, start: int, chars: frozenset[str]) -> int:
  """Returns the index just past the run of `chars` that starts at `start`."""
  end = start
  while end < len(source) and source[end] in chars:
    end += 1
  return end


def tokenize(source: str) -> list[Token]:
  """Returns the tokens of `source`, ending with an "end" token.

  Linear in len(source). Raises:
    ParseError: on a character that starts no token.
  """
  tokens = []
  i = 0
  while i < len(source):
    c = source[i]
    if c in _WHITESPACE:
      i += 1
    elif c in _DIGITS:
      end = _scan(source, i, _DIGITS)
      tokens.append(Token("int", source[i:end], i))
      i = end
    elif c in _NAME_START:
      end = _scan(source, i, _NAME_CHARS)
      tokens.append(Token("name", source[i:end], i))
      i = end
    elif source[i:i + 2] in _TWO_CHAR_OPS:
      tokens.append(Token("op", source[i:i + 2], i))
      i += 2
    elif c in _ONE_CHAR_OPS:
      tokens.append(Token("op", c, i))
      i += 1
    else:
      raise ParseError(f"unexpected character {ascii(c)} at {i}")
  tokens.append(Token("end", "", len(source)))
  return tokens


# ----------------------------------------------------------------------------------------
# Parser.

_Parsed = tuple[Expr, str, int]  # (node, INT or BOOL, tree height)
_NO_VARS: frozenset[str] = frozenset()
_X = frozenset(("x",))
_AX = frozenset(("a", "x"))


class _Parser:
  """Recursive descent over a token list; every nesting level is counted and bounded."""

  def __init__(self, tokens: list[Token], max_depth: int, max_int: int):
    self._tokens = tokens
    self._i = 0
    self._depth = 0
    self._max_depth = max_depth
    self._max_int = max_int

  # Token helpers.

  def _peek(self) -> Token:
    return self._tokens[self._i]

  def _next(self) -> Token:
    tok = self._tokens[self._i]
    if tok.kind != "end":
      self._i += 1
    return tok

  def _is(self, text: str) -> bool:
    tok = self._peek()
    return tok.kind in ("op", "name") and tok.text == text

  def _expect(self, text: str) -> Token:
    tok = self._next()
    if tok.kind not in ("op", "name") or tok.text != text:
      raise ParseError(f"expected {text!r} at {tok.pos}, got {tok.text or 'end'!r}")
    return tok

  def _enter(self, tok: Token) -> None:
    self._depth += 1
    if self._depth > self._max_depth:
      raise ParseError(f"nesting deeper than {self._max_depth} at {tok.pos}")

  def _leave(self) -> None:
    self._depth -= 1

  def _height(self, height: int, tok: Token) -> int:
    if height > self._max_depth:
      raise ParseError(f"expression deeper than {self._max_depth} at {tok.pos}")
    return height

  # Grammar.

  def program(self) -> Program:
    """Returns the whole token list parsed as a program."""
    stages = [self._stage()]
    while self._is("|"):
      if is_reducer(stages[-1]):
        raise ParseError(f"a reducer must end the pipeline (at {self._peek().pos})")
      self._next()
      stages.append(self._stage())
    tok = self._peek()
    if tok.kind != "end":
      raise ParseError(f"unexpected {tok.text!r} at {tok.pos}")
    return Program(tuple(stages))

  def _stage(self) -> Stage:
    tok = self._next()
    name = tok.text if tok.kind == "name" else ""
    if name in ("sort", "rev"):
      return Sort() if name == "sort" else Rev()
    if name in REDUCER_NAMES:
      return Reduce(name)
    if name not in ("map", "filter", "take", "drop", "fold"):
      raise ParseError(f"expected a stage at {tok.pos}, got {tok.text or 'end'!r}")
    self._expect("(")
    if name == "map":
      stage = Map(self._typed(_X, INT))
    elif name == "filter":
      stage = Filter(self._typed(_X, BOOL))
    elif name in ("take", "drop"):
      n = self._literal(self._next())
      stage = Take(n) if name == "take" else Drop(n)
    else:
      init = self._typed(_NO_VARS, INT)
      self._expect(",")
      stage = Fold(init, self._typed(_AX, INT))
    self._expect(")")
    return stage

  def _literal(self, tok: Token) -> int:
    """Returns the value of an int token; checks its size by digit count before int()."""
    if tok.kind != "int":
      raise ParseError(f"expected an integer at {tok.pos}, got {tok.text or 'end'!r}")
    digits = tok.text.lstrip("0") or "0"
    if len(digits) > len(str(self._max_int)) or int(digits) > self._max_int:
      raise ParseError(f"integer literal too large at {tok.pos}")
    return int(digits)

  def _typed(self, scope: frozenset[str], want: str) -> Expr:
    tok = self._peek()
    node, typ, _ = self._expr(0, scope)
    if typ != want:
      raise ParseError(f"expected {'a condition' if want == BOOL else 'an int expression'}"
                       f" at {tok.pos}")
    return node

  def _expr(self, min_prec: int, scope: frozenset[str]) -> _Parsed:
    """Precedence climbing: an expression whose binary operators bind at >= min_prec."""
    tok = self._peek()
    if tok.kind == "name" and tok.text == "not":
      if min_prec > _NOT_PREC:
        raise ParseError(f"'not' not allowed here (at {tok.pos})")
      self._next()
      self._enter(tok)
      node, typ, height = self._expr(_NOT_PREC, scope)
      self._leave()
      if typ != BOOL:
        raise ParseError(f"'not' needs a condition (at {tok.pos})")
      left = (Not(node), BOOL, self._height(height + 1, tok))
    else:
      left = self._unary(scope)
    while True:
      tok = self._peek()
      prec = _BINARY_PREC.get(tok.text) if tok.kind in ("op", "name") else None
      if prec is None or prec < min_prec:
        return left
      self._next()
      right = self._expr(prec + 1, scope)
      left = self._binary(tok, left, right)

  def _binary(self, tok: Token, left: _Parsed, right: _Parsed) -> _Parsed:
    """Returns the typed node for `left <op> right`."""
    op = tok.text
    height = self._height(max(left[2], right[2]) + 1, tok)
    if op in ("and", "or"):
      if left[1] != BOOL or right[1] != BOOL:
        raise ParseError(f"{op!r} needs conditions (at {tok.pos})")
      return BoolOp(op, left[0], right[0]), BOOL, height
    if left[1] != INT or right[1] != INT:
      raise ParseError(f"{op!r} needs int operands (at {tok.pos})")
    if op in _CMP_OPS:
      return Compare(op, left[0], right[0]), BOOL, height
    return BinOp(op, left[0], right[0]), INT, height

  def _unary(self, scope: frozenset[str]) -> _Parsed:
    tok = self._peek()
    if not self._is("-"):
      return self._atom(scope)
    self._next()
    self._enter(tok)
    node, typ, height = self._unary(scope)
    self._leave()
    if typ != INT:
      raise ParseError(f"unary '-' needs an int (at {tok.pos})")
    return Neg(node), INT, self._height(height + 1, tok)

  def _atom(self, scope: frozenset[str]) -> _Parsed:
    tok = self._next()
    if tok.kind == "int":
      return Num(self._literal(tok)), INT, 1
    if tok.kind == "op" and tok.text == "(":
      self._enter(tok)
      parsed = self._expr(0, scope)
      self._expect(")")
      self._leave()
      return parsed
    if tok.kind == "name" and tok.text in ("x", "a"):
      if tok.text not in scope:
        raise ParseError(f"variable {tok.text!r} not defined here (at {tok.pos})")
      return Var(tok.text), INT, 1
    if tok.kind == "name" and tok.text == "until":
      return self._until(tok, scope)
    raise ParseError(f"expected an operand at {tok.pos}, got {tok.text or 'end'!r}")

  def _until(self, tok: Token, scope: frozenset[str]) -> _Parsed:
    if "x" not in scope:
      raise ParseError(f"'until' needs x in scope (at {tok.pos})")
    self._expect("(")
    self._enter(tok)
    cond, cond_type, cond_height = self._expr(0, scope)
    self._expect(",")
    body, body_type, body_height = self._expr(0, scope)
    self._expect(")")
    self._leave()
    if cond_type != BOOL or body_type != INT:
      raise ParseError(f"until(cond, expr) needs a condition and an int (at {tok.pos})")
    return Until(cond, body), INT, self._height(max(cond_height, body_height) + 1, tok)


def parse_program(source: Any, *, max_source_chars: int = MAX_SOURCE_CHARS,
                  max_depth: int = MAX_DEPTH, max_int: int = MAX_INT) -> Program:
  """Returns the parsed program.

  Work is O(len(source)) with recursion depth O(max_depth); nothing but ParseError is raised.

  Raises:
    ParseError: if `source` is not a str, is longer than `max_source_chars`, or is not a
      valid, well-typed program within the bounds.
  """
  if not isinstance(source, str):
    raise ParseError(f"source must be a str, got {type(source).__name__}")
  if len(source) > max_source_chars:
    raise ParseError(f"source longer than {max_source_chars} characters")
  return _Parser(tokenize(source), max_depth, max_int).program()


def try_parse(source: Any, **bounds: int) -> Program | None:
  """Returns the parsed program, or None if `source` does not parse (see parse_program)."""
  try:
    return parse_program(source, **bounds)
  except ParseError:
    return None
