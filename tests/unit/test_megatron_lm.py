"""Megatron-LM's ``megatron.training`` on every worker (audit 3 finding 1, issue #41): MindSpeed 26.1.0 imports it,
PyPI's megatron-core lacks it, and a one-off ``export PYTHONPATH`` in the install shell does not reach Ray workers
started elsewhere. Expected values by hand: the checkout's root is what ``find_spec`` finds (a real import system,
in a subprocess with a fake checkout on its path), the actors' PYTHONPATH starts with it, doctor fails without it.
"""

from __future__ import annotations

import subprocess
import sys

from gspo_ascend.config import load_config
from gspo_ascend.device import get_backend
from gspo_ascend.doctor import packages


def test_the_checkout_root_is_found_without_importing_it(tmp_path):
    training = tmp_path / "Megatron-LM" / "megatron" / "training"
    training.mkdir(parents=True)
    (training / "__init__.py").write_text("raise RuntimeError('imported')\n")  # finding must not import it
    code = "from gspo_ascend.megatron_lm import training_root; print(training_root())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(tmp_path / "Megatron-LM"), "PATH": "/usr/bin"})  # fmt: skip
    assert out.stdout.strip() == str(tmp_path / "Megatron-LM")


def test_no_megatron_training_is_none():
    from gspo_ascend.megatron_lm import training_root

    assert training_root() is None  # this venv: megatron-core from PyPI, megatron.core only


def test_every_npu_megatron_actor_gets_the_checkout_on_its_path(monkeypatch):
    from gspo_ascend import megatron_lm, workers

    monkeypatch.setattr(megatron_lm, "training_root", lambda: "/opt/Megatron-LM")
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    cfg = load_config(None, ["actor.engine=megatron", "trainer.device=npu"])
    env = workers.actor_env(cfg, get_backend("cpu"))
    assert env["PYTHONPATH"] == "/opt/Megatron-LM:/opt/site"
    fsdp = load_config(None, ["trainer.device=npu"])
    assert "PYTHONPATH" not in workers.actor_env(fsdp, get_backend("cpu"))  # MindSpeed only runs under megatron


def test_doctor_fails_a_node_where_mindspeed_26_cannot_import_it():
    (bad,) = packages.check_megatron_training({"mindspeed-branch": "26.1.0", "megatron-training": ""})
    assert bad.status == "fail" and "megatron-lm.pth" in bad.fix
    (good,) = packages.check_megatron_training({"mindspeed-branch": "26.1.0", "megatron-training": "/opt/Megatron-LM"})
    assert good.status == "ok" and good.finding.endswith("/opt/Megatron-LM")
    assert packages.check_megatron_training({"mindspeed-branch": "2.2.0", "megatron-training": ""}) == []
