"""Installed (or planned, ``--versions``) package versions against the compatibility matrix in
:mod:`.matrix`: torch_npu <-> torch <-> CANN, vllm-ascend <-> vllm / CANN / torch_npu, MindSpeed <->
megatron-core / CANN, Python per torch, known-bad releases, cross-package pins, and the distance from the
tested stack of this platform. The rules read the tables; adding a release is a data change.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

from .ascend import cann_for_torch_npu
from .check import Check
from .matrix import KNOWN_BAD, MINDSPEED, REQUIREMENTS, STACKS, TORCH_PYTHON, VLLM_ASCEND, MindSpeedRow, Stack
from .versions import compare, matches, normalize_name, release

# Installed distributions whose declared dependencies can move a pinned package when they are installed with
# them: MindSpeed's setup.py declares its whole requirements.txt (numpy<=1.26.0, gpytorch, scikit-learn, ...),
# which docs/install-npu.md therefore installs with --no-deps.
DECLARERS = ("mindspeed",)
_REQUIRES = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9_.\-]*)\s*(?:\[[^\]]*\])?\s*\(?([^;()]*)\)?\s*(?:;(.*))?$")


# Both 0.12.1 MindSpeed branches we hold declare ``__version__ = '0.12.1'`` in their setup.py, so pip shows either as
# mindspeed 0.12.1. A file one branch has and the others lack tells them apart (diff of the three archives'
# mindspeed/ trees, ../shared/upstream): core_r0.16.0 (pip: 0.16.0, keyed by its MINDSPEED row "0.16.0") has the
# DSA module spec of Mcore 0.16's experimental_attention_variant package (the features_manager/.../dsa.py beside it
# is in 26.1.0 too), 26.1.0 added the dist-checkpointing adaptor, 2.2.0 still has the legacy pipe-experts MoE module.
# First match wins.
MINDSPEED_BRANCH_MARKERS = (
    ("0.16.0", "core/transformer/experimental_attention_variant/dsa_module_spec.py"),
    ("26.1.0", "core/dist_checkpointing/checkpoint_adaptor.py"),
    ("2.2.0", "moe/pipe_experts.py"),
)
UNKNOWN_BRANCH = "unknown"


def mindspeed_package_dir() -> Path | None:
    """The installed ``mindspeed`` package's directory, found without importing it (its adaptor patches torch at
    import); None without one, or for PyPI's empty placeholder (no megatron_adaptor.py)."""
    try:
        spec = importlib.util.find_spec("mindspeed")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "megatron_adaptor.py").is_file():
            return Path(location)
    return None


def mindspeed_branch(package_dir: Path | None) -> tuple[str, str] | None:
    """(branch, evidence) of the MindSpeed source in ``package_dir``: a release of MINDSPEED_BRANCH_MARKERS and the
    marker file found, or (UNKNOWN_BRANCH, why) when it has none of them; None without a package."""
    if package_dir is None:
        return None
    for branch, marker in MINDSPEED_BRANCH_MARKERS:
        if (package_dir / marker).is_file():
            return branch, f"has mindspeed/{marker}"
    markers = ", ".join(f"mindspeed/{m}" for _, m in MINDSPEED_BRANCH_MARKERS)
    return UNKNOWN_BRANCH, f"none of {markers} in {package_dir}"


def observed(ctx) -> dict[str, str]:
    """Package versions plus the host facts the matrix pins (cann, python) and, for an installed MindSpeed, the
    branch its files show (``mindspeed-branch``, ``mindspeed-evidence``)."""
    seen = dict(ctx.versions)
    cann = (ctx.planned or {}).get("cann") or ctx.install.cann
    if cann:
        seen["cann"] = cann
    found = mindspeed_branch(mindspeed_package_dir()) if ctx.planned is None and "mindspeed" in seen else None
    if found:
        seen["mindspeed-branch"], seen["mindspeed-evidence"] = found
        from ..megatron_lm import training_root

        seen["megatron-training"] = training_root() or ""  # "": not importable on this node
    return seen


def check_python(ctx) -> list[Check]:
    seen = observed(ctx)
    python, torch = seen["python"], seen.get("torch")
    bounds = TORCH_PYTHON.get(".".join(map(str, release(torch, 2)))) if torch else None
    if bounds and not (compare(python, bounds[0]) >= 0 and release(python, 2) <= release(bounds[1], 2)):
        return [
            Check(
                "python",
                "fail",
                f"Python {python} is outside torch {torch}'s supported {bounds[0]}–{bounds[1]}",
                f"use a Python {bounds[0]}–{bounds[1]} environment",
            )
        ]
    return [Check("python", "ok", f"Python {python} on {ctx.machine}")]


