"""Metrics sinks (console, jsonl, tensorboard, wandb) and the ``plot`` command's PNGs."""

from __future__ import annotations

import io
import json
import math
import struct
import sys
import types

import pytest

from gspo_ascend import metrics as M
from gspo_ascend import plot
from gspo_ascend.errors import ConfigError, UserError


def strict_json(line: str):
    """json.loads that refuses NaN / Infinity tokens (Python's default accepts them; other readers do not)."""

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=refuse)


def jsonl_lines(run_dir) -> list[dict]:
    return [strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


FULL = {
    "reward/mean": 0.25,
    "actor/clipfrac_seq": 0.0123,
    "actor/kl_k3_token": 0.000123,
    "response/length_mean": 41.25,
    "time/step_s": 1.5,
    "perf/tokens_per_s": 812.4,
}


# --- jsonl --------------------------------------------------------------------------------------------------


def test_jsonl_one_object_per_step_visible_before_close(tmp_path, monkeypatch):
    synced = []
    real_fsync = M.os.fsync
    monkeypatch.setattr(M.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    logger = M.MetricsLogger(tmp_path, ["jsonl"], total_steps=3)
    logger.log(1, {"reward/mean": 0.5, "n": 3})
    assert jsonl_lines(tmp_path) == [{"step": 1, "reward/mean": 0.5, "n": 3.0}]  # on disk, not in a buffer
    assert len(synced) == 1
    logger.log(2, {"reward/mean": 0.75})
    logger.close()
    assert [r["step"] for r in jsonl_lines(tmp_path)] == [1, 2] and len(synced) == 2


def test_jsonl_non_finite_values_are_null(tmp_path):
    import numpy as np
    import torch

    with M.MetricsLogger(tmp_path, ["jsonl"], total_steps=1) as logger:
        logger.log(
            1, {"a": float("nan"), "b": float("inf"), "c": -math.inf, "d": torch.tensor(2.5), "e": np.float32(1)}
        )
    assert jsonl_lines(tmp_path) == [{"step": 1, "a": None, "b": None, "c": None, "d": 2.5, "e": 1.0}]
    assert M.read_metrics(tmp_path) == jsonl_lines(tmp_path)


def test_jsonl_resume_truncates_after_start_step(tmp_path):
    with M.MetricsLogger(tmp_path, ["jsonl"], total_steps=10) as logger:
        for step in range(1, 7):  # checkpoint at step 3, killed after step 6
            logger.log(step, {"reward/mean": step / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "reward/me')  # torn line: SIGKILL during the write
    with M.MetricsLogger(tmp_path, ["jsonl"], total_steps=10, start_step=3) as logger:
        assert [r["step"] for r in jsonl_lines(tmp_path)] == [1, 2, 3]  # nothing at or before 3 lost
        for step in range(4, 8):
            logger.log(step, {"reward/mean": step})
    records = jsonl_lines(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["reward/mean"] for r in records] == [0.1, 0.2, 0.3, 4, 5, 6, 7]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_jsonl_fresh_run_and_bad_lines(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 1}\n')
    with M.MetricsLogger(tmp_path, ["jsonl"], total_steps=2):  # start_step=0: a fresh run starts a fresh file
        pass
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\ngarbage\n{"step": 2}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2 is not a metrics line"):
        M.read_metrics(tmp_path)
    with pytest.raises(UserError, match="no metrics file"):
        M.read_metrics(tmp_path / "nowhere")


def test_log_rejects_non_increasing_steps_and_bad_values(tmp_path):
    with M.MetricsLogger(tmp_path, ["jsonl"], total_steps=5, start_step=2) as logger:
        with pytest.raises(ValueError, match="step 2"):
            logger.log(2, {"a": 1})
        logger.log(3, {"a": 1})
        with pytest.raises(ValueError):
            logger.log(3, {"a": 2})
        with pytest.raises(TypeError, match="'a'"):
            logger.log(4, {"a": "high"})
    assert [r["step"] for r in jsonl_lines(tmp_path)] == [3]


def test_unknown_logger_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        M.MetricsLogger(tmp_path, ["jsonl", "mlflow"], total_steps=1)
    msg = str(e.value)
    assert "trainer.loggers" in msg and "mlflow" in msg and "console, jsonl, tensorboard, wandb" in msg
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before any sink was made
    with pytest.raises(ConfigError, match=r"must be a list, e.g. \[jsonl\]"):
        M.MetricsLogger(tmp_path, "jsonl", total_steps=1)


# --- console ------------------------------------------------------------------------------------------------


def test_console_non_tty_prints_one_plain_line_per_step(tmp_path):
    out = io.StringIO()  # isatty() is False, like a CI log or `> train.log`
    with M.MetricsLogger(tmp_path, ["console"], total_steps=20, start_step=2, console_stream=out) as logger:
        logger.log(3, FULL)
        logger.log(4, {"reward/mean": 0.5, "perf/tokens_per_s": 12345.6, "actor/kl_k3_token": float("nan")})
    lines = out.getvalue().splitlines()
    assert lines == [
        "step 3/20 reward=0.25 clip_seq=0.0123 kl=0.000123 resp_len=41.25 step_s=1.5 tok/s=812.4",
        "step 4/20 reward=0.5 clip_seq=- kl=- resp_len=- step_s=- tok/s=12346",
    ]
    assert "\x1b" not in out.getvalue()


def test_console_default_stream_is_stdout(tmp_path, capsys):
    with M.MetricsLogger(tmp_path, ["console"], total_steps=2) as logger:
        logger.log(1, {"reward/mean": 1})
    assert capsys.readouterr().out == "step 1/2 reward=1 clip_seq=- kl=- resp_len=- step_s=- tok/s=-\n"


def test_console_tty_draws_a_rich_progress_bar(tmp_path):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    with M.MetricsLogger(tmp_path, ["console"], total_steps=4, console_stream=out) as logger:
        logger.log(1, FULL)
        logger.log(2, {**FULL, "reward/mean": 0.75})
    text = out.getvalue()
    assert "\x1b[" in text and "━" in text  # a live, redrawn bar
    assert "2/4" in text and "reward=0.75" in text and "tok/s=812.4" in text


# --- tensorboard --------------------------------------------------------------------------------------------


def _scalars(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_scalars_read_back_and_resume_purges(tmp_path):
    with M.MetricsLogger(tmp_path, ["tensorboard"], total_steps=5, config_dict={"seed": 1}) as logger:
        for step in range(1, 6):
            logger.log(step, {"reward/mean": step / 4, "actor/kl_k3_token": float("nan") if step == 2 else 0.5})
    logdir = tmp_path / "tensorboard"
    assert _scalars(logdir, "reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0), (5, 1.25)]
    assert [s for s, _ in _scalars(logdir, "actor/kl_k3_token")] == [1, 3, 4, 5]  # null values are not drawn
    with M.MetricsLogger(tmp_path, ["tensorboard"], total_steps=5, start_step=3) as logger:
        logger.log(4, {"reward/mean": 4.0})
    # steps 4 and 5 of the killed run are purged; the resumed step 4 is shown once
    assert _scalars(logdir, "reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75), (4, 4.0)]
    with M.MetricsLogger(tmp_path, ["tensorboard"], total_steps=5) as logger:  # a fresh run in the same dir
        logger.log(1, {"reward/mean": -1.0})
    assert _scalars(logdir, "reward/mean") == [(1, -1.0)]


# --- wandb --------------------------------------------------------------------------------------------------


def _fake_wandb(calls):
    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    module = types.ModuleType("wandb")
    module.init = init
    module.util = types.SimpleNamespace(generate_id=lambda: "run123")
    return module


def test_wandb_sink_calls_and_stable_run_id(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    run_dir = tmp_path / "exp7"
    with M.MetricsLogger(run_dir, ["wandb"], total_steps=3, config_dict={"seed": 1}, project_name="p") as logger:
        logger.log(1, {"reward/mean": 0.5, "kl": float("nan")})
    init = calls[0][1]
    assert (init["project"], init["name"], init["id"], init["resume"]) == ("p", "exp7", "run123", "allow")
    assert init["config"] == {"seed": 1} and "mode" not in init  # WANDB_MODE is wandb's to read
    assert calls[1:] == [("log", 1, {"reward/mean": 0.5}), ("finish",)]
    calls.clear()
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    sys.modules["wandb"].util.generate_id = lambda: "other"
    with M.MetricsLogger(run_dir, ["wandb"], total_steps=3, start_step=1, experiment_name="named"):
        pass
    assert calls[0][1]["id"] == "run123" and calls[0][1]["name"] == "named"  # a resume continues the run


def test_wandb_offline_or_missing(tmp_path, monkeypatch):
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(UserError) as e:
            M.MetricsLogger(tmp_path, ["jsonl", "wandb"], total_steps=1)
        msg = str(e.value)
        assert "trainer.loggers" in msg and "pip install wandb" in msg and "\n" not in msg
        return
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with M.MetricsLogger(tmp_path, ["wandb"], total_steps=2) as logger:
        logger.log(1, {"reward/mean": 0.5})
    assert list((tmp_path / "wandb").glob("offline-run-*"))


# --- plot ---------------------------------------------------------------------------------------------------


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def has_colour(path, rgb, min_pixels=50) -> bool:
    from matplotlib.image import imread

    image = imread(str(path))[:, :, :3]
    close = (abs(image - [c / 255 for c in rgb]) < 0.02).all(axis=-1)
    return int(close.sum()) >= min_pixels


def _run(tmp_path, n=12, **extra):
    run_dir = tmp_path / "run"
    with M.MetricsLogger(run_dir, ["jsonl"], total_steps=n) as logger:
        for step in range(1, n + 1):
            logger.log(step, {"reward/mean": step / n, "response/length_mean": 30 + step, **extra})
    return run_dir


def test_plot_writes_png_curves(tmp_path, capsys):
    run_dir = _run(tmp_path, **{"reward/accuracy": 0.5, "actor/clipfrac_seq": 0.01, "actor/clipfrac_token": 0.02})
    written, notes = plot.plot_run(run_dir)
    names = ["reward.png", "clipfrac.png", "response_length.png"]
    assert written == [run_dir / "plots" / n for n in names] and notes == []
    for path in written:
        assert png_size(path) == (640, 400)
        assert has_colour(path, (0x1F, 0x77, 0xB4))  # matplotlib's first line colour: a curve was drawn
    assert has_colour(run_dir / "plots" / "reward.png", (0xFF, 0x7F, 0x0E))  # second line: reward/accuracy
    assert not has_colour(run_dir / "plots" / "response_length.png", (0xFF, 0x7F, 0x0E))  # only one key


def test_plot_skips_absent_figures_with_a_note(tmp_path, capsys):
    run_dir = _run(tmp_path, n=1)  # one step, no clip fractions
    out = tmp_path / "elsewhere"
    args = _parse([str(run_dir), "--output", str(out)])
    assert plot.main_plot(args) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["response_length.png", "reward.png"]
    assert "clipfrac.png skipped: none of actor/clipfrac_seq, actor/clipfrac_token" in printed
    assert has_colour(out / "reward.png", (0x1F, 0x77, 0xB4), min_pixels=5)  # a single point still shows


def _parse(argv):
    import argparse

    parser = argparse.ArgumentParser()
    plot.add_plot_args(parser)
    return parser.parse_args(argv)


def test_plot_missing_inputs_are_one_line_errors_exit_2(tmp_path, capsys):
    missing_dir = tmp_path / "no-such-run"
    with pytest.raises(UserError, match="does not exist"):
        plot.main_plot(_parse([str(missing_dir)]))
    from gspo_ascend.cli import main as cli_main

    for main in (plot.main, lambda argv: cli_main(["plot", *argv])):  # `gspo-ascend plot` and `-m gspo_ascend.plot`
        assert main([str(missing_dir)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(missing_dir) in err and err.count("\n") == 1
    empty_run = tmp_path / "empty"
    empty_run.mkdir()
    assert plot.main([str(empty_run)]) == 2
    err = capsys.readouterr().err
    assert str(empty_run / "metrics.jsonl") in err and "trainer.loggers" in err and err.count("\n") == 1
    (empty_run / "metrics.jsonl").write_text("")
    assert plot.main([str(empty_run)]) == 2
    assert "no steps yet" in capsys.readouterr().err


def test_plot_reports_a_missing_matplotlib_in_one_line(tmp_path, monkeypatch):
    run_dir = _run(tmp_path, n=2)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # what an install without matplotlib raises
    with pytest.raises(UserError, match=r"pip install matplotlib==") as e:
        plot.plot_run(run_dir)
    assert "\n" not in str(e.value)


# --- validation: step 0, the console's val figure, its plot ----------------------------------------------------


def test_fresh_run_logs_step_0_which_a_resume_keeps_and_a_fresh_run_drops(tmp_path):
    out = io.StringIO()
    with M.MetricsLogger(tmp_path, ["jsonl", "console"], total_steps=4, console_stream=out) as logger:
        logger.log(0, {"val/all/mean@1": 0.25})  # trainer.val_before_train: the initial weights
        logger.log(1, {"reward/mean": 0.5})
        logger.log(2, {"reward/mean": 0.5, "val/all/mean@1": 0.5})
        logger.log(3, {"reward/mean": 0.75})
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 0/4 reward=- clip_seq=- kl=- resp_len=- step_s=- tok/s=- val=0.25"
    assert lines[1].endswith("tok/s=- val=0.25") and lines[2].endswith(" val=0.5") and lines[3].endswith(" val=0.5")
    with M.MetricsLogger(tmp_path, ["jsonl"], total_steps=4, start_step=2) as logger:  # resumed from step_2
        with pytest.raises(ValueError, match="step 0"):
            logger.log(0, {"val/all/mean@1": 0.25})
    assert [r["step"] for r in jsonl_lines(tmp_path)] == [0, 1, 2]
    with M.MetricsLogger(tmp_path, ["jsonl"], total_steps=4):  # a fresh run in the same directory
        pass
    assert jsonl_lines(tmp_path) == []


def test_console_without_validation_has_no_val_figure(tmp_path):
    out = io.StringIO()
    with M.MetricsLogger(tmp_path, ["console"], total_steps=1, console_stream=out) as logger:
        logger.log(1, {"reward/mean": 0.5})
    assert "val=" not in out.getvalue()


def test_tensorboard_fresh_run_purges_an_earlier_step_0(tmp_path):
    with M.MetricsLogger(tmp_path, ["tensorboard"], total_steps=2) as logger:
        logger.log(0, {"val/all/mean@1": 0.25})
        logger.log(1, {"val/all/mean@1": 0.5})
    assert _scalars(tmp_path / "tensorboard", "val/all/mean@1") == [(0, 0.25), (1, 0.5)]
    with M.MetricsLogger(tmp_path, ["tensorboard"], total_steps=2) as logger:
        logger.log(0, {"val/all/mean@1": 0.75})
    assert _scalars(tmp_path / "tensorboard", "val/all/mean@1") == [(0, 0.75)]


def test_plot_draws_validation_curves(tmp_path):
    run_dir = tmp_path / "run"
    with M.MetricsLogger(run_dir, ["jsonl"], total_steps=4) as logger:
        logger.log(0, {"val/all/mean@4": 0.2, "val/all/pass@4": 0.5, "val/a/mean@4": 0.1, "val/b/mean@4": 0.3})
        for step in range(1, 5):
            val = {"val/all/mean@4": 0.4, "val/all/pass@4": 0.7, "val/a/mean@4": 0.3, "val/b/mean@4": 0.5}
            logger.log(step, {"reward/mean": step / 4, "response/length_mean": 30, **(val if step == 4 else {})})
    written, _ = plot.plot_run(run_dir)
    assert [p.name for p in written][-2:] == ["validation.png", "validation_by_source.png"]
    assert has_colour(run_dir / "plots" / "validation.png", (0xFF, 0x7F, 0x0E))  # two overall curves
    assert has_colour(run_dir / "plots" / "validation_by_source.png", (0xFF, 0x7F, 0x0E))  # two sources
