"""Countdown correctness: is an answer an arithmetic expression that uses each given number exactly once and
evaluates exactly to the target?

The answer is policy-written text, so it is parsed, never `eval`ed: a linear tokenizer and a recursive-descent
parser over integers, the binary operators `+ - * /` and parentheses, evaluated in exact rational arithmetic
(`(7 - 3) / 2 * 5` is exactly 10; `1 / 3 * 3` is exactly 1). Unary signs are refused (they would create numbers
that were not given), as are decimals, other characters and division by zero. Time is bounded on hostile input:
answers longer than `MAX_ANSWER_CHARS` are refused before parsing, and every number in the expression must be one
of the given ones, so no intermediate value grows past the product of the given numbers.

A trailing `= N` is accepted when N is the target, because models often write the equation out in full.
"""

from __future__ import annotations

import re
from fractions import Fraction

# Far above any honest answer for 3-6 numbers (`((12 + 34) * (56 - 78)) / 90 = 1` is 32 characters); it caps the
# parser's work and its recursion depth on hostile input.
MAX_ANSWER_CHARS = 512
# Parentheses nested deeper than this are not an honest answer; the cap keeps the recursive parser far from
# Python's recursion limit.
MAX_NESTING = 32
# Tokens: integers, the four operators (with the typographic x and division sign models sometimes write),
# parentheses; white space between them is skipped. Anything else fails the match.
_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()\u00d7\u00f7]))")
_TYPOGRAPHIC = {"\u00d7": "*", "\u00f7": "/"}
_TRAILING_TARGET = re.compile(r"=\s*(-?\d+)\s*$")


class _Invalid(Exception):
    """The answer is not a well-formed expression over the allowed tokens."""


def _tokens(text: str) -> list[str | int]:
    tokens: list[str | int] = []
    text, position, depth = text.strip(), 0, 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise _Invalid
        number, symbol = match.groups()
        symbol = _TYPOGRAPHIC.get(symbol, symbol)
        depth += (symbol == "(") - (symbol == ")")
        if depth > MAX_NESTING:
            raise _Invalid  # the parser recurses once per level: refuse before Python's recursion limit would
        tokens.append(int(number) if number is not None else symbol)
        position = match.end()
    return tokens


class _Parser:
    """expression := term (('+' | '-') term)*;  term := factor (('*' | '/') factor)*;
    factor := INT | '(' expression ')'"""

    def __init__(self, tokens: list[str | int]) -> None:
        self.tokens = tokens
        self.position = 0
        self.numbers: list[int] = []

    def _peek(self) -> str | int | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self) -> str | int | None:
        token = self._peek()
        self.position += 1
        return token

    def parse(self) -> Fraction:
        value = self._expression()
        if self._peek() is not None:
            raise _Invalid  # e.g. a stray ")" or two numbers side by side
        return value

    def _expression(self) -> Fraction:
        value = self._term()
        while self._peek() in ("+", "-"):
            operator, right = self._take(), self._term()
            value = value + right if operator == "+" else value - right
        return value

    def _term(self) -> Fraction:
        value = self._factor()
        while self._peek() in ("*", "/"):
            operator, right = self._take(), self._factor()
            if operator == "*":
                value *= right
            elif right == 0:
                raise _Invalid
            else:
                value /= right
        return value

    def _factor(self) -> Fraction:
        token = self._take()
        if isinstance(token, int):
            self.numbers.append(token)
            return Fraction(token)
        if token == "(":
            value = self._expression()
            if self._take() != ")":
                raise _Invalid
            return value
        raise _Invalid  # an operator where a number belongs (unary signs included), or the end of the input


def countdown_correct(answer: str, numbers: list[int], target: int) -> bool:
    """True when `answer` (the extracted answer text) is an expression using each of `numbers` exactly once
    (as a multiset: a number given twice is used twice) that evaluates exactly to `target`."""
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a str, got {type(answer).__name__}")
    if len(answer) > MAX_ANSWER_CHARS:
        return False
    expression = answer
    if (stated := _TRAILING_TARGET.search(answer)) is not None:
        if int(stated.group(1)) != target:
            return False
        expression = answer[: stated.start()]
    try:
        parser = _Parser(_tokens(expression))
        value = parser.parse()
    except _Invalid:
        return False
    return sorted(parser.numbers) == sorted(numbers) and value == target