def check_listing(ctx) -> list[Check]:
    seen = {k: v for k, v in ctx.versions.items() if k != "python"}
    source = f"planned (from {ctx.versions_file})" if ctx.planned is not None else "installed"
    found = mindspeed_branch(mindspeed_package_dir()) if ctx.planned is None and "mindspeed" in seen else None
    if found:  # on every platform, not only where compat-mindspeed runs: pip's 0.12.1 names no branch
        row = mindspeed_row(found[0]) if found[0] != UNKNOWN_BRANCH else None
        seen["mindspeed"] += f" (branch {row.branch if row else found[0]})"
    listed = ", ".join(f"{k} {v}" for k, v in sorted(seen.items())) or "none"
    checks = [Check("packages", "ok", f"{source}: {listed}")]
    if "torch" not in seen:
        checks.append(Check("torch", "fail", "torch is not installed", "run scripts/setup.sh (CPU) or see docs/"))
    return checks


def check_torch_npu_pair(seen: dict[str, str]) -> list[Check]:
    tn, torch, cann = seen.get("torch-npu"), seen.get("torch"), seen.get("cann")
    if not tn:
        return []
    checks = []
    if torch and release(torch) != release(tn):
        checks.append(
            Check(
                "compat-torch",
                "fail",
                f"torch {torch} with torch_npu {tn}: torch_npu is built for torch {'.'.join(map(str, release(tn)))}",
                f"install torch=={'.'.join(map(str, release(tn)))} (CPU wheel) next to torch_npu",
            )
        )
    needed = cann_for_torch_npu(tn)
    if needed is None:
        checks.append(
            Check("compat-cann", "warn", f"torch_npu {tn} is not in the CANN table", "see docs/version-matrix.md")
        )
    elif cann:
        order = compare(cann, needed)
        status = "ok" if order == 0 else "fail" if order < 0 else "warn"
        finding = {
            "ok": f"CANN {cann} matches torch_npu {tn}",
            "fail": f"CANN {cann} is too old for torch_npu {tn} (built for CANN {needed})",
            "warn": f"CANN {cann} is newer than torch_npu {tn}'s CANN {needed} (untested pairing)",
        }[status]
        fix = "" if status == "ok" else f"install CANN {needed}, or the torch_npu listed for CANN {cann}"
        checks.append(Check("compat-cann", status, finding, fix))
    return checks


def check_vllm_ascend(seen: dict[str, str]) -> list[Check]:
    va = seen.get("vllm-ascend")
    if not va:
        return []
    row = next((r for r in VLLM_ASCEND if compare(r.vllm_ascend[0], va) <= 0 <= compare(r.vllm_ascend[1], va)), None)
    if row is None:
        return [
            Check("compat-vllm-ascend", "warn", f"vllm-ascend {va} is not in the table", "see docs/version-matrix.md")
        ]
    problems, status = [], "ok"
    vllm = seen.get("vllm")
    if not vllm or release(vllm) != release(va):
        problems.append(f"needs vllm {'.'.join(map(str, release(va)))}, found {vllm or 'none'}")
        status = "fail"
    if seen.get("cann") and compare(seen["cann"], row.cann) < 0:
        problems.append(f"needs CANN >= {row.cann}, found {seen['cann']}")
        status = "fail"
    if seen.get("torch-npu") and seen["torch-npu"] != row.torch_npu:
        problems.append(f"tested with torch_npu {row.torch_npu}, found {seen['torch-npu']}")
        status = "warn" if status == "ok" else status
    if not problems:
        return [Check("compat-vllm-ascend", "ok", f"vllm-ascend {va} with vllm {vllm}, CANN {seen.get('cann', '?')}")]
    fix = f"use vllm {'.'.join(map(str, release(va)))}, CANN {row.cann}, torch_npu {row.torch_npu}"
    return [Check("compat-vllm-ascend", status, f"vllm-ascend {va}: " + "; ".join(problems), fix)]


def mindspeed_row(version: str) -> MindSpeedRow | None:
    """MindSpeed's row for a release number (2.2.0, from --versions) or for what pip shows of a branch install
    (0.12.1: branch 2.2.0_core_r0.12.1 declares that version in its setup.py; 0.16.0: branch core_r0.16.0)."""
    want = release(version)
    exact = next((r for r in MINDSPEED if release(r.mindspeed) == want), None)
    # 0.12.1 alone (a --versions file, no files to look at) is read as 2.2.0, the first branch that declared it;
    # an installed MindSpeed is told apart by its files (mindspeed_branch)
    return exact or next((r for r in MINDSPEED if r.installs_as and release(r.installs_as) == want), None)


