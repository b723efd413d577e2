"""Rank 0 of the reference trainer reports steps/s, samples/s and the time spent waiting for data."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("torch")

from dispatcher_server.cliopts import JsonFormatter  # noqa: E402
from trainer_client.train import Progress  # noqa: E402


def test_progress_lines_report_rates_and_data_wait(caplog):
    progress = Progress(1e-9, enabled=True)
    with caplog.at_level(logging.INFO, logger="mmdispatch.train"):
        progress.update(32, wait_s=0.0)
        progress.update(32, wait_s=0.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "event=train_progress" in lines[-1]
    # fields (a JSON log makes them keys; they were words of a message)
    fields = json.loads(JsonFormatter().format(caplog.records[-1]))
    assert fields["step"] == 2 and fields["steps_this_run"] == 2
    assert fields["steps_per_s"] > 0 and fields["samples_per_s"] > 0 and fields["data_wait_pct"] == 0
    assert (progress.steps, progress.samples) == (2, 64)
    with caplog.at_level(logging.INFO, logger="mmdispatch.train"):
        progress.update(32, wait_s=0.0, step=41)  # a resumed run: the dispatcher's step number
    assert "step=41 steps_this_run=3" in caplog.records[-1].getMessage()


def test_only_rank_zero_reports(caplog):
    progress = Progress(1e-9, enabled=False)
    with caplog.at_level(logging.INFO, logger="mmdispatch.train"):
        progress.update(32, wait_s=0.5)
    assert caplog.records == [] and progress.steps == 0


def _peer_leaves(ctx):
    """Rank 1 leaves after a barrier; rank 0's next collective breaks on it."""
    import time

    import torch
    import torch.distributed as dist

    from trainer_client.train import collective_failed

    dist.barrier()
    if ctx.rank == 1:
        return None
    time.sleep(2)
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as e:
        return collective_failed(e)
    return "no error"


@pytest.mark.timeout(120)
def test_a_collective_broken_by_a_rank_that_left_is_said_in_one_line(capsys):
    """Probe: the dispatcher stopped mid-run; rank 0 said "no dispatcher answered" in one line
    and left, and rank 1, waiting in the exchange's collective, died with gloo's 36-line
    traceback ("a remote worker crashing"), which reads as a crash in the exchange."""
    from dispatcher_server.cliopts import run_reporting_errors
    from trainer_client.dist import run_local_group
    from trainer_client.train import PeerRankStopped, collective_failed

    assert run_local_group(_peer_leaves, world_size=2, local_world_size=2, timeout_s=60)[0] is True
    assert not collective_failed(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))

    def stopped():
        raise PeerRankStopped("rank 1: a collective with the other ranks failed after 3 step(s): "
                              "a peer rank stopped; its own log says why")

    assert run_reporting_errors(stopped, "python -m trainer_client.train") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m trainer_client.train: error: rank 1: a collective") and "\n" not in err
