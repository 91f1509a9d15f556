"""Version strings from three worlds compared with one key: Python wheels (``2.7.1.post2``, ``0.11.0rc1``,
``2.13.0+cpu``), CANN (``8.3.RC1``, ``8.5.0``) and the Ascend driver (``25.3.rc1``, ``24.1.rc1.b030``).

We do not use ``packaging.version`` because it is not a declared dependency and it rejects Ascend build
suffixes such as ``.b030``; this parser orders releases the PEP 440 way (dev < a < b < rc < final < post)
and ignores what it cannot read after the first tag, so a doctor never crashes on an odd version string.
"""

from __future__ import annotations

import re

_TAG_RANK = {"dev": 0, "a": 1, "alpha": 1, "b": 2, "beta": 2, "c": 3, "rc": 3, "": 4, "post": 5}
_HEAD = re.compile(r"^v?(\d+(?:\.\d+)*)")
_TAG = re.compile(r"^[.\-_]?(dev|alpha|beta|post|rc|a|b|c)[.\-_]?(\d*)")
_OPS = ("==", "!=", ">=", "<=", ">", "<")


def normalize_name(name: str) -> str:
    """PEP 503 name: ``torch_npu`` and ``Torch-NPU`` are the same distribution."""
    return re.sub(r"[-_.]+", "-", name).strip().lower()


def release(version: str, width: int = 3) -> tuple[int, ...]:
    """The numeric release, padded: ``2.7.1.post2`` -> (2, 7, 1); ``8.3.RC1`` -> (8, 3, 0)."""
    match = _HEAD.match(version.strip().lower())
    nums = [int(n) for n in match.group(1).split(".")] if match else []
    return tuple((nums + [0] * width)[:width])


def key(version: str) -> tuple:
    """A sortable key; the local label (``+cpu``) does not take part."""
    text = version.strip().lower().split("+", 1)[0]
    match = _HEAD.match(text)
    if not match:
        return ((-1,), 4, 0, 0)
    nums = tuple(int(n) for n in match.group(1).split("."))
    nums = nums + (0,) * (5 - len(nums)) if len(nums) < 5 else nums
    rest = text[match.end() :]
    rank, number, post = 4, 0, 0
    tag = _TAG.match(rest)
    if tag:
        rank, number = _TAG_RANK[tag.group(1)], int(tag.group(2) or 0)
        after = _TAG.match(rest[tag.end() :])
        if rank < 4 and after and after.group(1) == "post":  # 1.0rc1.post2 sorts after 1.0rc1
            post = int(after.group(2) or 0)
    return (nums, rank, number, post)


def _local(version: str) -> str:
    return version.split("+", 1)[1].lower() if "+" in version else ""


def _clause_ok(version: str, clause: str) -> bool:
    op = next((o for o in _OPS if clause.startswith(o)), "==")
    want = clause[len(op) :].strip() if clause.startswith(op) else clause
    if want.endswith(".*"):  # ==4.57.* : same leading release numbers
        prefix = [int(n) for n in want[:-2].split(".")]
        same = list(release(version, len(prefix))) == prefix
        return same if op == "==" else not same
    if op in ("==", "!=") and _local(want):  # ==2.13.0+cpu pins the local label too
        equal = key(version) == key(want) and _local(version) == _local(want)
    else:
        equal = key(version) == key(want)
    cmp = (key(version) > key(want)) - (key(version) < key(want))
    return {
        "==": equal,
        "!=": not equal,
        ">=": cmp >= 0,
        "<=": cmp <= 0,
        ">": cmp > 0,
        "<": cmp < 0,
    }[op]


def matches(version: str, spec: str) -> bool:
    """Does ``version`` satisfy ``spec`` (``==2.7.1``, ``>=5.16,<5.20``, ``==4.57.*``, ``*``)?"""
    clauses = [c.strip() for c in spec.split(",") if c.strip() and c.strip() != "*"]
    return all(_clause_ok(version, c) for c in clauses)


def compare(a: str, b: str) -> int:
    """-1, 0 or 1 as ``a`` sorts before, equal to or after ``b``."""
    return (key(a) > key(b)) - (key(a) < key(b))
