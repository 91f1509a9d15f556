"""The shipped ``calculator`` tool: arithmetic parsed, never evaluated.

The expression is parsed by Python's own parser (``ast.parse(mode="eval")``) and only then walked: numbers,
parentheses, ``+ - * / // % **`` and unary signs, nothing else (a name, a call, an attribute, a string is refused
before anything runs). Arithmetic is exact (integers and fractions); a result is printed as an integer when it is
one, else as a decimal to 12 significant digits. Bounds keep one call cheap whatever the model writes: at most
200 characters, exponents up to 64 in magnitude, no intermediate value past 10**100.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**100
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """What the model is told about its expression."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers, parentheses and + - * / // % ** only, e.g. "(12 + 3) * 45".
    """
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression is {len(expression)} characters, over the limit of {MAX_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    return _format(_value(tree.body))


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if node.value != node.value or abs(node.value) == float("inf"):  # 1e999 parses to inf
            raise CalculatorError("a number is too large")
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _power(_value(node.left), _value(node.right))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(Fraction(_BINARY[type(node.op)](left, right)))
    raise CalculatorError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents are allowed")
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is over the limit of {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if abs(base) > 1 and abs(base.numerator).bit_length() * abs(int(exponent)) > 400:  # 2**400 > 10**100
        raise CalculatorError("the result is too large")
    return _bounded(base ** int(exponent))


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise CalculatorError("a value is too large")
    return value


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"
