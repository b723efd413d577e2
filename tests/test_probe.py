"""Zero-usable refusal: `probe_source` reads a bounded prefix, and `mmdispatch serve` refuses a
dataset in which no probed sample has a member the field map uses, with one line."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import time

import pytest

from pipeline.fieldmap import FieldMap
from pipeline.probe import probe_source, refusal
from pipeline.reader import ReaderConfig
from tests.servicekit import kill, serve


def write_tar(path, samples: int, suffixes: dict[str, bytes], *, start: int = 0) -> str:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(start, start + samples):
            for suffix, data in suffixes.items():
                info = tarfile.TarInfo(f"{i:06d}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.fixture()
def unusable(tmp_path) -> list[str]:
    """Two shards whose samples hold only .cls and .npy members."""
    return [write_tar(tmp_path / f"u{s}.tar", 20, {"cls": b"3", "npy": b"\x93NUMPY" + bytes(10)},
                      start=20 * s) for s in range(2)]


def test_probe_reads_a_bounded_prefix_and_reports_suffixes(unusable):
    result = probe_source(unusable, ReaderConfig(), max_samples=30)
    assert result.samples == 30 and result.usable == 0 and result.refused
    assert result.shards == unusable  # 20 in the first, 10 in the second
    assert result.suffixes == {"cls": 30, "npy": 30} and result.ignored == result.suffixes
    line = refusal(result)
    assert line is not None and "\n" not in line
    assert line.startswith(f"source 'default' (shards {unusable[0]}, {unusable[1]}): no sample has a usable member")
    assert "found suffixes cls, npy" in line and "field map in a dataset file" in line
    assert ("(e.g. image: [cls] if the cls members are images; try it with "
            "`mmdispatch inspect --map image=cls`)") in line


def test_probe_stops_at_the_first_usable_sample(tmp_path, unusable):
    usable = write_tar(tmp_path / "ok.tar", 5, {"txt": b"some words", "cls": b"1"})
    result = probe_source([unusable[0], usable, unusable[1]], ReaderConfig(), max_samples=64)
    assert result.usable == 1 and result.samples == 21 and not result.refused
    assert result.shards == [unusable[0], usable] and refusal(result) is None


def test_a_field_map_makes_the_same_shards_usable(unusable):
    fm = FieldMap.from_dict({"text": ["txt", "cls"]})
    result = probe_source(unusable, ReaderConfig(fields=fm))
    assert result.usable == 1 and result.ignored == {"npy": 1}


def test_unreadable_shards_are_not_refused(tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"\x01" * 2048)
    result = probe_source([str(tmp_path / "missing.tar"), str(bad)], ReaderConfig())
    assert result.samples == 0 and not result.refused and refusal(result) is None
    assert [u for u, _ in result.unreadable] == [str(tmp_path / "missing.tar"), str(bad)]


def test_refusal_suggests_a_kind_from_the_mime_type(tmp_path):
    shard = write_tar(tmp_path / "ppm.tar", 3, {"ppm": b"P6 1 1 255\n\0\0\0", "cls": b"1"})
    line = refusal(probe_source([shard], ReaderConfig()))
    assert "found suffixes cls, ppm" in line and "e.g. image: [ppm]" in line


@pytest.mark.timeout(90)
def _by_suffix(path, keys: int, suffixes: dict[str, bytes]) -> str:
    """A shard written `tar cf x.tar *.jpg *.txt`: every key's first suffix, then the next."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for suffix, data in suffixes.items():
            for i in range(keys):
                info = tarfile.TarInfo(f"s{i}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_a_shard_whose_samples_members_lie_apart_is_refused_naming_them(tmp_path):
    """Probe: a shard written grouped by extension (`tar cf x.tar *.jpg *.txt`, or a directory
    tarred in its listing order) was served: every sample trained as its image alone, its
    caption skipped as duplicate_key. Past the first usable sample the probe walks the rest of
    the first shard's member names (its data left unread) and refuses such a source."""
    apart = _by_suffix(tmp_path / "byext.tar", 300, {"jpg": b"x", "txt": b"a caption"})
    result = probe_source([apart], ReaderConfig())
    assert result.apart == (apart, "s0", "s0.jpg", "s0.txt")
    line = refusal(result, "captions")
    assert line is not None and f"shard {apart!r} is not grouped by sample key" in line
    assert "'s0.jpg', then 's0.txt'" in line and "tar --sort=name" in line
    grouped = write_tar(tmp_path / "grouped.tar", 300, {"jpg": b"x", "txt": b"a caption"})
    result = probe_source([grouped], ReaderConfig())
    assert result.apart is None and refusal(result) is None
    result = probe_source([apart], ReaderConfig(map_shards=False))  # its data would be read
    assert result.apart is None and result.usable == 1


def _in_folders(path, members: dict[str, bytes], keys: int) -> str:
    """A shard of `keys` names per folder whose members are FOLDER/NAME.SUFFIX for each entry
    'FOLDER/.SUFFIX' of `members`, in name order (`tar --sort=name`)."""
    names = sorted(f"{where.split('/.')[0]}/{i:03d}.{where.split('/.')[1]}"
                   for where in members for i in range(keys))
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name in names:
            data = members[name[:name.index("/")] + "/." + name.rsplit(".", 1)[1]]
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_a_shard_keeping_each_kind_in_its_own_directory_is_refused(tmp_path):
    """Probe: a tar of `images/` and `captions/` folders (the usual non-WebDataset layout) was
    served without a word: keys include their directory, so every image trained alone on no
    token and every caption without its image. Folders of whole samples are served."""
    split = _in_folders(tmp_path / "split.tar", {"images/.jpg": b"x", "captions/.txt": b"a"}, 50)
    line = refusal(probe_source([split], ReaderConfig()), "captions")
    assert line is not None and f"shard {split!r} keeps each sample's members in a directory per kind" in line
    assert "'captions/000' holds txt, 'images/000' holds jpg" in line
    assert "side by side under one key (000.txt, 000.jpg)" in line
    # class folders of whole samples, the same names in each: samples, not pieces
    classes = _in_folders(tmp_path / "classes.tar", {"cat/.jpg": b"x", "cat/.txt": b"a",
                                                     "dog/.jpg": b"x", "dog/.txt": b"a"}, 50)
    result = probe_source([classes], ReaderConfig())
    assert result.split is None and refusal(result) is None


def test_serve_refuses_a_dataset_without_usable_members(unusable):
    proc = subprocess.run(
        [sys.executable, "-m", "mmdispatch.cli", "serve", "--shards", *unusable, "--world-size", "1",
         "--global-batch", "4"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "READY" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mmdispatch serve: error: source 'default' (shards ")
    assert unusable[0] in lines[0] and "found suffixes cls, npy" in lines[0]
    assert "field map in a dataset file" in lines[0]


@pytest.mark.timeout(90)
def test_serve_starts_on_usable_shards_and_without_the_probe(tmp_path, unusable):
    usable = write_tar(tmp_path / "ok.tar", 4, {"txt": b"some words", "cls": b"1"})
    for shards, extra in (([usable, *unusable], []), (unusable, ["--probe-samples", "0"])):
        proc, ready = serve(shards, world_size=1, extra=extra)
        try:
            assert ready["readers"].startswith("tcp://")
        finally:
            kill(proc)


@pytest.mark.timeout(120)
def test_serve_probes_each_dataset_source_with_its_field_map(tmp_path, unusable):
    def dataset(fields: str) -> str:
        path = tmp_path / "dataset.toml"
        shards = ", ".join(f'"{u}"' for u in unusable)
        path.write_text(f'[[sources]]\nname = "labels"\nshards = [{shards}]\n'
                        f'[sources.fields]\n{fields}\n')
        return str(path)

    proc = subprocess.run(
        [sys.executable, "-m", "mmdispatch.cli", "serve", "--dataset", dataset('text = ["txt"]'),
         "--world-size", "1", "--global-batch", "4"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "source 'labels' (shards " in proc.stderr and "found suffixes cls, npy" in proc.stderr
    proc, ready = serve(dataset('text = ["txt", "cls"]'), world_size=1)
    try:
        assert ready["readers"].startswith("tcp://")
    finally:
        kill(proc)


@pytest.mark.timeout(60)
def test_a_shard_command_that_never_answers_cannot_hold_the_start(tmp_path, unusable, caplog):
    from pipeline.probe import log_unprobed, probe_within

    # The first shard's command hangs; what the probe read before giving up proves nothing,
    # and the command is killed so no process is left behind.
    pidfile = tmp_path / "pid"
    hang = f"pipe:echo $$ > {pidfile}; exec sleep 600"
    result = probe_within([hang, *unusable], ReaderConfig(keep_members=False), timeout_s=1.0)
    assert result.timed_out and not result.refused and refusal(result) is None
    # The killed command ends the probe's read; its thread must not go on to the next shards
    # (a loaded host let it open them before the warning named "the shard waited on").
    time.sleep(1.0)
    assert result.shards == [hang] and result.gave_up_on == hang
    with caplog.at_level("WARNING", logger="mmdispatch.pipeline"):
        log_unprobed(result, "web")
    assert "source 'web' not probed: gave up waiting on pipe:echo" in caplog.text
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), "the hanging shard command was not killed"
    # The same probe with time to spare refuses the unusable shards after it.
    quick = probe_within([*unusable], ReaderConfig(keep_members=False), timeout_s=30.0)
    assert not quick.timed_out and quick.refused


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between open and read
        return False


@pytest.mark.timeout(60)
def test_a_probe_stopped_by_a_signal_ends_the_shard_command_it_started(tmp_path):
    """SIGTERM to serve during its start-up probe of a pipe: shard left the command running,
    orphaned (and an interrupted join says the probe's thread is no longer alive)."""
    import os
    import signal
    import subprocess
    import threading

    from pipeline.probe import probe_within
    from pipeline.reader import ReaderConfig

    marker = tmp_path / "started"
    command = f"pipe:touch {marker}; exec sleep 97"

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        with pytest.raises(SystemExit):
            probe_within([command], ReaderConfig(keep_members=False), timeout_s=30, max_samples=4)
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, old)
    assert marker.exists()
    left = subprocess.run(["pgrep", "-f", "sleep 97"], capture_output=True, text=True).stdout.split()
    assert not left, f"shard command still running: {left}"
