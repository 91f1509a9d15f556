"""Docs hold together: relative links between docs/*.md and README.md resolve (files and #anchors); the repository
paths the install / launch / troubleshooting docs name exist; docs/troubleshooting.md covers every field failure
and Ascend failure mode with its exact message, and every check it names is one gspo-ascend doctor or the
preflight really reports. (docs/version-matrix.md against the doctor's data: tests/unit/test_doctor_matrix.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gspo_ascend.doctor import matrix
from gspo_ascend.doctor.envrules import ENV_RULES
from tests.conftest import REPO

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
OURS = [REPO / "docs" / n for n in ("install-npu.md", "install-gpu.md", "troubleshooting.md", "launch-scripts.md")]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
TROUBLE = (REPO / "docs/troubleshooting.md").read_text()

# Exact messages from the field reports (GSPO on Atlas 800T A2) and the Ascend failure modes (torch_npu, CANN,
# vllm-ascend docs), as users see them.
FIELD_MESSAGES = [
    "importlib.metadata.PackageNotFoundError: No package metadata was found for flash_attn",
    "raise e.remove_dynamo_frames() from None  # see TORCHDYNAMO_VERBOSE=1",
    "RuntimeError: Please set micro_batch_size or set use_flash_attn=True in config.",
    "ValueError: num_query_groups (4) must be a multiple of tensor_model_parallel_size (8).",
    "Could not override 'algorithm.filter_groups.enable'.",
    "NPU out of memory. Tried to allocate",
    "EL0004 Memory_Allocation_Failure",
]
ASCEND_MESSAGES = [
    "EI0006 Getting socket times out",
    "EI0002 The wait execution of the Notify register times out",
    "hccl fftsplus task timeout",
    "HcclAllreduce, error code is 6",
    "If reserved memory is >> allocated memory try",
    "Failed to infer device type",
    "libatb.so",
    "Please run 'source set_env.sh'",
    "ASCEND_HOME_PATH environment variable is not set",
    "Two accelerators cannot be used at the same time",
    "ASCEND_LAUNCH_BLOCKING=1",
    "Expandable segments are not compatible with memory pool.",
]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m[1]) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold shell, not links
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    for target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        assert dest.exists(), f"{doc.name}: link to {target} points nowhere"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{doc.name}: no heading for #{anchor} in {dest.name}"


def test_new_docs_are_linked_from_each_other():
    linked = {Path(t.partition("#")[0]).name for doc in OURS for t in links(doc)}
    assert {"install-npu.md", "install-gpu.md", "troubleshooting.md", "launch-scripts.md"} <= linked


@pytest.mark.parametrize("doc", OURS, ids=lambda p: p.name)
def test_repository_paths_named_in_the_docs_exist(doc):
    prefixes = ("scripts/", "env/", "configs/", "docs/", "tests/", "requirements-", "gspo_ascend/")
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    named = {m.rstrip(".,;:") for m in re.findall(r"`([^`\s]+)`", text) if m.startswith(prefixes)}
    assert named, doc.name
    for path in named:
        if "*" not in path and "<" not in path:
            assert (REPO / path).exists(), f"{doc.name} names {path}, which does not exist"


# ----------------------------------------------------------------------------------------------- troubleshooting


def real_check_names() -> set[str]:
    """Every finding name doctor / preflight can report, read from their code and tables."""
    names = set()
    for source in (REPO / "gspo_ascend/doctor").glob("*.py"):
        text = source.read_text()
        names |= {m for m in re.findall(r'\bCheck\(\s*"([^"{]+)"', text)}
        names |= {f"preflight:{m}" for m in re.findall(r'\b_check\(\s*"([^"]+)"', text)}
    names |= {f"env:{rule.name}" for rule in ENV_RULES}
    names |= {f"known-bad-{bad.package}" for bad in matrix.KNOWN_BAD}
    names |= {f"requires-{req.needs}" for req in matrix.REQUIREMENTS}
    return names


def entries() -> list[tuple[str, dict[str, str]]]:
    """(heading, {field: text}) for every '### ' entry; fields are the '- **name**: text' items."""
    out = []
    for block in TROUBLE.split("\n### ")[1:]:
        heading, _, body = block.partition("\n")
        fields = dict(re.findall(r"^- \*\*([a-z ]+)\*\*: (.*(?:\n  .*)*)", body, re.M))
        out.append((heading.strip(), {k: " ".join(v.split()) for k, v in fields.items()}))
    return out


def test_every_field_failure_and_ascend_failure_mode_is_covered():
    flat = " ".join(TROUBLE.split())  # messages may wrap across lines in the doc
    for message in FIELD_MESSAGES + ASCEND_MESSAGES:
        assert message in TROUBLE or " ".join(message.split()) in flat, f"troubleshooting.md lacks: {message}"
    for fact in ("pkill -9 python", "ray stop --force", "preflight:moe-folding", "NNODES=2"):
        assert fact in flat, fact  # the two "also seen" items of the field reports


def test_every_entry_has_message_cause_fix_and_check():
    found = entries()
    assert len(found) >= 20
    for heading, fields in found:
        assert set(fields) == {"message", "cause", "fix", "caught by"}, heading
        assert all(fields.values()), heading


def test_named_checks_exist():
    real = real_check_names()
    assert {"preflight:heads", "preflight:moe-folding", "env:VLLM_ASCEND_ENABLE_NZ", "known-bad-transformers"} <= real
    cited = set()
    for heading, fields in entries():
        tokens = re.findall(r"`([^`]+)`", fields["caught by"])
        names = [t for t in tokens if re.fullmatch(r"[a-z][a-z0-9_-]*(:[A-Za-z0-9_-]+)?", t)]
        if not names:
            assert fields["caught by"].lower().startswith(("nothing", "the ")), f"{heading}: {fields['caught by']}"
        for name in names:
            assert name in real or (REPO / name).exists(), f"{heading}: '{name}' is not a doctor / preflight check"
        cited |= set(names)
    assert len(cited & real) >= 15


def test_check_name_extraction_is_not_vacuous():
    real = real_check_names()
    assert "preflight:nonsense" not in real and "env:HCCL_BUFFSIZE" not in real
    assert {"ascend-env", "atb", "torch_npu", "compat-torch", "ray-cluster", "preflight:config"} <= real
