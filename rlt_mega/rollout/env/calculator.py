"""The GSM8K calculator (Cobbe et al., 2021): the model writes ``<<expression=`` and the
environment appends ``value>>``. The expression is parsed with ``ast`` and evaluated over a
whitelist (numbers, + - * / // % **, unary signs, parentheses), never ``eval``; size limits bound
the work (characters, nodes, exponents, magnitudes), and anything else is an error observation
(``error>>``, counted as a tool error), never an exception."""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Optional

from rlt_mega.rollout.env.base import Environment, Turn

MAX_CHARS = 200
MAX_NODES = 100
MAX_EXPONENT = 64  # |b| ** e with |e| <= 64 ...
MAX_MAGNITUDE = 1e30  # ... and every intermediate value within +-1e30

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_OPEN = re.compile(r"<<([^<>=]*)=")
_ANNOTATION = re.compile(r"<<[^<>=]*=([^<>]*>>)")  # a written call: its observation is group 1


class CalcError(ValueError):
    pass


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression (GSM8K's annotations: ``48/2``, ``2*.5``, ``12,000*3``,
    ``$5*4``, ``50%*20``); CalcError names what is wrong."""
    if len(expression) > MAX_CHARS:  # before any regular expression runs over it
        raise CalcError(f"expression of {len(expression)} characters (at most {MAX_CHARS})")
    text = expression.strip().replace(",", "").replace("$", "").replace("x", "*").replace("^", "**")
    text = re.sub(r"(\d+(?:\.\d+)?)\s*%", r"(\1/100)", text)
    if not text:
        raise CalcError("empty expression")
    if text.count("(") > MAX_NODES // 2:
        raise CalcError("too deeply nested")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalcError(f"not an expression ({type(exc).__name__})") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"more than {MAX_NODES} syntax nodes")
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)
    return value


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(b) > MAX_EXPONENT or (a == 0 and b < 0)):
            raise CalcError(f"exponent {b} out of range")
        try:
            return _bounded(_BINARY[type(node.op)](a, b))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except (OverflowError, TypeError):
            raise CalcError("value out of range") from None
    raise CalcError(f"{type(node).__name__} is not arithmetic")


def _bounded(x):
    if isinstance(x, complex) or not math.isfinite(x) or abs(x) > MAX_MAGNITUDE:
        raise CalcError("value out of range")
    return x


def format_value(value: float | int) -> str:
    """GSM8K's style: integers plainly, other values to at most 6 decimals, trailing zeros cut."""
    if isinstance(value, int):
        return str(value)
    return f"{value:.6f}".rstrip("0").rstrip(".")


class Calculator(Environment):
    """Each ``<<expression=`` in the model's turn is a tool call; the observation is ``value>>``
    (``error>>`` for an expression it refuses). The episode never ends by itself: the reward
    (grpo.reward) scores the completion."""

    triggers = ("=",)

    def triggered(self, text: str) -> bool:
        return _OPEN.search(text) is not None

    def step(self, state, text: str) -> Turn:
        match = _OPEN.search(text)
        expression: Optional[str] = match.group(1) if match else None
        try:
            if expression is None:
                raise CalcError("no <<expression=")
            return Turn(observation=format_value(evaluate(expression)) + ">>", tool_call=True)
        except CalcError:
            return Turn(observation="error>>", tool_call=True, error=True)

    def pieces(self, transcript: str) -> list[tuple[str, bool]]:
        """``<<48/2=24>>24`` -> ``<<48/2=`` (the model's), ``24>>`` (the observation), ``24``."""
        out, at = [], 0
        for match in _ANNOTATION.finditer(transcript):
            out += [(transcript[at:match.start(1)], False), (match.group(1), True)]
            at = match.end(1)
        out.append((transcript[at:], False))
        return [(text, observed) for text, observed in out if text]