def check_mindspeed(seen: dict[str, str]) -> list[Check]:
    version = seen.get("mindspeed")
    if not version:
        return []
    branch, evidence = seen.get("mindspeed-branch"), seen.get("mindspeed-evidence", "")
    if branch == UNKNOWN_BRANCH:
        return [
            Check(
                "compat-mindspeed",
                "warn",
                f"MindSpeed (pip: {version}) is none of the branches we test: {evidence}",
                "install branch core_r0.16.0 (current line) or 26.1.0_core_r0.12.1 (previous line); "
                "docs/install-npu.md",
            )
        ]
    row = mindspeed_row(branch or version)
    if row is None:
        return [
            Check("compat-mindspeed", "warn", f"MindSpeed {version} is not in the table", "see docs/version-matrix.md")
        ]
    if branch:  # an installed branch: say which one and the file that shows it
        ms = f"{row.mindspeed} (branch {row.branch}: {evidence}; pip: {version})"
    else:
        ms = row.mindspeed if release(version) == release(row.mindspeed) else f"{row.mindspeed} (pip: {version})"
    core = seen.get("megatron-core")
    if row.megatron_core and core != row.megatron_core:
        return [
            Check(
                "compat-mindspeed",
                "fail",
                f"MindSpeed {ms} patches megatron-core {row.megatron_core}, found {core or 'none'}",
                f"pip install megatron-core=={row.megatron_core} (MindSpeed branch {row.branch})",
            )
        ]
    if seen.get("cann") and compare(seen["cann"], row.cann) < 0:
        return [
            Check(
                "compat-mindspeed",
                "fail",
                f"MindSpeed {ms} needs CANN {row.cann}, found {seen['cann']}",
                f"install CANN {row.cann}",
            )
        ]
    return [Check("compat-mindspeed", "ok", f"MindSpeed {ms} with megatron-core {core or '-'}")]


def check_megatron_training(seen: dict[str, str]) -> list[Check]:
    """MindSpeed 26.1.0 imports Megatron-LM's ``megatron.training``: importable on this node (megatron_lm.py)?"""
    from ..megatron_lm import MINDSPEED_NEEDS_IT

    branch, root = seen.get("mindspeed-branch"), seen.get("megatron-training")
    if branch not in MINDSPEED_NEEDS_IT or root is None:
        return []
    if root:
        return [Check("megatron-lm", "ok", f"megatron.training (MindSpeed {branch} imports it) from {root}")]
    return [
        Check(
            "megatron-lm",
            "fail",
            f"MindSpeed {branch} imports Megatron-LM's megatron.training, which this Python cannot import (PyPI's "
            "megatron-core has megatron.core only)",
            "put the Megatron-LM core_v0.12.1 checkout on the venv's path: echo /path/to/Megatron-LM > "
            "\"$(python -c 'import site; print(site.getsitepackages()[0])')/megatron-lm.pth\" (docs/install-npu.md)",
        )
    ]


def check_known_bad(seen: dict[str, str], platform: str) -> list[Check]:
    return [
        Check(f"known-bad-{bad.package}", "fail", f"{bad.package} {seen[bad.package]}: {bad.problem}", bad.fix)
        for bad in KNOWN_BAD
        if platform in bad.platforms and seen.get(bad.package) in bad.versions
    ]


def check_requirements(seen: dict[str, str], platform: str) -> list[Check]:
    checks = []
    for req in REQUIREMENTS:
        have = seen.get(req.package)
        if platform not in req.platforms or not have or not matches(have, req.when):
            continue
        need = seen.get(req.needs)
        if need is None or not matches(need, req.spec):
            checks.append(
                Check(
                    f"requires-{req.needs}",
                    "fail",
                    f"{req.package} {have} needs {req.needs} {req.spec}, found {need or 'none'} ({req.why})",
                    f"pip install '{req.needs}{'' if req.spec == '*' else req.spec}'",
                )
            )
    return checks


