"""Built-in model specs (gspo_ascend/doctor/model_specs.json): the architecture facts of the models our configs and
scripts name, so that plan / doctor --config / train --dry-run work without the weights.

Every entry is checked against something the entry was not derived from: the two published config.json copies in
tests/fixtures/models, the exact parameter counts the repo already states (planner tests, docs/memory-planner.md),
the parameter counts each model card publishes, and the KV-head counts of the field reports. How a model.path
maps to an entry: exact hub id, or the last path component, case-insensitively; a local config.json wins.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import replace

import pytest

from gspo_ascend.doctor.modelspec import builtin_ids, builtin_match, builtin_specs, load_spec, spec_from_dict
from gspo_ascend.errors import UserError
from tests.conftest import REPO

MODELS = REPO / "tests/fixtures/models"
FIXTURES = {"Qwen/Qwen3-30B-A3B": MODELS / "qwen3-30b-a3b", "Qwen/Qwen2.5-3B": MODELS / "qwen2.5-3b"}


def builtin(hub_id: str):
    return load_spec(hub_id)


# ----------------------------------------------------------------------------------------------- the data


def test_every_entry_cites_its_published_config_and_parses():
    ids = builtin_ids()
    assert len(ids) == 14
    for hub_id, entry in builtin_specs().items():
        assert entry["source"] == f"https://huggingface.co/{hub_id}/blob/main/config.json"
        spec = spec_from_dict(entry["config"], hub_id)  # a real config.json's parser, not a second one
        assert spec.model_type in ("qwen3", "qwen3_moe", "qwen2"), hub_id


@pytest.mark.parametrize("hub_id", sorted(FIXTURES))
def test_entries_equal_the_published_config_json_copies(hub_id):
    # the fixtures are verbatim copies of the hub's config.json (tests/fixtures/models)
    published = json.loads((FIXTURES[hub_id] / "config.json").read_text())
    entry = builtin_specs()[hub_id]["config"]
    assert {k: published[k] for k in entry} == entry  # every field we ship is the published value
    from_file, from_data = load_spec(str(FIXTURES[hub_id])), builtin(hub_id)
    assert replace(from_data, source="", builtin="", note="") == replace(from_file, source="")


def test_parameter_counts_the_repo_states():
    # tests/unit/test_planner.py and docs/memory-planner.md, hand-derived from the fixtures' config.json
    moe, dense = builtin("Qwen/Qwen3-30B-A3B"), builtin("Qwen/Qwen2.5-3B")
    assert moe.total_params == 30_532_122_624 and moe.active_params == 3_353_032_704
    assert dense.total_params == 3_085_938_688


# The model cards' "Number of Parameters" (total, non-embedding; MoE: activated) in billions, as the cards write
# them (huggingface.co/<id>, "Model Overview"). Non-embedding = total minus the input embedding and an untied
# lm_head, which is how the cards' figures add up (Qwen2.5-7B: 7.61 - 2 x 152064 x 3584 / 1e9 = 6.53).
CARDS = {
    "Qwen/Qwen3-0.6B": ("0.6", "0.44", None),
    "Qwen/Qwen3-1.7B": ("1.7", "1.4", None),
    "Qwen/Qwen3-4B": ("4.0", "3.6", None),
    "Qwen/Qwen3-8B": ("8.2", "6.95", None),
    "Qwen/Qwen3-14B": ("14.8", "13.2", None),
    "Qwen/Qwen3-32B": ("32.8", "31.2", None),
    "Qwen/Qwen3-30B-A3B": ("30.5", "29.9", "3.3"),
    "Qwen/Qwen3-235B-A22B": ("235", "234", "22"),
    "Qwen/Qwen2.5-0.5B": ("0.49", "0.36", None),
    "Qwen/Qwen2.5-1.5B": ("1.54", "1.31", None),
    "Qwen/Qwen2.5-3B": ("3.09", "2.77", None),
    "Qwen/Qwen2.5-7B": ("7.61", "6.53", None),
    "Qwen/Qwen2.5-14B": ("14.7", "13.1", None),
    "Qwen/Qwen2.5-32B": ("32.5", "31.0", None),
}
# The Qwen2.5-14B / -32B cards state figures 0.7-0.8 % below what their published config.json shapes add up to
# (32.76 B for 32B); we cannot read the safetensors here, so for those two a 1 % margin stands in for the last digit.
CARD_MARGIN = {"Qwen/Qwen2.5-14B": 0.01, "Qwen/Qwen2.5-32B": 0.01}


def card_agrees(count: int, stated: str, margin: float | None) -> bool:
    """Within one unit of the card's last stated digit (cards round or truncate), or within ``margin``."""
    value, billions = float(stated), count / 1e9
    digits = len(stated.split(".")[1]) if "." in stated else 0
    tolerance = max(10.0**-digits, margin * value if margin else 0.0)
    return abs(billions - value) <= tolerance + 1e-12


