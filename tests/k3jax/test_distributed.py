"""k3jax.distributed: a single process never initialises (nothing to join, and waiting for a coordinator
would hang), explicit variables are passed through, and only process 0's log records get out."""

from __future__ import annotations

import logging

import jax
import pytest

from k3jax import distributed


@pytest.fixture
def calls(monkeypatch):
    """Record jax.distributed.initialize calls instead of making them."""
    seen: list[dict] = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    return seen


def test_initialize_is_a_noop_without_env(calls):
    assert distributed.initialize({}) is False
    assert distributed.initialize({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is False  # one-task SLURM job
    assert distributed.initialize({"K3JAX_NUM_PROCESSES": "1"}) is False
    assert calls == []


def test_initialize_on_the_real_environment_is_a_noop():
    # this test process is a plain single process: nothing may be joined (and nothing may block)
    assert distributed.initialize() is False
    assert jax.process_count() == 1


def test_explicit_variables_are_passed_through(calls):
    env = {"K3JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "K3JAX_NUM_PROCESSES": "4", "K3JAX_PROCESS_ID": "2",
           "K3JAX_LOCAL_DEVICE_IDS": "0,1"}
    assert distributed.initialize(env) is True
    assert calls == [dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2, local_device_ids=[0, 1])]


def test_detected_launchers_use_jax_autodetection(calls):
    assert distributed.initialize({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}) is True
    assert distributed.initialize({"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}) is True
    assert calls == [{}, {}]


def _records(monkeypatch, index: int) -> list[str]:
    monkeypatch.setattr(jax, "process_index", lambda: index)
    logger = logging.getLogger(f"k3jax-test-{index}")
    logger.propagate = False
    distributed.log_from_process_zero(logging.INFO, logger)
    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())

    keep = Keep()
    for f in logger.handlers[0].filters:
        keep.addFilter(f)
    logger.addHandler(keep)
    logger.info("hello")
    logger.error("host failure", extra={"all_processes": True})
    return kept


def test_process_zero_filter_keeps_process_zero(monkeypatch):
    assert _records(monkeypatch, 0) == ["hello", "host failure"]


def test_process_zero_filter_drops_other_processes(monkeypatch):
    assert _records(monkeypatch, 3) == ["host failure"]
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "msg", None, None)
    assert distributed.ProcessZeroFilter().filter(record) is False


def test_opt_out_wins(calls):
    assert distributed.initialize({"K3JAX_DISTRIBUTED": "0", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}) is False
    assert calls == []
