"""The GSM8K calculator (Cobbe et al., 2021): the model writes ``<<expression=`` and the
environment appends ``value>>``. The expression is parsed with ``ast`` and evaluated over a
whitelist (numbers, + - * / // % **, unary signs, parentheses), never ``eval``; size limits bound
the work (characters, nodes, exponents, magnitudes), and anything else is an error observation
(``error>>``, counted as a tool error), never an exception.

The number format: a number is written as digits with at most one decimal point (``12``,
``0.5``, ``.5``; GSM8K's ``12,000``, ``$5`` and ``50%`` are read as 12000, 5 and 0.5); ``x``
between two operands is a multiplication (``3x4``, ``3 x 4``). Anything else (``0x10``,
``1e3``, ``1_000``, ``2xx3``) is a malformed call. Arithmetic is exact (fractions: ``0.3-0.1-0.2``
is 0, ``10**20/3`` is 33333333333333333333.333...); only a non-integer power leaves the exact
numbers (a float, then rounded). The value is written as an integer when it is one, else rounded
half away from zero to ``DECIMALS`` decimals with trailing zeros cut; never ``-0``."""

from __future__ import annotations

import ast
import math
import operator
import re
from decimal import Decimal
from fractions import Fraction
from typing import Optional

from rlt_mega.rollout.env.base import Environment, Turn

MAX_CHARS = 200
MAX_NODES = 100
MAX_EXPONENT = 64  # |b| ** e with |e| <= 64 ...
MAX_MAGNITUDE = 10 ** 30  # ... and every intermediate value within +-1e30
MAX_DENOMINATOR = 10 ** 40  # an intermediate value's denominator: beyond it, the nearest fraction within it
DECIMALS = 6  # a value that is not an integer is written rounded to this many decimals

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_OPEN = re.compile(r"<<([^<>=]*)=")
_ANNOTATION = re.compile(r"<<[^<>=]*=([^<>]*>>)")  # a written call: its observation is group 1
_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")  # the one way to write a number
_HEX = re.compile(r"(?<![\d.])0x\w*", re.IGNORECASE)  # 0x10: no number is written 0x (0 x 10 with spaces is 0)
_TIMES = re.compile(r"(?<=[\d.)%])\s*x\s*(?=[\d.(])")  # x between two operands: a multiplication


class CalcError(ValueError):
    pass


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (GSM8K's annotations: ``48/2``, ``2*.5``,
    ``12,000*3``, ``$5*4``, ``50%*20``, ``3x4``); CalcError names what is wrong."""
    if len(expression) > MAX_CHARS:  # before any regular expression runs over it
        raise CalcError(f"expression of {len(expression)} characters (at most {MAX_CHARS})")
    text = expression.strip().replace(",", "").replace("$", "").replace("^", "**")
    hexadecimal = _HEX.search(text)  # not 0 times 10: Python's hexadecimal literal
    if hexadecimal:
        raise CalcError(f"malformed number {hexadecimal.group(0)!r}")
    text = _TIMES.sub("*", re.sub(r"(\d+(?:\.\d+)?)\s*%", r"(\1/100)", text))
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
    return _eval(tree.body, text)


def _eval(node: ast.AST, text: str) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        written = ast.get_source_segment(text, node)
        if written is None or not _NUMBER.fullmatch(written):  # 0x10, 1e3, 1_000: Python's, not a number here
            raise CalcError(f"malformed number {written!r}")
        return _bounded(Fraction(Decimal(written)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, text))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left, text), _eval(node.right, text)
        if isinstance(node.op, ast.Pow) and (abs(b) > MAX_EXPONENT or (a == 0 and b < 0)):
            raise CalcError(f"exponent {b} out of range")
        try:
            return _bounded(_BINARY[type(node.op)](a, b))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except (OverflowError, TypeError, ValueError):
            raise CalcError("value out of range") from None
    raise CalcError(f"{type(node).__name__} is not arithmetic")


def _bounded(x) -> Fraction:
    """``x`` as a Fraction within the limits (a float: a non-integer power's value)."""
    if isinstance(x, complex) or (isinstance(x, float) and not math.isfinite(x)):
        raise CalcError("value out of range")
    x = Fraction(x)
    if abs(x) > MAX_MAGNITUDE:
        raise CalcError("value out of range")
    if x.denominator > MAX_DENOMINATOR:  # far below what DECIMALS shows; bounds the work of a chain of powers
        x = x.limit_denominator(MAX_DENOMINATOR)
    return x


def format_value(value: Fraction | int) -> str:
    """The observation's number: an integer exactly, anything else rounded half away from zero
    to DECIMALS decimals, trailing zeros cut; a value that rounds to zero is ``0`` (never ``-0``)."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    scaled = abs(value) * 10 ** DECIMALS
    units = math.floor(scaled + Fraction(1, 2))  # half away from zero (on the magnitude)
    if units == 0:
        return "0"
    whole, part = divmod(units, 10 ** DECIMALS)
    digits = f"{whole}.{part:0{DECIMALS}d}".rstrip("0").rstrip(".")
    return ("-" if value < 0 else "") + digits


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
