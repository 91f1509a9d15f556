"""Config schema: YAML + dotted overrides, strictness, one-line errors, every shipped YAML validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from gspo_ascend import config
from gspo_ascend.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

REQUIRED_KEYS = """model.path data.train_files data.val_files data.prompt_key data.max_prompt_length
data.max_response_length data.train_batch_size rollout.engine rollout.n rollout.temperature rollout.top_p
rollout.tensor_parallel_size rollout.gpu_memory_utilization actor.engine actor.lr actor.ppo_mini_batch_size
actor.micro_batch_size actor.tensor_parallel_size actor.pipeline_parallel_size actor.expert_parallel_size
actor.expert_tensor_parallel_size actor.grad_clip algorithm.loss algorithm.clip_ratio_low
algorithm.clip_ratio_high algorithm.loss_agg_mode algorithm.old_logprobs trainer.device trainer.nnodes
trainer.devices_per_node trainer.total_steps trainer.output_dir trainer.save_freq trainer.resume
trainer.seed""".split()


def test_issue_keys_exist():
    assert set(REQUIRED_KEYS) <= set(config.valid_keys())


def test_paper_defaults():
    cfg = config.load_config()
    assert cfg.algorithm.loss == "gspo"
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high) == (3e-4, 4e-4)
    assert cfg.algorithm.kl_coef == 0.0
    assert cfg.algorithm.loss_agg_mode == "seq-mean-token-mean"
    # 4 minibatches per rollout batch
    assert cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size == 4


def test_yaml_then_overrides_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  loss: grpo\n  clip_ratio_low: 0.2\ndata:\n  train_files: [a.parquet]\n")
    cfg = config.load_config(
        path, ["algorithm.clip_ratio_low=3e-4", "trainer.total_steps=7", "data.val_files=[v1, v2]"]
    )
    assert cfg.algorithm.loss == "grpo"  # from YAML
    assert cfg.algorithm.clip_ratio_low == pytest.approx(3e-4) and isinstance(cfg.algorithm.clip_ratio_low, float)
    assert cfg.trainer.total_steps == 7
    assert cfg.data.train_files == ["a.parquet"] and cfg.data.val_files == ["v1", "v2"]
    # dumping and reloading gives the same config
    import yaml

    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(yaml.safe_dump(config.to_dict(cfg)))
    assert config.load_config(dumped) == cfg


def test_minibatches_resolution():
    # neither set: the paper's 4 minibatches
    cfg = config.load_config(None, ["data.train_batch_size=32"])
    assert (cfg.actor.ppo_mini_batch_size, cfg.algorithm.minibatches_per_rollout) == (8, 4)
    # only the mini-batch size (verl style): the count follows
    cfg = config.load_config(None, ["data.train_batch_size=32", "actor.ppo_mini_batch_size=16"])
    assert cfg.algorithm.minibatches_per_rollout == 2
    # only the count (paper style): the size follows
    cfg = config.load_config(None, ["data.train_batch_size=32", "algorithm.minibatches_per_rollout=8"])
    assert cfg.actor.ppo_mini_batch_size == 4
    # both, agreeing: fine; disagreeing: refused, naming both keys
    config.load_config(None, ["actor.ppo_mini_batch_size=4", "algorithm.minibatches_per_rollout=4"])
    with pytest.raises(
        ConfigError, match="'actor.ppo_mini_batch_size' .8. and 'algorithm.minibatches_per_rollout' .4."
    ):
        config.load_config(None, ["actor.ppo_mini_batch_size=8", "algorithm.minibatches_per_rollout=4"])
    with pytest.raises(ConfigError, match="'algorithm.minibatches_per_rollout' .3. must be > 0 and divide"):
        config.load_config(None, ["algorithm.minibatches_per_rollout=3"])


def test_presets_apply_as_overrides():
    from gspo_ascend.algorithms import PRESETS

    for name, preset in PRESETS.items():
        cfg = config.load_config(None, [f"{k}={v}" for k, v in preset.items()])
        assert cfg.algorithm.loss == preset["algorithm.loss"], name
        assert cfg.algorithm.clip_ratio_high == preset["algorithm.clip_ratio_high"]
        assert cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size == preset["algorithm.minibatches_per_rollout"]


def test_int_widens_to_float_and_null_for_optional():
    cfg = config.load_config(
        None, ["actor.lr=1", "actor.micro_batch_size=null", "actor.max_tokens_per_micro_batch=4096"]
    )
    assert cfg.actor.lr == 1.0 and isinstance(cfg.actor.lr, float)
    assert cfg.actor.micro_batch_size is None


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("algorithm.clip_ratio_lo=0.1", "algorithm.clip_ratio_low"),
        ("algorithm.clip_low=0.1", "algorithm.clip_ratio_low"),
        ("trainer.total_step=3", "trainer.total_steps"),
        ("rolout.n=4", "rollout.n"),
    ],
)
def test_unknown_key_names_closest(override, suggestion):
    with pytest.raises(ConfigError) as err:
        config.load_config(None, [override])
    msg = str(err.value)
    assert override.split("=")[0] in msg and f"did you mean '{suggestion}'" in msg
    assert "\n" not in msg


def test_field_failure_7_dapo_key_is_named():
    # field failure #7: a DAPO option left in a GSPO script
    with pytest.raises(ConfigError, match="unknown config key 'algorithm.filter_groups.enable'"):
        config.load_config(None, ["algorithm.filter_groups.enable=true"])


def test_unknown_key_in_yaml_names_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("actor:\n  learning_rate: 1e-6\n")
    with pytest.raises(ConfigError) as err:
        config.load_config(path)
    assert str(path) in str(err.value) and "actor.learning_rate" in str(err.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.n=four", "'rollout.n' must be int, got 'four'"),
        ("actor.lr=fast", "'actor.lr' must be float, got 'fast'"),
        ("algorithm.loss=ppo", "'algorithm.loss' must be one of 'gspo', 'gspo_token', 'grpo', got 'ppo'"),
        ("trainer.device=tpu", "'trainer.device' must be one of 'auto', 'cpu', 'cuda', 'npu'"),
        ("model.gradient_checkpointing=3", "'model.gradient_checkpointing' must be bool, got 3"),
        ("rollout.n=true", "'rollout.n' must be int, got True"),
    ],
)
def test_type_errors_name_key_type_value(override, expected):
    with pytest.raises(ConfigError) as err:
        config.load_config(None, [override])
    assert expected in str(err.value)


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        config.load_config(None, ["algorithm.loss"])


def test_section_must_be_mapping():
    with pytest.raises(ConfigError, match="'algorithm' must be a mapping"):
        config.load_config(None, ["algorithm=3"])


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["actor.ppo_mini_batch_size=5"], "must divide 'data.train_batch_size' (16)"),
        (["rollout.n=0"], "'rollout.n' must be > 0"),
        (["data.max_response_length=-1"], "'data.max_response_length' must be > 0"),
        (
            ["actor.micro_batch_size=null"],
            "set 'actor.micro_batch_size' or 'actor.max_tokens_per_micro_batch'",
        ),
        (["algorithm.clip_ratio_low=1.5"], "'algorithm.clip_ratio_low' must be < 1"),
        (["rollout.top_p=0"], "'rollout.top_p' must be in (0, 1]"),
    ],
)
def test_cross_field_validators(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        config.load_config(None, overrides)
    assert fragment in str(err.value)


def test_validator_hook_registration():
    calls = []

    @config.validator
    def _rule(cfg):
        calls.append(cfg.trainer.seed)
        if cfg.trainer.seed == 13:
            yield "config key 'trainer.seed' must not be 13 (test rule)"

    try:
        config.load_config(None, ["trainer.seed=1"])
        with pytest.raises(ConfigError, match="must not be 13"):
            config.load_config(None, ["trainer.seed=13"])
        assert calls == [1, 13]
    finally:
        config._VALIDATORS.remove(_rule)


def shipped_yamls() -> list[Path]:
    return sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_shipped_yamls():
    assert len(shipped_yamls()) >= 2


@pytest.mark.parametrize("path", shipped_yamls(), ids=lambda p: p.name)
def test_every_shipped_yaml_validates(path):
    cfg = config.load_config(path)
    assert cfg.trainer.total_steps > 0
