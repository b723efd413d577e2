"""Members no field map kind names are counted by suffix, never dropped silently: in the reader's
stats, `inspect`, SHARD_DONE, the dispatcher's metrics, its log and its step log.

The shard mirrors webdataset's own test shard `sample.tgz`: 90 samples of a `.png` and a `.cls`.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from collections import Counter

import pytest
from PIL import Image

from dispatcher_server import protocol as P
from mmdispatch.cli import main
from pipeline.errors import ErrorStats
from pipeline.reader import ReaderConfig, iter_shard
from pipeline.service import ignored_field
from tests.test_service import consume, dispatcher, make_config, readers

NUM = 90


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40 + seed % 7, 30), (seed % 256, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def cls_shard(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("cls") / "sample.tgz")
    with tarfile.open(path, "w:gz", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(NUM):
            for suffix, data in (("png", _png(i)), ("cls", str(i % 10).encode())):
                info = tarfile.TarInfo(f"samples/{i:06d}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_reader_stats_count_ignored_members_by_suffix(cls_shard):
    stats = ErrorStats()
    recs = list(iter_shard(cls_shard, ReaderConfig(), stats=stats))
    assert len(recs) == NUM and all(r.items[0].member == "png" for r in recs)
    assert stats.ignored_members == {"cls": NUM}
    assert stats.as_dict()["ignored_members"] == {"cls": NUM}
    assert stats.as_dict()["num_ignored_members"] == NUM


def test_a_resumed_shard_is_counted_whole_and_per_shard_counts_are_separate(cls_shard):
    stats, mine = ErrorStats(), Counter()
    recs = list(iter_shard(cls_shard, ReaderConfig(), start_index=60, stats=stats, ignored=mine))
    assert len(recs) == NUM - 60
    assert mine == {"cls": NUM} and stats.ignored_members == {"cls": NUM}
    list(iter_shard(cls_shard, ReaderConfig(), stats=stats))
    assert mine == {"cls": NUM} and stats.ignored_members == {"cls": 2 * NUM}


def test_inspect_lists_ignored_members_by_suffix(cls_shard, capsys):
    assert main(["inspect", "--json", cls_shard]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"]["ignored_members"] == {"cls": NUM}
    assert main(["inspect", cls_shard]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"ignored members: cls {NUM}" in out


def test_inspect_takes_a_field_map(cls_shard, capsys):
    assert main(["inspect", "--json", "--map", "text=cls", "--map", "image=", cls_shard]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"]["ignored_members"] == {"png": NUM}
    assert report["modalities"]["image"]["count"] == 0 and report["modalities"]["text"]["count"] == NUM
    for bad, words in ((["--map", "picture=cls"], "unknown kind 'picture'"),
                       (["--map", "textcls"], "expected KIND=EXT"),
                       (["--map", "text=png", "--map", "image=png"], "'png' is mapped to both")):
        assert main(["inspect", *bad, cls_shard]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err


def test_shard_done_carries_ignored_counts_checked():
    frames = P.encode(P.SHARD_DONE, assign_id=1, count=3, skipped=[], ignored={"cls": 90, "": 2})
    assert P.decode(frames).get("ignored") == {"cls": 90, "": 2}
    assert P.decode(P.encode(P.SHARD_DONE, assign_id=1, count=3, skipped=[])).get("ignored") is None
    for bad in ({"cls": 0}, {"cls": -1}, {"cls": "9"}, {3: 1}, {"x" * 65: 1},
                {f"s{i}": 1 for i in range(P.MAX_IGNORED_SUFFIXES + 1)}, ["cls"]):
        with pytest.raises(P.ProtocolError):
            P.decode(P.encode(P.SHARD_DONE, assign_id=1, count=3, skipped=[], ignored=bad))


def test_readers_fold_rare_suffixes_beyond_the_protocol_limit():
    many = Counter({f"s{i:03d}": 1000 - i for i in range(100)})
    many["y" * 80] = 5000  # too long a label to send by name
    got = ignored_field(many)["ignored"]
    assert len(got) == P.MAX_IGNORED_SUFFIXES
    assert sum(got.values()) == sum(many.values())
    assert got["s000"] == 1000 and "y" * 80 not in got
    assert got[P.IGNORED_OTHER] == 5000 + sum(1000 - i for i in range(P.MAX_IGNORED_SUFFIXES - 1, 100))
    assert ignored_field(Counter()) == {}
    P.decode(P.encode(P.SHARD_DONE, assign_id=1, count=0, skipped=[], ignored=got))  # accepted


@pytest.mark.timeout(60)
def test_dispatcher_counts_ignored_members_in_metrics_logs_and_step_log(cls_shard, tmp_path, caplog):
    steps = tmp_path / "steps.jsonl"
    caplog.set_level(logging.INFO, logger="mmdispatch.server")
    with dispatcher(make_config([cls_shard], world_size=2, global_batch=8,
                                step_log=str(steps))) as srv, readers(srv.reader_endpoint, 1):
        got = consume(srv.trainer_endpoint, 2)
        value = srv.metrics.registry.get_sample_value("mmdispatch_members_ignored_total",
                                                      {"source": "default", "suffix": "cls"})
    assert sum(len(keys) for steps_ in got.values() for _, mbs in steps_ for keys in mbs) == NUM
    assert value == NUM
    lines = [r.getMessage() for r in caplog.records if "event=members_ignored" in r.getMessage()]
    assert len(lines) == 1 and f"suffixes=cls={NUM}" in lines[0] and "sample.tgz" in lines[0]
    assert "source=default" in lines[0]
    records = [json.loads(line) for line in steps.read_text().splitlines()]
    assert records[-1]["ignored_members"] == {"default": {"cls": NUM}}


@pytest.mark.timeout(60)
def test_a_source_field_map_reaches_the_readers(cls_shard):
    from dispatcher_server.config import Source

    # This source's map names cls as text and no image kind: now png members are the ignored ones.
    source = Source(name="labels", shards=[cls_shard], fields={"image": [], "text": ["cls"]})
    with dispatcher(make_config([], sources=[source], world_size=1, global_batch=8)) as srv, \
            readers(srv.reader_endpoint, 1):
        got = consume(srv.trainer_endpoint, 1)
        png = srv.metrics.registry.get_sample_value("mmdispatch_members_ignored_total",
                                                    {"source": "labels", "suffix": "png"})
        cls = srv.metrics.registry.get_sample_value("mmdispatch_members_ignored_total",
                                                    {"source": "labels", "suffix": "cls"})
    assert sum(len(keys) for _, mbs in got[0] for keys in mbs) == NUM
    assert png == NUM and cls is None


@pytest.mark.timeout(60)
def test_an_empty_epoch_names_the_ignored_suffixes(tmp_path):
    import time

    path = str(tmp_path / "unusable.tar")
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(20):
            for suffix, data in (("cls", b"1"), ("npy", b"\x93NUMPY")):
                info = tarfile.TarInfo(f"{i:04d}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with dispatcher(make_config([path], world_size=1, global_batch=4, max_epochs=None)) as srv, \
            readers(srv.reader_endpoint, 1):
        deadline = time.monotonic() + 30
        while srv.fatal is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert srv.fatal is not None, "an epoch of unusable samples did not end the job"
    message = str(srv.fatal)
    import re

    # Counts over the epochs read so far: every sample skipped holds one cls and one npy.
    assert re.search(r"yielded no usable sample \(skipped: (\d+) empty_sample; members no field "
                     r"map names: cls \1, npy \1\)", message), message
    assert "\n" not in message


@pytest.mark.timeout(90)
def test_a_blend_whose_source_yields_nothing_tells_the_trainers_why(tmp_path, cls_shard):
    """One source of a blend with no usable sample, at --max-epochs 1: the blend's end planned a
    last partial step, then the empty epoch stopped the job, and every later pump stopped again
    before sending anything, so the trainer waiting on that step was told nothing and timed out.
    It now gets the steps planned before the stop, then END naming the source."""
    from dispatcher_server.config import Source
    from trainer_client.client import ClientConfig, DispatcherClient, DispatcherError

    path = str(tmp_path / "unusable.tar")
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(20):
            info = tarfile.TarInfo(f"{i:04d}.npy")
            info.size = 6
            tar.addfile(info, io.BytesIO(b"\x93NUMPY"))
    sources = [Source(name="good", shards=[cls_shard], fields={"image": ["png"], "text": ["cls"]}),
               Source(name="bad", shards=[path])]
    steps = []
    with dispatcher(make_config([], sources=sources, world_size=1, global_batch=10,
                                max_epochs=1)) as srv, readers(srv.reader_endpoint, 1):
        client = DispatcherClient(srv.trainer_endpoint, 0, 1, 1,
                                  config=ClientConfig(heartbeat_s=0.2, timeout_s=5.0,
                                                      step_timeout_s=30.0))
        try:
            with pytest.raises(DispatcherError, match="halted.*source 'bad'.*no usable sample"):
                for step in client.start():
                    steps.append(step.step)
        finally:
            client.close()
    assert steps == list(range(srv.next_plan))


def test_ignored_suffixes_are_few_in_metrics_and_step_log_across_a_whole_job():
    """Probe: a sidecar suffix per sample (`KEY.rev<shard>_<i>`) made one metric series per
    sample, and every step-log record repeated them all: each shard's counts were capped, the
    job's were not. Past the first names a source's further ones count as IGNORED_OTHER."""
    from dispatcher_server.server import Dispatcher
    from tests.test_dispatcher_faults import _config

    d = Dispatcher(_config())
    try:
        total = 0
        for shard in range(10):
            counts = {f"rev{shard}_{i}": 1 for i in range(20)}
            d._ignored("default", f"s{shard}.tar", counts)
            total += sum(counts.values())
        d._ignored("default", "s10.tar", {"rev0_0": 5})  # a name held keeps its own count
        total += 5
        held = d.ignored_members["default"]
        assert len(held) == P.MAX_IGNORED_SUFFIXES and sum(held.values()) == total
        assert held["rev0_0"] == 6 and held[P.IGNORED_OTHER] == total - 6 - (P.MAX_IGNORED_SUFFIXES - 2)
        series = [s for m in d.metrics.registry.collect() if m.name == "mmdispatch_members_ignored"
                  for s in m.samples if s.name.endswith("_total")]
        assert len(series) == P.MAX_IGNORED_SUFFIXES and sum(s.value for s in series) == total
    finally:
        d.stop()