@pytest.mark.parametrize("hub_id", sorted(CARDS))
def test_parameter_counts_match_the_model_card(hub_id):
    spec, (total, non_embedding, active) = builtin(hub_id), CARDS[hub_id]
    embeddings = spec.embedding_params * (1 if spec.tied else 2)
    margin = CARD_MARGIN.get(hub_id)
    assert card_agrees(spec.total_params, total, margin), (hub_id, spec.total_params)
    assert card_agrees(spec.total_params - embeddings, non_embedding, margin), (hub_id, spec.total_params - embeddings)
    assert spec.is_moe == (active is not None)
    if active:
        assert card_agrees(spec.active_params, active, margin), (hub_id, spec.active_params)


def test_kv_heads_as_the_field_reports_state():
    # field failure "num_query_groups (4) must be a multiple of tensor_model_parallel_size (8)": Qwen3-30B-A3B and
    # 235B have 4 KV heads, the dense Qwen3 models 8 (shared/reference/npu_api.md, the TP limit it explains)
    for hub_id in builtin_ids():
        spec = builtin(hub_id)
        if spec.model_type == "qwen3":
            assert spec.kv_heads == 8 and spec.head_dim == 128 and spec.qk_norm and not spec.qkv_bias, hub_id
        if spec.model_type == "qwen3_moe":
            assert (spec.kv_heads, spec.experts, spec.top_k) == (4, 128, 8), hub_id
        if spec.model_type == "qwen2":
            assert spec.qkv_bias and not spec.qk_norm, hub_id  # Qwen2.5: "Attention QKV bias" (model cards)


def test_the_wheel_ships_the_data_file():
    # the [tool.setuptools.package-data] line (tomllib is 3.11+; we support 3.10); the wheel build itself is
    # tests/unit/test_packaging.py's
    data = (REPO / "pyproject.toml").read_text().split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    (line,) = re.findall(r'^"gspo_ascend\.doctor" = \[(.*)\]$', data, re.M)
    assert any(fnmatch.fnmatch("model_specs.json", g.strip().strip('"')) for g in line.split(","))
    assert (REPO / "gspo_ascend/doctor/model_specs.json").is_file()


@pytest.mark.parametrize("doc", ["doctor.md", "memory-planner.md", "launch-scripts.md", "trainer.md"])
def test_docs_list_every_builtin_id(doc):
    text = (REPO / "docs" / doc).read_text()
    missing = [hub_id for hub_id in builtin_ids() if f"`{hub_id}`" not in text]
    assert missing == [], (doc, missing)


# ----------------------------------------------------------------------------------------------- model.path


@pytest.mark.parametrize(
    "path, hub_id, how",
    [
        ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B", "the hub id"),
        ("qwen/qwen3-8b", "Qwen/Qwen3-8B", "the hub id"),
        ("/models/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B", "its last path component 'Qwen3-30B-A3B'"),
        ("/data/hf/qwen2.5-3b/", "Qwen/Qwen2.5-3B", "its last path component 'qwen2.5-3b'"),
        ("someone/Qwen3-235B-A22B", "Qwen/Qwen3-235B-A22B", "its last path component 'Qwen3-235B-A22B'"),
    ],
)
def test_model_path_matches_by_hub_id_or_last_component(path, hub_id, how):
    assert builtin_match(path) == (hub_id, how)
    spec = load_spec(path)
    assert spec.builtin == hub_id and spec.source == f"built-in spec {hub_id}"
    assert spec.note == (
        f"model.path '{path}' has no config.json: using the built-in spec of {hub_id} (matched by {how}; fields of "
        f"https://huggingface.co/{hub_id}/blob/main/config.json)"
    )


@pytest.mark.parametrize("path", ["/models/Qwen3-30B-A3B-Instruct-2507", "/models/Qwen3", "Qwen/Qwen2.5-7B-Instruct"])
def test_other_names_do_not_match(path):
    # -Instruct / -2507 releases publish their own config.json (other position limits): no guessing
    assert builtin_match(path) is None


def test_a_local_config_json_wins_over_the_builtin_entry(tmp_path):
    local = tmp_path / "Qwen3-30B-A3B"
    local.mkdir()
    published = json.loads((MODELS / "qwen3-30b-a3b/config.json").read_text())
    (local / "config.json").write_text(json.dumps({**published, "max_position_embeddings": 262144}))
    spec = load_spec(str(local))
    assert spec.builtin == "" and spec.note == "" and spec.max_positions == 262144
    (local / "config.json").unlink()  # a directory without config.json (weights elsewhere): the built-in spec
    assert load_spec(str(local)).builtin == "Qwen/Qwen3-30B-A3B"


def test_unknown_name_is_one_line_listing_the_builtin_ids():
    with pytest.raises(UserError) as err:
        load_spec("Qwen/Qwen9-1B")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("model.path 'Qwen/Qwen9-1B' has no config.json and names no model with a built-in spec")
    assert message.endswith("use one of: " + ", ".join(builtin_ids()))
