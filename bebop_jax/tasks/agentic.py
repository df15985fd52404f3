"""Agentic task: multi-turn tool use over a seeded key-value world.

Each example owns a small random world of entities (random 3-5 letter lowercase names, so
nothing carries over between examples) with attributes ``age`` (int), ``city`` (a short
name), ``boss`` (another entity) and ``score`` (int). The world lives in ``meta`` only; the
prompt asks a question that only the tools can answer:

  * one_hop:   ``What is the age of kel?``               get(kel,age)
  * two_hop:   ``What is the city of the boss of kel?``  get(kel,boss), get(<boss>,city)
  * aggregate: ``What is the age of kel plus the score of bim?``
               get(kel,age), get(bim,score), calc(<a>+<b>) (or mental arithmetic)

Tools, called as ``CALL_START name(args) CALL_END`` (canonical form without spaces, e.g.
``<|call|>get(kel,age)<|/call|>``; whitespace around names, arguments and markers is
accepted):

  * ``get(<entity>, <attr>)``: the attribute's value, or an error text.
  * ``calc(<expr>)``: a bounded integer calculator over + - * and parentheses (hand-written
    parser, bounded length, nesting depth and magnitude).

The environment replies ``RESULT_START <text> RESULT_END`` (no spaces). The demonstration is
the whole transcript a good policy produces: calls, results exactly as the environment
returns them, then ANSWER_MARKER and the answer (no EOS_MARKER).

Everything the environment and the reward read is clipped to MAX_COMPLETION_CHARS first and
parsed by bounded code; they never raise on any input.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from bebop_jax.tasks.base import (ANSWER_MARKER, StepResult, CALL_END, CALL_START, RESULT_END,
                                  RESULT_START, Example, Task, clip_completion, find_answer,
                                  extract_final_answer)

ATTRIBUTES = ("age", "city", "boss", "score")
NUMERIC_ATTRIBUTES = ("age", "score")
CITIES = ("oslo", "rome", "lima", "kyiv", "bern", "riga", "baku", "doha", "pisa", "nice")
KINDS = ("one_hop", "two_hop", "aggregate")
OPS = {"plus": "+", "minus": "-", "times": "*"}
# Policy turns a demonstration of each kind takes (the answering turn included).
TURNS_NEEDED = {"one_hop": 2, "two_hop": 3, "aggregate": 4}

NAME_LETTERS = "abcdefghijklmnopqrstuvwxyz"
NAME_MIN_LEN = 3
NAME_MAX_LEN = 5
MAX_ENTITIES = 12
# Names that would read confusingly in questions or tool calls.
RESERVED_NAMES = frozenset(ATTRIBUTES + CITIES + tuple(OPS) + (
    "get", "calc", "the", "of", "what", "is", "and", "error"))
AGE_RANGE = (18, 79)
SCORE_RANGE = (0, 99)

# Tool-call bounds.
MAX_CALL_CHARS = 128
MAX_EXPR_CHARS = 64
MAX_EXPR_DEPTH = 8
MAX_LITERAL_DIGITS = 9
MAX_CALC_ABS = 10**12
_DIGITS = "0123456789"
_SPACES = " \t\n"

# Error texts the environment returns inside RESULT_START ... RESULT_END. They never echo
# the policy's text, so observations are always printable ASCII without markers.
ERR_BAD_CALL = "error: bad call"
ERR_CALL_TOO_LONG = "error: call too long"
ERR_UNKNOWN_TOOL = "error: unknown tool"
ERR_GET_ARGS = "error: get needs 2 args"
ERR_UNKNOWN_ENTITY = "error: unknown entity"
ERR_UNKNOWN_ATTRIBUTE = "error: unknown attribute"
ERR_CALC = "error: calc: "

World = dict[str, dict[str, Any]]


# --------------------------------------------------------------------------------------
# Calculator.


class CalcError(ValueError):
  """A calc expression that is malformed or out of bounds."""


def _tokenize(expr: str) -> list[str]:
  """Returns the tokens (integer literals and single-char operators) of `expr`.

  Raises:
    CalcError: on a character outside digits, + - * ( ) and spaces, or a long literal.
  """
  tokens: list[str] = []
  i = 0
  while i < len(expr):
    ch = expr[i]
    if ch in _SPACES:
      i += 1
    elif ch in "+-*()":
      tokens.append(ch)
      i += 1
    elif ch in _DIGITS:
      j = i
      while j < len(expr) and expr[j] in _DIGITS:
        j += 1
      if j - i > MAX_LITERAL_DIGITS:
        raise CalcError("number too big")
      tokens.append(expr[i:j])
      i = j
    else:
      raise CalcError("bad character")
  return tokens


def _checked(value: int) -> int:
  """Returns `value`; raises CalcError if its magnitude exceeds MAX_CALC_ABS."""
  if abs(value) > MAX_CALC_ABS:
    raise CalcError("overflow")
  return value


class _Parser:
  """Recursive-descent parser/evaluator over a bounded token list.

  Grammar: expr := term (('+'|'-') term)*; term := factor ('*' factor)*;
  factor := ('+'|'-')* atom; atom := INT | '(' expr ')'.
  """

  def __init__(self, tokens: list[str]):
    self.tokens = tokens
    self.pos = 0

  def peek(self) -> str | None:
    """Returns the current token, or None at the end."""
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def take(self) -> str | None:
    """Returns the current token and advances."""
    token = self.peek()
    self.pos += 1
    return token

  def expr(self, depth: int) -> int:
    """Returns the value of a sum/difference of terms."""
    value = self.term(depth)
    while self.peek() in ("+", "-"):
      op = self.take()
      rhs = self.term(depth)
      value = _checked(value + rhs if op == "+" else value - rhs)
    return value

  def term(self, depth: int) -> int:
    """Returns the value of a product of factors."""
    value = self.factor(depth)
    while self.peek() == "*":
      self.take()
      value = _checked(value * self.factor(depth))
    return value

  def factor(self, depth: int) -> int:
    """Returns the value of an atom with optional unary signs (handled iteratively)."""
    sign = 1
    while self.peek() in ("+", "-"):
      if self.take() == "-":
        sign = -sign
    return sign * self.atom(depth)

  def atom(self, depth: int) -> int:
    """Returns the value of an integer literal or a parenthesised expression."""
    token = self.take()
    if token is None:
      raise CalcError("unexpected end")
    if token == "(":
      if depth >= MAX_EXPR_DEPTH:
        raise CalcError("too deep")
      value = self.expr(depth + 1)
      if self.take() != ")":
        raise CalcError("missing )")
      return value
    if token[0] in _DIGITS:
      return _checked(int(token))
    raise CalcError("syntax")


def evaluate_expression(expr: str) -> int:
  """Returns the integer value of `expr` (+ - * parentheses, unary signs, spaces).

  Bounded: at most MAX_EXPR_CHARS characters, MAX_EXPR_DEPTH nested parentheses, literals of
  at most MAX_LITERAL_DIGITS digits and intermediate values within +-MAX_CALC_ABS.
  Never uses eval/exec.

  Raises:
    CalcError: on any malformed or out-of-bounds expression (and only CalcError).
  """
  if not isinstance(expr, str):
    raise CalcError("not text")
  if len(expr) > MAX_EXPR_CHARS:
    raise CalcError("too long")
  tokens = _tokenize(expr)
  if not tokens:
    raise CalcError("empty")
  parser = _Parser(tokens)
  value = parser.expr(0)
  if parser.peek() is not None:
    raise CalcError("syntax")
  return value


# --------------------------------------------------------------------------------------
# Tools.


def _split_call(body: str) -> tuple[str, str] | None:
  """Returns (tool name, argument text) of ``name(args)``, or None if malformed."""
  body = body.strip()
  open_paren = body.find("(")
  if open_paren <= 0 or not body.endswith(")"):
    return None
  name = body[:open_paren].strip()
  if not name or not all(ch in NAME_LETTERS for ch in name):
    return None
  return name, body[open_paren + 1:-1]


def _run_get(world: World, args: str) -> str:
  """Returns the text result of ``get(<entity>, <attr>)``."""
  parts = args.split(",")
  if len(parts) != 2:
    return ERR_GET_ARGS
  entity, attr = parts[0].strip(), parts[1].strip()
  record = world.get(entity)
  if not isinstance(record, dict):
    return ERR_UNKNOWN_ENTITY
  if attr not in ATTRIBUTES or attr not in record:
    return ERR_UNKNOWN_ATTRIBUTE
  return str(record[attr])


def _run_calc(args: str) -> str:
  """Returns the text result of ``calc(<expr>)``: the value or an error text."""
  try:
    return str(evaluate_expression(args))
  except CalcError as error:
    return ERR_CALC + str(error)


def run_tool(world: World, body: str) -> str:
  """Returns the result text of one call body (the text between CALL_START and CALL_END).

  Never raises; malformed, unknown or out-of-bounds calls give an error text.
  """
  if not isinstance(body, str):
    return ERR_BAD_CALL
  if len(body) > MAX_CALL_CHARS:
    return ERR_CALL_TOO_LONG
  split = _split_call(body)
  if split is None:
    return ERR_BAD_CALL
  name, args = split
  if name == "get":
    return _run_get(world, args)
  if name == "calc":
    return _run_calc(args)
  return ERR_UNKNOWN_TOOL


def find_first_call(text: str) -> str | None:
  """Returns the body of the first complete call (CALL_START ... CALL_END) in `text`.

  The body runs from the first CALL_START to the first CALL_END after it; None if there is
  no such pair. A body that contains another marker is returned as is and rejected later.
  """
  start = text.find(CALL_START)
  if start < 0:
    return None
  start += len(CALL_START)
  end = text.find(CALL_END, start)
  if end < 0:
    return None
  return text[start:end]


def format_call(body: str) -> str:
  """Returns the canonical call text the policy writes."""
  return CALL_START + body + CALL_END


def format_result(text: str) -> str:
  """Returns the observation the environment appends for a tool result."""
  return RESULT_START + text + RESULT_END


# --------------------------------------------------------------------------------------
# Environment.


class ToolEnvironment:
  """Executes the policy's tool calls for one example.

  Each `step` consumes one policy turn (the text generated since the last observation):
    1. it contains an answer (ANSWER_MARKER, or its plain form; base.find_answer) -> done, reward of the answer;
    2. else, on the last allowed turn (`max_turns`) -> done, reward 0;
    3. else it contains a complete call -> the FIRST call is executed and its result (or an
       error text) is the observation;
    4. else (no call, no answer, e.g. truncated) -> done, reward 0.
  Steps after the end return done with reward 0. Never raises; bounded work per step.
  """

  def __init__(self, task: "AgenticTask", example: Example, max_turns: int):
    self.task = task
    self.example = example
    self.max_turns = max_turns
    meta = example.meta if isinstance(example.meta, dict) else {}
    world = meta.get("world")
    self.world: World = world if isinstance(world, dict) else {}
    self.turn = 0
    self.done = False

  def step(self, policy_text: Any) -> StepResult:
    """Returns the StepResult of one policy turn. Never raises."""
    try:
      return self._step(policy_text)
    except Exception:  # pylint: disable=broad-except  # Defence in depth; tests fuzz _step.
      self.done = True
      return StepResult("", True, 0.0, self.turn)

  def _step(self, policy_text: Any) -> StepResult:
    """Returns the StepResult of one policy turn (unguarded implementation of `step`)."""
    if self.done:
      return StepResult("", True, 0.0, self.turn)
    self.turn += 1
    text = clip_completion(policy_text)
    if find_answer(text) is not None:
      return self._finish(self.task.reward(self.example, text))
    if self.turn >= self.max_turns:
      return self._finish(0.0)
    body = find_first_call(text)
    if body is None:
      return self._finish(0.0)
    return StepResult(format_result(run_tool(self.world, body)), False, 0.0, self.turn)

  def _finish(self, reward: float) -> StepResult:
    """Ends the episode and returns the final StepResult."""
    self.done = True
    return StepResult("", True, reward, self.turn)


def policy_turns(transcript: str) -> list[str]:
  """Returns the policy's turns of a transcript: the text around the tool results.

  Turn i is the text after the (i-1)-th RESULT_END up to the i-th RESULT_START; the last
  turn is the text after the last RESULT_END. An unterminated result ends the split. The
  transcript is clipped to MAX_COMPLETION_CHARS first.
  """
  turns: list[str] = []
  rest = clip_completion(transcript)
  while True:
    start = rest.find(RESULT_START)
    if start < 0:
      turns.append(rest)
      return turns
    turns.append(rest[:start])
    end = rest.find(RESULT_END, start)
    if end < 0:
      return turns
    rest = rest[end + len(RESULT_END):]


# --------------------------------------------------------------------------------------
# Task.


def _random_name(rng: random.Random) -> str:
  """Returns a random lowercase name of NAME_MIN_LEN..NAME_MAX_LEN letters."""
  length = rng.randint(NAME_MIN_LEN, NAME_MAX_LEN)
  return "".join(rng.choice(NAME_LETTERS) for _ in range(length))


def make_world(rng: random.Random, num_entities: int) -> World:
  """Returns a world of `num_entities` uniquely named entities with all attributes."""
  names: list[str] = []
  while len(names) < num_entities:
    name = _random_name(rng)
    if name not in names and name not in RESERVED_NAMES:
      names.append(name)
  world: World = {}
  for name in names:
    world[name] = {
        "age": rng.randint(*AGE_RANGE),
        "city": rng.choice(CITIES),
        "boss": rng.choice([other for other in names if other != name]),
        "score": rng.randint(*SCORE_RANGE),
    }
  return world


def demonstration_calls(transcript: str) -> list[str]:
  """The bodies of the calls of a transcript, in order."""
  calls, rest = [], transcript
  while (body := find_first_call(rest)) is not None:
    calls.append(body)
    rest = rest[rest.find(CALL_END, rest.find(CALL_START)) + len(CALL_END):]
  return calls


def _transcript(world: World, calls: Sequence[str], answer: str) -> str:
  """Returns the demonstration: each call with its real result, then the answer."""
  parts = [format_call(call) + format_result(run_tool(world, call)) for call in calls]
  return "".join(parts) + ANSWER_MARKER + answer


class AgenticTask(Task):
  """Multi-turn tool use: answer questions about a hidden key-value world via get/calc.

  Difficulty knobs:
    num_entities: entities per world (2..MAX_ENTITIES).
    kinds: question kinds sampled uniformly, from KINDS.
    ops: aggregate operators, from OPS ("plus", "minus", "times").
    use_calc: whether aggregate demonstrations call calc (else the policy adds itself).
    max_turns: most policy turns per episode, the answering turn included.
    diversity: how often `demonstration` leaves the canonical path (0 = never): the two
      look-ups of an aggregate question in either order, `calc(b+a)` for `calc(a+b)`.
    confirm: probability of an extra confirmation look-up (any attribute of an entity
      already looked up) when the turn budget allows.
    spacing: probability that a sampled transcript spaces its call arguments (`get(a, b)`,
      `calc(1 + 2)`; one style for the whole transcript).
  """

  name = "agentic"

  def __init__(self, num_entities: int = 4,
               kinds: Sequence[str] = KINDS,
               ops: Sequence[str] = ("plus",),
               use_calc: bool = True,
               max_turns: int = 5,
               diversity: float = 0.0,
               confirm: float = 0.0,
               spacing: float = 0.0):
    kinds, ops = tuple(kinds), tuple(ops)
    if not 2 <= num_entities <= MAX_ENTITIES:
      raise ValueError(f"num_entities must be in [2, {MAX_ENTITIES}], got {num_entities}")
    if not kinds or any(kind not in KINDS for kind in kinds):
      raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds}")
    if not ops or any(op not in OPS for op in ops):
      raise ValueError(f"ops must be a non-empty subset of {tuple(OPS)}, got {ops}")
    needed = max(self._turns_needed(kind, use_calc) for kind in kinds)
    if max_turns < needed:
      raise ValueError(f"max_turns={max_turns} < {needed} turns the demonstrations need")
    for knob, value in (("diversity", diversity), ("confirm", confirm), ("spacing", spacing)):
      if not 0.0 <= value <= 1.0:
        raise ValueError(f"{knob} must be in [0, 1], got {value}")
    self.diversity = diversity
    self.confirm = confirm
    self.spacing = spacing
    self.num_entities = num_entities
    self.kinds = kinds
    self.ops = ops
    self.use_calc = use_calc
    self.max_turns = max_turns

  @property
  def multi_turn(self) -> bool:
    return True

  @staticmethod
  def _turns_needed(kind: str, use_calc: bool) -> int:
    """Returns the policy turns a demonstration of `kind` takes."""
    if kind == "aggregate" and not use_calc:
      return TURNS_NEEDED[kind] - 1
    return TURNS_NEEDED[kind]

  def sample(self, seed: int) -> Example:
    """Returns the example of `seed`; deterministic in the seed and the knobs."""
    rng = random.Random(f"agentic/{int(seed)}")
    world = make_world(rng, self.num_entities)
    kind = rng.choice(self.kinds)
    if kind == "one_hop":
      prompt, calls, answer = self._one_hop(rng, world)
    elif kind == "two_hop":
      prompt, calls, answer = self._two_hop(rng, world)
    else:
      prompt, calls, answer = self._aggregate(rng, world)
    meta = {"answer": answer, "kind": kind, "world": world}
    return Example(self.name, prompt + "\n", _transcript(world, calls, answer), meta)

  @staticmethod
  def _one_hop(rng: random.Random, world: World) -> tuple[str, list[str], str]:
    """Returns (prompt, demonstration calls, answer) of a one-hop question."""
    entity = rng.choice(sorted(world))
    attr = rng.choice(ATTRIBUTES)
    prompt = f"What is the {attr} of {entity}?"
    return prompt, [f"get({entity},{attr})"], str(world[entity][attr])

  @staticmethod
  def _two_hop(rng: random.Random, world: World) -> tuple[str, list[str], str]:
    """Returns (prompt, demonstration calls, answer) of an attribute-of-the-boss question."""
    entity = rng.choice(sorted(world))
    attr = rng.choice(ATTRIBUTES)
    boss = world[entity]["boss"]
    prompt = f"What is the {attr} of the boss of {entity}?"
    calls = [f"get({entity},boss)", f"get({boss},{attr})"]
    return prompt, calls, str(world[boss][attr])

  def _aggregate(self, rng: random.Random, world: World) -> tuple[str, list[str], str]:
    """Returns (prompt, demonstration calls, answer) of a two-value arithmetic question."""
    first, second = rng.sample(sorted(world), 2)
    attr1, attr2 = rng.choice(NUMERIC_ATTRIBUTES), rng.choice(NUMERIC_ATTRIBUTES)
    op = rng.choice(self.ops)
    value1, value2 = world[first][attr1], world[second][attr2]
    expr = f"{value1}{OPS[op]}{value2}"
    prompt = f"What is the {attr1} of {first} {op} the {attr2} of {second}?"
    calls = [f"get({first},{attr1})", f"get({second},{attr2})"]
    if self.use_calc:
      calls.append(f"calc({expr})")
    return prompt, calls, str(evaluate_expression(expr))

  def demonstration(self, example: Example, seed: int) -> str:
    """One valid transcript of `example` (the canonical one with diversity 0); the results
    are the world's, so the environment replays it exactly."""
    if self.diversity <= 0 and self.confirm <= 0 and self.spacing <= 0:
      return example.demonstration
    rng = random.Random(f"agentic-demo/{seed}")
    calls = demonstration_calls(example.demonstration)
    gets = [c for c in calls if c.startswith("get(")]
    if example.meta.get("kind") == "aggregate" and rng.random() < self.diversity:
      calls[0], calls[1] = calls[1], calls[0]
    if calls[-1].startswith("calc(") and rng.random() < self.diversity:
      body = calls[-1][len("calc("):-1]
      for op in ("+", "*"):
        if body.count(op) == 1 and "-" not in body:
          left, right = body.split(op)
          calls[-1] = f"calc({right}{op}{left})"
    if len(calls) + 2 <= self.max_turns and rng.random() < self.confirm:
      at = rng.randint(1, len(gets))  # after a look-up: one more of an entity seen so far
      entity = calls[rng.randrange(at)][len("get("):].split(",")[0]
      calls.insert(at, f"get({entity},{rng.choice(ATTRIBUTES)})")
    if rng.random() < self.spacing:  # spaced arguments, one style for the transcript
      calls = [c.replace(",", ", ").replace("+", " + ").replace("*", " * ").replace("-", " - ")
               for c in calls]
    return _transcript(example.meta["world"], calls, example.meta["answer"])

  def reward(self, example: Example, completion: Any) -> float:
    """Returns 1.0 iff the final answer of the transcript equals the expected one, else 0.0.

    Never raises; bounded work (the completion is clipped by extract_final_answer).
    """
    answer = extract_final_answer(completion)
    meta = example.meta if isinstance(example.meta, dict) else {}
    expected = meta.get("answer")
    if answer is None or not isinstance(expected, str):
      return 0.0
    return 1.0 if answer == expected else 0.0

  def environment(self, example: Example) -> ToolEnvironment:
    """Returns a fresh ToolEnvironment for one episode of `example`."""
    return ToolEnvironment(self, example, self.max_turns)
