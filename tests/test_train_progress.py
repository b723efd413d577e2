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
