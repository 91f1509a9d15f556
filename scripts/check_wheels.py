"""Does every pin of requirements-{npu,gpu,cpu}.txt have a wheel for every Python and platform it is installed on?

A pin without a matching wheel does not fail loudly: pip quietly builds its sdist, which needs a compiler (a Rust
toolchain for blake3, issue #25: blake3 1.0.11 ships cp311+ only, so Python 3.10 hosts built it from source) that
an Atlas node usually lacks. Nothing else notices: CI installs one Python on one platform.

The facts come from the package indexes, the way pip sees them: per file its name, requires-python and yanked
flag (PyPI's release JSON for an exact pin; else the PEP 691 JSON simple API, or PEP 503 HTML for indexes without
it). Each file is checked on the indexes pip would use for it (PyPI plus its ``--extra-index-url`` lines); an index
that cannot be reached is reported, and a pin only that index can serve (``torch==2.13.0+cpu``) is then
"unchecked", not failed.

    .venv/bin/python scripts/check_wheels.py                    every file, on its platforms and its Pythons
    .venv/bin/python scripts/check_wheels.py requirements-cpu.txt --python 3.10     another Python than it states

Exit status 1 when a pin lacks a wheel, 2 when PyPI cannot be reached. Needs ``packaging`` (in every lock).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import html.parser
import json
import re
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple/"
RELEASES = "https://pypi.org/pypi/"  # PyPI's JSON API: /pypi/NAME/VERSION/json lists one release's files
# A pin with a local label comes from the index that builds it, named in the file or not (the CPU lock's
# torch==2.13.0+cpu reaches pip through its configuration): PyTorch's CPU index is the only one with +cpu builds.
LOCAL_INDEXES = {"cpu": "https://download.pytorch.org/whl/cpu/"}

# The platforms each file installs on (its header says why): NPU hosts are Atlas servers with Kunpeng (aarch64) or
# x86_64 CPUs; the GPU stack is for x86_64 H20 servers; the CPU lock is CI's (Linux x86_64, docs/install-cpu.md).
PLATFORMS = {
    "requirements-npu.txt": ("x86_64", "aarch64"),
    "requirements-gpu.txt": ("x86_64",),
    "requirements-cpu.txt": ("x86_64",),
}

# Python versions each file supports: the floor is pyproject.toml's requires-python, the ceiling is what the docs and
# scripts/check_mindspeed.sh ("3.10 or 3.11") name. A file's header narrows it with a line "# Python: 3.11 (why)".
PYTHONS = ((3, 10), (3, 11))
_PYTHON_LINE = re.compile(r"^#\s*Python:\s*([0-9., ]+?)\s*(?:\(|$)", re.M)

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)(\[[^\]]*\])?\s*((?:==|>=|~=)[^;#]*)")
_INDEX = re.compile(r"^--extra-index-url\s+(\S+)")


@dataclass(frozen=True)
class Pin:
    name: str  # canonical (PEP 503)
    spec: str  # "==1.0.11", ">=0.8"
    line: int


@dataclass(frozen=True)
class Dist:
    """One file on an index, as pip's finder sees it."""

    filename: str
    version: Version
    requires_python: str | None
    yanked: bool
    index: str


@dataclass(frozen=True)
class Result:
    file: str
    pin: Pin
    python: tuple[int, int]
    platform: str
    status: str  # ok | missing | unchecked
    detail: str  # the chosen wheel, or why there is none


def read_requirements(path: Path) -> tuple[list[Pin], list[str], tuple[tuple[int, int], ...]]:
    """The pins pip installs from ``path`` (``# @source`` notes are not pins), its extra indexes, and the Pythons
    its header allows (``# Python: 3.11``; :data:`PYTHONS` when it says nothing)."""
    pins, indexes = [], []
    text = path.read_text()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        index = _INDEX.match(line)
        if index:
            indexes.append(index[1].rstrip("/") + "/")
            continue
        match = _PIN.match(line)
        if match:
            pins.append(Pin(canonicalize_name(match[1]), match[3].strip(), number))
    stated = _PYTHON_LINE.search(text)
    pythons = PYTHONS
    if stated:
        pythons = tuple(tuple(int(n) for n in v.split(".")) for v in re.findall(r"\d+\.\d+", stated[1]))
    return pins, indexes, pythons


