"""Rank 0 of the reference trainer reports steps/s, samples/s and the time spent waiting for data."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("torch")

from trainer_client.train import Progress  # noqa: E402


def test_progress_lines_report_rates_and_data_wait(caplog):
    progress = Progress(1e-9, enabled=True)
    with caplog.at_level(logging.INFO, logger="mmdispatch.train"):
        progress.update(32, wait_s=0.0)
        progress.update(32, wait_s=0.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "event=train_progress" in lines[-1]
    assert "step 2" in lines[-1] and "steps/s" in lines[-1] and "samples/s" in lines[-1]
    assert "data wait" in lines[-1]
    assert (progress.steps, progress.samples) == (2, 64)
    with caplog.at_level(logging.INFO, logger="mmdispatch.train"):
        progress.update(32, wait_s=0.0, step=41)  # a resumed run: the dispatcher's step number
    assert "step 41 (3 this run)" in caplog.records[-1].getMessage()


def test_only_rank_zero_reports(caplog):
    progress = Progress(1e-9, enabled=False)
    with caplog.at_level(logging.INFO, logger="mmdispatch.train"):
        progress.update(32, wait_s=0.5)
    assert caplog.records == [] and progress.steps == 0
