"""`mmdispatch inspect` end to end: JSON report consistent with the reader, human report."""

from __future__ import annotations

import json

import numpy as np

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
    out = capsys.readouterr().out
    assert code == 1  # errors never pass silently, not even in the exit status
    assert "histogram" in out and "modality mix" in out and "bad_tar=1" in out


def test_log_histogram_buckets():
    hist = log_histogram(np.array([1, 3, 3, 8, 1000]))
    assert hist[0] == {"lo": 1, "hi": 2, "count": 1}
    assert {"lo": 2, "hi": 4, "count": 2} in hist and {"lo": 8, "hi": 16, "count": 1} in hist
    assert sum(b["count"] for b in hist) == 5 and hist[-1]["lo"] == 512