class _Anchors(html.parser.HTMLParser):
    """PEP 503 page: <a href=... data-requires-python=... data-yanked>filename</a>."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[dict] = []
        self._open: dict | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            a = dict(attrs)
            self._open = {"requires-python": a.get("data-requires-python"), "yanked": "data-yanked" in a}

    def handle_data(self, data):
        if self._open is not None and data.strip():
            self._open["filename"] = data.strip()

    def handle_endtag(self, tag):
        if tag == "a" and self._open is not None and "filename" in self._open:
            self.files.append(self._open)
        self._open = None


class Indexes:
    """The files of each project on each index, fetched once per run (a test session shares one instance).

    An exact pin on PyPI reads PyPI's release JSON (/pypi/NAME/VERSION/json: that release's files only, a few kB);
    everything else, and a PyPI mirror without that API, reads the simple index (every release: ~80 MB for the
    CPU lock's 190 projects, so it is the fallback)."""

    def __init__(self, timeout: float = 15.0) -> None:
        self.timeout = timeout
        self._cache: dict[tuple[str, str, str | None], list[Dist] | None] = {}
        self.unreachable: dict[str, str] = {}  # index -> the error, once it failed
        self._release_api: bool | None = None  # does PyPI (or the mirror answering for it) serve the release JSON?
        self._lock = threading.Lock()

    def fetch(self, index: str, name: str, version: str | None = None) -> list[Dist] | None:
        """Files of ``name`` (of release ``version`` where given) on ``index``; [] when the index does not have
        them, None when it is down."""
        key = (index, name, version if index == PYPI and self.release_api() else None)
        if key not in self._cache:
            self._cache[key] = None if index in self.unreachable else self._get(*key)
        return self._cache[key]

    def release_api(self) -> bool:
        with self._lock:
            if self._release_api is None:
                self._release_api = isinstance(self._open(f"{RELEASES}pip/24.0/json", PYPI), tuple)
        return self._release_api

    def _get(self, index: str, name: str, version: str | None) -> list[Dist] | None:
        if version:
            answer = self._open(f"{RELEASES}{name}/{version}/json", index)
            if isinstance(answer, tuple):
                raw = [{**u, "requires-python": u.get("requires_python")} for u in json.loads(answer[0])["urls"]]
                return [d for d in (_dist(f, index) for f in raw) if d is not None]
        answer = self._open(f"{index}{name}/", index)
        if not isinstance(answer, tuple):
            return [] if answer == 404 else None
        body, kind = answer
        if "json" in kind:
            raw = json.loads(body)["files"]
        else:
            parser = _Anchors()
            parser.feed(body.decode("utf-8", "replace"))
            raw = parser.files
        return [d for d in (_dist(f, index) for f in raw) if d is not None]

    def _open(self, url: str, index: str) -> tuple[bytes, str] | int | None:
        """(body, content type); the HTTP status for a 404; None when ``index`` is down (then remembered)."""
        accept = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
        request = urllib.request.Request(url, headers={"Accept": accept, "Accept-Encoding": "gzip"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                body = response.read()
                if response.headers.get("Content-Encoding") == "gzip":  # PyPI's CDN compresses ~10x
                    body = gzip.decompress(body)
                return body, response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return 404
            self.unreachable[index] = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:  # DNS, refused, timeout: the whole index is down for us
            self.unreachable[index] = str(getattr(exc, "reason", exc))
        return None


def _dist(entry: dict, index: str) -> Dist | None:
    name = entry["filename"]
    if name.endswith(".whl"):
        version = name.split("-")[1]  # name-version-...: the wheel spec escapes "-" in both
    elif name.endswith(".tar.gz") or name.endswith(".zip"):
        version = name.rsplit(".tar.gz" if name.endswith(".tar.gz") else ".zip", 1)[0].rsplit("-", 1)[-1]
    else:
        return None  # .egg, .exe, .msi: pip does not install these
    parsed = _version(version)
    if parsed is None:
        return None
    return Dist(name, parsed, entry.get("requires-python") or None, bool(entry.get("yanked")), index)


@functools.cache
def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None  # pre-PEP 440 releases: pip skips them too


def _manylinux(platform: str, arch: str) -> bool:
    # glibc wheels only: musllinux does not run on the glibc distributions Atlas / H20 / CI hosts use
    return re.fullmatch(rf"(manylinux(1|2010|2014|_\d+_\d+)|linux)_{arch}", platform) is not None


def wheel_fits(filename: str, python: tuple[int, int], arch: str) -> bool:
    """Would pip install this wheel on CPython ``python`` (glibc Linux on ``arch``)?"""
    cp = f"cp{python[0]}{python[1]}"
    for tag in parse_wheel_filename(filename)[3]:
        if tag.platform != "any" and not _manylinux(tag.platform, arch):
            continue
        if tag.interpreter == cp and tag.abi in (cp, "none"):
            return True
        if tag.abi == "abi3" and tag.interpreter.startswith("cp3") and int(tag.interpreter[3:]) <= python[1]:
            return True
        if (
            tag.abi == "none"
            and re.fullmatch(r"py3\d*", tag.interpreter)
            and int(tag.interpreter[3:] or 0) <= python[1]
        ):
            return True  # py3, and py37 = "3.7 or newer" (pip's compatible tags list py3X for every X <= ours)
    return False


@functools.cache
def _allows(requires_python: str | None, python: tuple[int, int]) -> bool:
    if not requires_python:
        return True
    try:
        return SpecifierSet(requires_python).contains(f"{python[0]}.{python[1]}.0")
    except InvalidSpecifier:
        return True  # pip ignores a requires-python it cannot parse


def judge(pin: Pin, dists: list[Dist], python: tuple[int, int], arch: str) -> tuple[str, str]:
    """What pip picks for ``pin``: the newest release matching the spec that has a file allowed on ``python``
    (requires-python, not yanked); "ok" when that release has a wheel for ``python`` / ``arch``, else "missing"
    (pip would build its sdist, or find nothing)."""
    usable = [d for d in dists if _allows(d.requires_python, python) and not d.yanked]
    if not usable:
        have = sorted({str(d.version) for d in dists}, key=Version)
        why = "no release matches" if not have else f"{', '.join(have)}: requires-python excludes it, or yanked"
        return "missing", why
    newest = max(d.version for d in usable)
    files = [d for d in usable if d.version == newest]
    wheels = [d.filename for d in files if d.filename.endswith(".whl") and wheel_fits(d.filename, python, arch)]
    if wheels:
        return "ok", sorted(wheels)[0]
    sdist = any(not d.filename.endswith(".whl") for d in files)
    return "missing", f"{newest}: no wheel for cp{python[0]}{python[1]} {arch}" + (" (sdist only)" if sdist else "")


def _sources(pin: Pin, extra: list[str]) -> list[str]:
    local = re.search(r"\+([a-z0-9]+)", pin.spec)
    implied = LOCAL_INDEXES.get(local[1]) if local else None
    return [PYPI, *extra] + ([implied] if implied and implied not in extra else [])


def _exact(pin: Pin) -> str | None:
    return pin.spec[2:].strip() if pin.spec.startswith("==") and "*" not in pin.spec else None


def check_file(path: Path, indexes: Indexes, pythons=None) -> list[Result]:
    """Every pin of ``path`` on every (Python, platform) it supports. An extra index that is down leaves a pin
    "unchecked" only when PyPI has no release for it (a +cpu build); otherwise PyPI's files decide, as they do for
    pip: the extra index adds CPU builds of torch, it does not take PyPI's wheels away."""
    pins, extra, stated = read_requirements(path)
    pythons = pythons or stated
    with ThreadPoolExecutor(16) as pool:  # ~200 projects in the CPU lock: one request each, in parallel
        fetched = list(pool.map(lambda p: {s: indexes.fetch(s, p.name, _exact(p)) for s in _sources(p, extra)}, pins))
    results = []
    for pin, per_index in zip(pins, fetched, strict=True):
        spec = SpecifierSet(pin.spec)  # pip's rule: pre-releases only where the pin names one (==0.11.0rc1)
        pre = bool(spec.prereleases)
        dists = [d for found in per_index.values() if found for d in found if spec.contains(d.version, pre)]
        down = [s for s, found in per_index.items() if found is None]
        for python in pythons:
            for arch in PLATFORMS.get(path.name, ("x86_64",)):
                status, detail = judge(pin, dists, python, arch)
                if status == "missing" and down and not any(d.index == PYPI for d in dists):
                    status, detail = "unchecked", f"{detail}; not reachable: {', '.join(down)}"
                elif down:  # pip would look there too (torch 2.10.0+cpu on x86_64): say what was not seen
                    detail += f" (PyPI's files only; not reachable: {', '.join(down)})"
                results.append(Result(path.name, pin, python, arch, status, detail))
    return results


def pypi_reachable(indexes: Indexes) -> str | None:
    """None when PyPI answers, else why not (the test skips with it)."""
    indexes.release_api()  # one small request; a mirror without the release JSON answers 404: still reachable
    return indexes.unreachable.get(PYPI)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=list(PLATFORMS), help="requirement files (default: all three)")
    parser.add_argument("--python", action="append", help="X.Y; repeatable (default: what each file supports)")
    parser.add_argument("--all", action="store_true", help="print every result, not only the ones that are not ok")
    args = parser.parse_args(argv)
    pythons = tuple(tuple(int(n) for n in v.split(".")) for v in args.python) if args.python else None
    indexes = Indexes()
    down = pypi_reachable(indexes)
    if down:
        print(f"check_wheels: PyPI is not reachable ({down})", file=sys.stderr)
        return 2
    bad = 0
    for name in args.files:
        path = Path(name) if Path(name).exists() else REPO / name
        for r in check_file(path, indexes, pythons):
            bad += r.status == "missing"
            if args.all or r.status != "ok":
                where = f"cp{r.python[0]}{r.python[1]} {r.platform}"
                print(f"{r.status:9} {r.file}:{r.pin.line} {r.pin.name}{r.pin.spec} [{where}] {r.detail}")
    for index, error in indexes.unreachable.items():
        print(f"check_wheels: {index} not reachable ({error}); pins only it serves are unchecked", file=sys.stderr)
    print(f"check_wheels: {bad} pin/Python/platform combinations without a wheel")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
