"""Shard lists: expansion of paths, globs, brace ranges and URLs; exact split across workers."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.reader import iter_shard
from pipeline.shards import expand_shards, split_shards


def _touch(path) -> str:
    path.write_bytes(b"")
    return str(path)


def test_expand_brace_glob_dir_and_urls(tmp_path):
    names = [f"data-{i:03d}.tar" for i in range(5)]
    paths = [_touch(tmp_path / n) for n in names]
    gz = _touch(tmp_path / "extra.tar.gz")
    tgz = _touch(tmp_path / "more.tgz")
    _touch(tmp_path / "notes.txt")

    assert expand_shards([str(tmp_path / "data-{000..004}.tar")]) == paths
    assert expand_shards(str(tmp_path / "data-00[13].tar")) == [paths[1], paths[3]]
    assert expand_shards([str(tmp_path)]) == sorted([*paths, gz, tgz])
    assert expand_shards([f"file:{paths[0]}", "pipe:cat x.tar"]) == [f"file:{paths[0]}", "pipe:cat x.tar"]
    assert expand_shards([gz, tgz]) == [gz, tgz]


def test_double_star_spans_directories_locally_as_on_object_storage(tmp_path):
    """Probe: `data/**/*.tar` took only the shards exactly one directory deep (1 of 4 of a
    nested dataset, silently), while the same spec on S3 took all 4; a directory holding only
    subdirectories of shards said it held none, with no way on."""
    (tmp_path / "train" / "part1").mkdir(parents=True)
    (tmp_path / "train" / "part2").mkdir()
    paths = [_touch(tmp_path / "top.tar"), _touch(tmp_path / "train" / "mid.tar"),
             _touch(tmp_path / "train" / "part1" / "a.tar"),
             _touch(tmp_path / "train" / "part2" / "b.tar")]
    assert sorted(expand_shards(str(tmp_path / "**" / "*.tar"))) == sorted(paths)
    assert expand_shards(str(tmp_path / "train" / "*" / "*.tar")) == paths[2:]  # one level
    empty = tmp_path / "nested"
    (empty / "x").mkdir(parents=True)
    _touch(empty / "x" / "c.tar")
    with pytest.raises(FileNotFoundError) as got:
        expand_shards(str(empty))
    assert f"holds no shard files; its subdirectories are not listed: give '{empty}/**/*.tar'" in str(
        got.value)


def test_expand_errors_name_the_offender(tmp_path):
    missing = str(tmp_path / "nope-007.tar")
    with pytest.raises(FileNotFoundError, match="nope-007.tar"):
        expand_shards([missing])
    with pytest.raises(FileNotFoundError, match="nope-007.tar"):
        expand_shards([f"file:{missing}"])
    with pytest.raises(FileNotFoundError, match=r"zz-\*\.tar"):
        expand_shards([str(tmp_path / "zz-*.tar")])
    bad = _touch(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="notes.txt"):
        expand_shards([bad])
    dup = _touch(tmp_path / "a.tar")
    with pytest.raises(ValueError, match="more than once"):
        expand_shards([dup, dup])
    # The same file spelled two ways (relative and absolute, a directory and a file in it, a
    # file: URL, a symlink) would be read twice an epoch: each of its samples served twice.
    os.symlink(dup, tmp_path / "link.tar")
    for spelling in (f"{tmp_path}/./a.tar", str(tmp_path), f"file:{dup}", str(tmp_path / "link.tar")):
        with pytest.raises(ValueError, match=r"tar.* is listed more than once"):
            expand_shards([dup, spelling])
    with pytest.raises(ValueError, match="ftp://host/a.tar.*s3://, gs:// or http"):
        expand_shards(["ftp://host/a.tar"])  # a scheme nothing reads


def test_file_and_pipe_prefixes_are_case_insensitive_as_remote_schemes_are(small_shards, capsys):
    """`FILE:x.tar` was a missing local file and `PIPE:cat x.tar` an unsupported URL, while
    `S3://` and `HTTP://` were read: each prefix is known in any case, and spelled lower."""
    from mmdispatch.cli import main

    plain = os.path.abspath(small_shards[0])
    assert expand_shards([f"FILE:{plain}"]) == [f"file:{plain}"]
    assert expand_shards([f"File://{plain}"]) == [f"file://{plain}"]
    assert expand_shards([f"PIPE:cat {plain}", f"Pipe:cat x.tar"]) == [f"pipe:cat {plain}", "pipe:cat x.tar"]
    with pytest.raises(ValueError, match="listed more than once"):
        expand_shards([plain, f"FILE:{plain}"])
    expected = [(r.key, r.llm_len) for r in iter_shard(plain)]
    assert [(r.key, r.llm_len) for r in iter_shard(expand_shards(f"PIPE:cat {plain}")[0])] == expected
    for spelling in (f"FILE:{plain}", f"PIPE:cat {plain}"):
        assert main(["inspect", "--json", spelling]) == 0
        assert json.loads(capsys.readouterr().out)["num_samples"] == len(expected)


@settings(max_examples=200, deadline=None)
@given(
    num_shards=st.integers(0, 60),
    num_nodes=st.integers(1, 7),
    num_workers=st.integers(1, 9),
)
def test_split_covers_every_shard_exactly_once(num_shards, num_nodes, num_workers):
    urls = [f"s{i}.tar" for i in range(num_shards)]
    owners: dict[str, tuple[int, int]] = {}
    sizes = []
    for node in range(num_nodes):
        for worker in range(num_workers):
            mine = split_shards(urls, node_rank=node, num_nodes=num_nodes, worker_id=worker, num_workers=num_workers)
            sizes.append(len(mine))
            for url in mine:
                assert url not in owners, f"{url} read by {owners[url]} and {(node, worker)}"
                owners[url] = (node, worker)
    assert sorted(owners) == sorted(urls)
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"node_rank": 2, "num_nodes": 2, "worker_id": 0, "num_workers": 1},
        {"node_rank": 0, "num_nodes": 1, "worker_id": -1, "num_workers": 4},
        {"node_rank": 0, "num_nodes": 0, "worker_id": 0, "num_workers": 1},
    ],
)
def test_split_rejects_bad_ranks(kwargs):
    with pytest.raises(ValueError):
        split_shards(["a.tar"], **kwargs)


def test_gz_and_pipe_shards_read_like_plain(small_shards, tmp_path):
    import gzip
    import shutil

    plain = small_shards[0]
    gz = str(tmp_path / "copy.tar.gz")
    with open(plain, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    expected = [(r.key, r.llm_len) for r in iter_shard(plain)]
    assert expected
    assert [(r.key, r.llm_len) for r in iter_shard(gz)] == expected
    assert [(r.key, r.llm_len) for r in iter_shard(f"pipe:cat {plain}")] == expected
    assert [(r.key, r.llm_len) for r in iter_shard(f"file:{os.path.abspath(plain)}")] == expected


def test_failing_pipe_command_is_a_counted_error(tmp_path):
    from pipeline.errors import ErrorPolicy, ErrorStats, SampleError
    from pipeline.reader import ReaderConfig

    url = f"pipe:cat {tmp_path}/absent-shard.tar"
    stats = ErrorStats()
    assert list(iter_shard(url, ReaderConfig(errors=ErrorPolicy(mode="skip")), stats=stats)) == []
    assert stats.by_reason == {"shard_failed": 1}
    with pytest.raises(SampleError, match="absent-shard.tar"):
        list(iter_shard(url, ReaderConfig(errors=ErrorPolicy(mode="raise"))))


@pytest.mark.timeout(30)
def test_a_shard_command_killed_on_purpose_is_no_failure_of_its_own():
    """A stalled `pipe:` shard is killed by its reader (--stall-timeout) and reported as
    shard_stalled; its exit status -9 was also reported as a failed command (shard_failed)."""
    from pipeline.shards import open_shard

    hung = open_shard("pipe:sleep 100")
    hung.kill()
    assert hung.read() == b""
    hung.close()  # no OSError: the status is ours
    failing = open_shard("pipe:exit 3")
    assert failing.read() == b""
    with pytest.raises(OSError, match="exited with status 3"):
        failing.close()
