"""The ``calculator`` tool: arithmetic by parsing, never ``eval``.

The expression is parsed with :mod:`ast` and walked over a whitelist: int and float
literals, ``+ - * / // % **``, unary ``-``/``+`` and parentheses. Anything else (names,
calls, attributes, strings, comparisons) is refused with a message saying what is allowed.
Integer results are bounded (``MAX_BITS``) *before* they are computed, so ``9**9**9``
is refused instead of hanging the env.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 1000
MAX_BITS = 4000  # about 1200 decimal digits
ALLOWED = "numbers, + - * / // % ** and parentheses"

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_REFUSED = {
    ast.Name: "names are not allowed",
    ast.Call: "function calls are not allowed",
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "indexing is not allowed",
    ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "'and' / 'or' are not allowed",
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``; :class:`CalculatorError` explains a refusal."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is too long ({len(expression)} characters; "
                              f"the limit is {MAX_EXPRESSION_CHARS})")
    if not expression.strip():
        raise CalculatorError(f"expression is empty; write one with {ALLOWED}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        detail = exc.msg if isinstance(exc, SyntaxError) else str(exc) or type(exc).__name__
        raise CalculatorError(f"not an arithmetic expression ({detail}); use {ALLOWED}") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("the result is too large") from None
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def format_value(value: int | float) -> str:
    """A result as the model reads it: ints exactly, floats by their shortest repr."""
    return str(value) if isinstance(value, int) else repr(value)


def _evaluate(node: ast.AST) -> int | float:
    match node:
        case ast.Constant(value=bool()) | ast.Constant(value=complex()):
            raise CalculatorError(f"{node.value!r} is not allowed; use {ALLOWED}")
        case ast.Constant(value=int() | float() as number):
            return number
        case ast.Constant(value=other):
            raise CalculatorError(f"only numbers are allowed, not {other!r}")
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
            return _UNARY[type(op)](_evaluate(operand))
        case ast.BinOp(op=ast.BitXor()):
            raise CalculatorError("'^' is not supported; write powers with **")
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            a, b = _evaluate(left), _evaluate(right)
            _check_size(op, a, b)
            result = _BINARY[type(op)](a, b)
            if isinstance(result, complex):  # e.g. (-8) ** 0.5
                raise CalculatorError("the result is not a real number")
            return result
    reason = _REFUSED.get(type(node), f"{type(node).__name__} is not allowed")
    raise CalculatorError(f"{reason}; use {ALLOWED}")


def _check_size(op: ast.operator, a: int | float, b: int | float) -> None:
    """Refuse an integer operation whose result would exceed ``MAX_BITS``, before computing it."""
    if not (isinstance(a, int) and isinstance(b, int)):
        return  # float arithmetic overflows to an error or inf, which calculate() reports
    if isinstance(op, ast.Pow) and b > 0 and abs(a) > 1:
        if b > MAX_BITS or b * math.log2(abs(a)) > MAX_BITS:
            raise CalculatorError(f"{a}**{b} is too large (more than {MAX_BITS} bits)")
    elif isinstance(op, ast.Mult) and a.bit_length() + b.bit_length() > MAX_BITS + 1:
        raise CalculatorError(f"the product is too large (more than {MAX_BITS} bits)")
    elif isinstance(op, (ast.Add, ast.Sub)) and max(a.bit_length(), b.bit_length()) >= MAX_BITS:
        raise CalculatorError(f"the sum is too large (more than {MAX_BITS} bits)")
