"""SIGTERM handling (gspo_ascend/preempt.py): the first one is recorded and said once, a second one stops at
once, and the handler found before is put back. The trainer's use of it, with a real Ray run and exit code 143:
tests/e2e/test_faults_e2e.py."""

from __future__ import annotations

import os
import signal

import pytest

from gspo_ascend.preempt import GracefulStop


def test_first_sigterm_is_recorded_second_stops_and_restore_puts_the_old_handler_back(capfd):
    before = signal.getsignal(signal.SIGTERM)
    stop = GracefulStop()
    stop.install()
    stop.install()  # again after Ray's start-up: the handler to restore stays the first one found
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signum == signal.SIGTERM
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("SIGTERM received: the current step finishes")
        with pytest.raises(SystemExit) as e:
            os.kill(os.getpid(), signal.SIGTERM)
        assert e.value.code == 143
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before
