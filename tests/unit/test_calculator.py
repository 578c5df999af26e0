"""The calculator environment (rollout/env/calculator.py): GSM8K annotations evaluate to their
values (a few embedded here; tools/calculator_gsm8k.py runs the whole train split), the
observation follows the GSM8K convention, and malicious or oversized inputs (deep nesting,
huge exponents, names, attribute access, calls, lambdas, long input) give an error observation
quickly, never an exception; values are checked against Python's own arithmetic on random
expressions."""

import random
import time

import pytest

from rlt_mega.rollout.env import Calculator, EnvEpisode, EnvLimits, Calls
from rlt_mega.rollout.env.calculator import CalcError, evaluate, format_value

# (annotation, value) from GSM8K's train split
GSM8K = [("48/2", "24"), ("12/60", "0.2"), ("0.2*50", "10"), ("100-50-30-15", "5"), ("(75/100)*100", "75"),
         ("3*(2/3)", "2"), ("60/(2/3)", "90"), ("240-(40+84+100)", "16"), ("(60+72+42)/3", "58"), ("2*.5", "1")]


@pytest.mark.parametrize("expr,value", GSM8K)
def test_gsm8k_annotations(expr, value):
    assert format_value(evaluate(expr)) == value


def test_the_observation_follows_gsm8k():
    env = Calculator()
    assert not env.triggered("She sold 48/2 = <<48/2")
    assert env.triggered("She sold 48/2 = <<48/2=")
    assert env.step(None, "She sold 48/2 = <<48/2=").observation == "24>>"
    assert env.step(None, "so <<10/3=").observation == "3.333333>>"
    assert env.step(None, "<<1,200*3=").observation == "3600>>"
    assert env.step(None, "<<50%*20=").observation == "10>>"


# the number format (issue 47): integers exact, other values rounded half away from zero to 6 decimals,
# never -0, no float artifacts; x only between two operands
FORMAT = [("0.3-0.1-0.2", "0"), ("10**20/3", "33333333333333333333.333333"), ("10**20+1", "100000000000000000001"),
          ("0.1+0.2", "0.3"), ("2/3", "0.666667"), ("-2/3", "-0.666667"), ("-7/2", "-3.5"), ("-1/3000000000", "0"),
          ("0.0000005", "0.000001"), ("-0.0000005", "-0.000001"), ("0.00000049", "0"), ("-0.00000049", "0"),
          ("1.10*3", "3.3"), ("(2/3)**-2", "2.25"), ("2**0.5", "1.414214"), ("4**0.5", "2"), ("7//2", "3"),
          ("3x4", "12"), ("3 x 4", "12"), ("(1+2)x(3)", "9"), ("50%x4", "2"), ("0.5x4", "2"), ("0 x 5", "0"),
          ("10**30", str(10 ** 30))]


@pytest.mark.parametrize("expr,value", FORMAT)
def test_the_number_format(expr, value):
    assert format_value(evaluate(expr)) == value
    assert Calculator().step(None, f"so <<{expr}=").observation == value + ">>"


MALFORMED = ["2xx3", "0x10", "0XfF", "1e3", "1E3", "1_000", "0b101", "0o17", "2x", "x3", "3xx4", "1.2.3", "1j"]


@pytest.mark.parametrize("expr", MALFORMED)
def test_malformed_calls(expr):
    with pytest.raises(CalcError):
        evaluate(expr)
    turn = Calculator().step(None, f"so <<{expr}=")
    assert turn.error and turn.observation == "error>>"


MALICIOUS = ["__import__('os').system('ls')", "().__class__", "a.b", "x", "open", "lambda: 1", "[1] * 9",
             "9**9**9", "10**400", "2**-9999", "(" * 200 + "1" + ")" * 200, "-" * 5000 + "1", "1+" * 300 + "1",
             "1e308*1e308", "1/0", "1%0", "0**-1", "'a'*3", "1 if 1 else 2", "f(1)", "", "=", "1;2", "print(1)",
             "~1", "1<2", "not 1", "[].pop()", "{1: 2}", "2" * 10000]


@pytest.mark.parametrize("expr", MALICIOUS)
def test_malicious_and_oversized_inputs_are_error_observations(expr):
    with pytest.raises(CalcError):
        evaluate(expr)
    t0 = time.perf_counter()
    turn = Calculator().step(None, f"so <<{expr}=")
    assert time.perf_counter() - t0 < 0.1
    assert turn.error and turn.tool_call and turn.observation == "error>>"


def test_values_agree_with_python_on_random_expressions():
    rng = random.Random(0)
    for _ in range(200):
        expr = str(rng.randint(1, 999))
        for _ in range(rng.randint(1, 4)):
            expr = f"({expr}){rng.choice('+-*/')}{rng.randint(1, 999)}"
        assert evaluate(expr) == pytest.approx(eval(expr), rel=1e-12)  # the reference only: Python's own


def test_an_episode_counts_an_error_and_tokenizes_once():
    calls = []

    def encode(text):
        calls.append(text)
        return [ord(c) for c in text]

    ep = EnvEpisode(Calculator(), {}, encode, EnvLimits(max_turn_tokens=3), Calls(1.0))
    r = ep.respond([], "<<2**99999=")
    assert r.error and r.tool_call and r.ids == tuple(ord(c) for c in "err") and r.truncated
    r = ep.respond([], "<<6*7=")
    assert r.ids == tuple(ord(c) for c in "42>") and r.truncated and not r.error
    assert calls == ["error>>", "42>>"]
