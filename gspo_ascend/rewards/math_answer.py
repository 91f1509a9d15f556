"""Math answer checking: the last ``\\boxed{...}`` of a response against a ground truth, with math-verify.

How we differ from verl: verl's default math scorers compare normalised *strings* (``is_equiv`` after
``strip_string``), so ``0.5`` vs ``\\frac{1}{2}`` scores 0, and its ``math_verify`` scorer hands the whole
response to math-verify's default extractors, one of which (``ExprExtractionConfig``) runs sympy's
``parse_expr`` -- which ``eval``\\ s the transformed text. Here we

* cut the answer out of the response ourselves (the *last* ``\\boxed{}``/``\\fbox{}``, braces balanced), so
  text outside the box can never be picked up as "the answer";
* parse it with math-verify's LaTeX extractor only (an ANTLR grammar, ``latex2sympy2_extended``, building sympy
  objects from a parse tree). Model text is never ``eval``\\ ed or ``exec``\\ ed: a box holding
  ``__import__('os').system(...)`` fails to parse (or parses as a product of symbols) and scores 0;
* compare with math-verify's ``verify`` (numeric, symbolic and set equivalence: ``1/2 == 0.5 == \\frac{1}{2}``).

math-verify's own timeouts use ``signal.alarm`` and are switched off here (they would cancel the caller's
timer, and fail outside the main thread); :mod:`gspo_ascend.rewards.compute` bounds each sample instead.
"""

from __future__ import annotations

import logging
from functools import lru_cache

# what every math prompt asks for: the answer in the last \boxed{}, which extract_boxed reads (data/prepare.py
# appends it to questions; the tiny model's tokenizer learns it, tiny.py)
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_BOX_COMMANDS = ("\\boxed", "\\fbox")
MAX_ANSWER_CHARS = 1000  # longer "answers" are not short math answers; skip parsing them (cost, not safety)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``; None when absent.

    Braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``; an unclosed box gives None.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(cmd) :]
    if rest.startswith(" "):  # `\boxed 5`: the argument is the next space-free run
        word = rest.strip().split(maxsplit=1)
        return word[0].rstrip(".,;$") if word else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return rest[1:i].strip()
    return None


class _DropTimeoutNotice(logging.Filter):
    # at module level: a class defined inside the function below would be a new class on every call, the
    # isinstance check would never match, and every scored sample would add two more filters (scoring time
    # grew linearly over a run: 0.09 s -> 1.3 s per 128-sample batch)
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _quiet_math_verify() -> None:
    """Drop math-verify's one-time "Timeout is disabled" warning: we disable its alarm on purpose."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTimeoutNotice) for f in logger.filters):
            logger.addFilter(_DropTimeoutNotice())


def _parse_boxed(content: str) -> list:
    from math_verify import LatexExtractionConfig, parse

    # LaTeX extraction only (no ExprExtractionConfig: that path evals). "first_match" keeps the raw string
    # as a fallback so answers sympy cannot represent ("(A)", "yes") still compare as strings.
    return parse(
        "\\boxed{" + content + "}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        fallback_mode="first_match",
        parsing_timeout=None,
    )


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """True when the two answers are mathematically equal (math-verify), e.g. ``0.5`` and ``\\frac{1}{2}``.

    Text the LaTeX grammar cannot parse is compared as a plain string (math-verify's fallback), so a parse
    failure is simply "not equal", not an error.
    """
    from math_verify import verify

    _quiet_math_verify()
    if len(answer) > MAX_ANSWER_CHARS:
        return False
    gold, pred = _parse_boxed(ground_truth), _parse_boxed(answer)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


@lru_cache(maxsize=1)
def warm_up() -> None:
    """Import math-verify and build its LaTeX grammar once (about a second), outside any per-sample timer."""
    is_equivalent("1", "1")


def math_score(response: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer of ``response`` equals ``ground_truth``, else 0.0 (no box: 0.0)."""
    answer = extract_boxed(response)
    if answer is None or not answer:
        return 0.0
    return 1.0 if is_equivalent(answer, str(ground_truth)) else 0.0