def check_stack(
    seen: dict[str, str], platform: str, declared: dict[str, list[tuple[str, str]]] | None = None
) -> list[Check]:
    """One line: the tested stack of this platform that the packages match (a previous line says so), or the
    packages that differ from the nearest one (fewest differences; the current line on a tie), each with its cause
    where an installed distribution's declared requirement explains it (``declared``: :func:`declared_requirements`)."""
    stacks = [s for s in STACKS if s.platform == platform]
    if not stacks:
        return []
    installed = seen
    ms = seen.get("mindspeed-branch") or seen.get("mindspeed")
    row = mindspeed_row(ms) if ms else None
    if row is not None:  # the stacks pin MindSpeed releases; pip shows a branch's own version (0.12.1)
        seen = {**seen, "mindspeed": row.mindspeed}
    stack, differing = min(((s, _differing(seen, s)) for s in stacks), key=lambda pair: len(pair[1]))
    if not differing:
        return [Check("stack", "ok", f"matches the {stack.name}" + _previous_note(stack))]
    differs, fixes = [], []
    for package, spec in differing:
        cause = _declared_cause(package, spec, installed, declared or {})
        differs.append(f"{package} {seen.get(package, 'none')} (tested {spec.lstrip('=')}{cause[0] if cause else ''})")
        fixes += [cause[1]] if cause else []
    rest = f"pin the tested versions ({stack.source}) or report results with this block"
    fix = "; ".join(fixes + ([] if len(fixes) == len(differs) else [("for the rest, " if fixes else "") + rest]))
    return [Check("stack", "warn", f"differs from the {stack.name}: " + ", ".join(differs), fix)]


def _differing(seen: dict[str, str], stack: Stack) -> list[tuple[str, str]]:
    """The (package, spec) pins of ``stack`` that ``seen`` does not meet, a field alternative counting as met."""
    return [
        (package, spec)
        for package, spec in stack.pins
        if not (_pin_ok(seen, package, spec) or any(_pin_ok(seen, p, s) for p, s, _ in stack.field if p == package))
    ]


def _previous_note(stack: Stack) -> str:
    """For a previous line: why it is kept and what the current line of its platform is."""
    if not stack.previous:
        return ""
    current = next(s for s in STACKS if s.platform == stack.platform and not s.previous)
    keys = ("cann", "torch-npu", "vllm-ascend", "megatron-core")
    pins = ", ".join(f"{p} {s.lstrip('=')}" for p, s in current.pins if p in keys)
    return f" ({stack.previous}); the current line is {pins} (docs/install-{stack.platform}.md)"


def _declared_cause(package: str, spec: str, installed: dict[str, str], declared) -> tuple[str, str] | None:
    """(finding suffix, fix) when an installed distribution declares a requirement on ``package`` that the installed
    version meets and the pinned one (``==X``) does not: pip moved the pin to satisfy it (MindSpeed's numpy<=1.26.0
    turns numpy 1.26.4 into 1.26.0)."""
    have = installed.get(package)
    if not have or not spec.startswith("=="):
        return None
    for dist, requirements in declared.items():
        for name, want in requirements:
            if name == package and matches(have, want) and not matches(spec[2:], want):
                return (
                    f"; {dist} {installed.get(dist, '?')} declares {package}{want}, which pip applies when {dist} "
                    "is installed with its dependencies",
                    f"pip install {package}{spec}; install {dist} with pip install --no-deps (docs/install-npu.md)",
                )
    return None


def declared_requirements(ctx, names: tuple[str, ...] = DECLARERS) -> dict[str, list[tuple[str, str]]]:
    """{distribution: [(package, version spec)]}: the Requires-Dist of the installed ``names`` (not those of an extra,
    and only the version operators :func:`matches` reads). Empty for a planned stack: nothing is installed there."""
    if ctx.planned is not None:
        return {}
    found = {}
    for name in names:
        try:
            lines = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        found[name] = [r for r in map(_requirement, lines) if r is not None]
    return found


def _requirement(line: str) -> tuple[str, str] | None:
    match = _REQUIRES.match(line)
    if not match or "extra" in (match[3] or "") or not match[2].strip() or re.search(r"~=|===", match[2]):
        return None
    return normalize_name(match[1]), match[2].replace(" ", "")


def _pin_ok(seen: dict[str, str], package: str, spec: str) -> bool:
    return package in seen and matches(seen[package], spec)


def package_checks(ctx) -> list[Check]:
    seen, platform = observed(ctx), ctx.platform
    checks = check_python(ctx) + check_listing(ctx)
    if platform == "npu":
        checks += check_torch_npu_pair(seen) + check_vllm_ascend(seen) + check_mindspeed(seen)
        checks += check_megatron_training(seen)
    checks += check_known_bad(seen, platform) + check_requirements(seen, platform)
    return checks + check_stack(seen, platform, declared_requirements(ctx))
