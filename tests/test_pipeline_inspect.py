"""`mmdispatch inspect` end to end: JSON report consistent with the reader, human report."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from mmdispatch.cli import main
from pipeline.inspect import log_histogram
from pipeline.reader import iter_samples


def test_inspect_json_matches_reader(small_shards, capsys):
    assert main(["inspect", "--json", *small_shards]) == 0
    report = json.loads(capsys.readouterr().out)
    recs = list(iter_samples(small_shards))
    assert report["num_samples"] == len(recs) and report["num_shards"] == len(small_shards)
    images = [it for r in recs for it in r.items if it.modality == "image"]
    assert report["modalities"]["image"]["count"] == len(images)
    assert report["modalities"]["image"]["llm_len"]["max"] == max(it.llm_len for it in images)
    assert report["samples"]["llm_len"]["p50"] == float(np.percentile([r.llm_len for r in recs], 50))
    assert abs(sum(report["mix"].values()) - 1) < 1e-3
    assert sum(report["mix_counts"].values()) == len(recs)
    assert sum(b["count"] for b in report["histogram"]) == len(recs)
    per = report["images_per_sample"]
    assert sum(per.values()) == len(recs)
    assert sum(int(k) * v for k, v in per.items()) == len(images)
    assert report["errors"]["num_errors"] == 0


def test_inspect_options_change_counts(small_shards, capsys):
    main(["inspect", "--json", *small_shards])
    default = json.loads(capsys.readouterr().out)
    main(["inspect", "--json", "--max-pixels", str(28 * 28 * 16), *small_shards])
    small = json.loads(capsys.readouterr().out)
    assert small["modalities"]["image"]["llm_len"]["max"] <= 16
    assert small["modalities"]["image"]["llm_len"]["max"] < default["modalities"]["image"]["llm_len"]["max"]


def test_inspect_human_report_and_errors(small_shards, tmp_path, capsys):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"\x01" * 2048)
    code = main(["inspect", "--errors", "skip", small_shards[0], str(bad)])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0  # something was readable: the report lists the bad shard instead
    assert "histogram" in out and "modality mix" in out and "bad_tar=1" in out
    assert "shards with errors" in out and "bad.tar" in out


def _tar_of_bad_images(path, count: int) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for i in range(count):
            data = b"not a jpeg at all" * 4
            info = tarfile.TarInfo(f"s{i:04d}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_inspect_counts_errors_per_shard_and_reads_the_good_one(small_shards, tmp_path, capsys, caplog):
    import logging

    for name in ("a-bad.tar", "b-bad.tar"):
        _tar_of_bad_images(tmp_path / name, 30)
    good = tmp_path / "c-good.tar"
    good.write_bytes(open(small_shards[0], "rb").read())
    with caplog.at_level(logging.WARNING, logger="mmdispatch.pipeline"):
        code = main(["inspect", "--json", "--max-consecutive-errors", "20", str(tmp_path / "*.tar")])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["num_samples"] == len(list(iter_samples([small_shards[0]])))
    bad = {b["shard"].rsplit("/", 1)[-1]: b for b in report["bad_shards"]}
    assert set(bad) == {"a-bad.tar", "b-bad.tar"}
    # each bad shard stopped on its own run of failures; the second did not inherit the first's
    assert all(b["stopped"] and b["errors"] == 21 and b["by_reason"] == {"bad_image": 21} for b in bad.values())
    # the first error names its sample, as the logs do
    assert all(b["first_error"].startswith("bad_image (sample '") for b in bad.values())
    # one full line per (reason, shard), the rest in one aggregated line, never one line each
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) <= 3, lines
    assert any("event=samples_skipped count=40 " in line and "bad_image=40" in line for line in lines), lines


def test_inspect_fails_only_when_nothing_is_readable(tmp_path, capsys):
    _tar_of_bad_images(tmp_path / "bad.tar", 5)
    code = main(["inspect", str(tmp_path / "bad.tar")])
    captured = capsys.readouterr()
    assert code == 1 and "no readable sample" in captured.err
    assert "shards with errors" in " ".join(captured.out.split())


def test_inspect_prints_shard_names_and_messages_as_written(tmp_path, capsys, monkeypatch):
    """Square brackets in a shard's path and in an error's fix were taken as console markup:
    `[red]/x.tar` printed as `/x.tar` in red, and "the dataset file's [sources.fields]" lost
    its key (probe)."""
    import tarfile

    monkeypatch.setenv("COLUMNS", "400")
    (tmp_path / "[red]").mkdir()
    shard = tmp_path / "[red]" / "x.tar"
    with tarfile.open(shard, "w") as tar:
        tar.add(__file__, arcname="mk1.py")
    assert main(["inspect", str(shard)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"{shard} " in out and "the dataset file's [sources.fields]" in out, out


def test_log_histogram_buckets():
    hist = log_histogram(np.array([1, 3, 3, 8, 1000]))
    assert hist[0] == {"lo": 1, "hi": 2, "count": 1}
    assert {"lo": 2, "hi": 4, "count": 2} in hist and {"lo": 8, "hi": 16, "count": 1} in hist
    assert sum(b["count"] for b in hist) == 5 and hist[-1]["lo"] == 512


@pytest.mark.timeout(60)
def test_inspect_gives_up_a_hung_shard_and_goes_on(small_shards, tmp_path, capsys, caplog):
    """A shard command that stops sending bytes is listed as bad (shard_stalled) after
    --stall-timeout with what it sent before counted, its command is killed, and the next shard
    is read: inspect does not wait for Ctrl-C."""
    size = os.path.getsize(small_shards[0])
    pidfile = tmp_path / "pid"
    hung = f"pipe:echo $$ > {pidfile}; head -c {size // 2} {small_shards[0]}; sleep 600"
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="mmdispatch"):
        assert main(["inspect", "--json", "--stall-timeout", "1", hung, small_shards[1]]) == 0
    # the killed command's cut-off stream is not reported as well (a truncated tar, or a
    # thread logging after inspect went on)
    assert "truncated_tar" not in caplog.text and "shard_failed" not in caplog.text
    assert time.monotonic() - t0 < 30
    report = json.loads(capsys.readouterr().out)
    whole = len(list(iter_samples([small_shards[1]])))
    partial = report["num_samples"] - whole
    assert 0 < partial < len(list(iter_samples([small_shards[0]])))
    [bad] = report["bad_shards"]
    assert bad["shard"] == hung and bad["by_reason"] == {"shard_stalled": 1}
    assert "--stall-timeout" in bad["first_error"]
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}") and \
            open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z":
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or \
        open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z", "the hung command was left running"


def test_inspect_refuses_a_stall_timeout_that_is_not_positive(small_shards, capsys):
    assert main(["inspect", "--stall-timeout", "0", *small_shards]) != 0
    err = capsys.readouterr().err
    assert "--stall-timeout" in err and "Traceback" not in err
