"""The dispatcher says, in one `event=stream_end` line, why the stream ended: the reason, the
source whose last epoch ended it, and per source the samples drawn and the epochs read whole.
With a blend and `--max-epochs`, the weights decide which source ends the job. And what the
byte bound cannot hold is said too: shuffle blocks larger than `--max-buffered-bytes`."""

from __future__ import annotations

import logging
import re

import pytest

from dispatcher_server.config import Source
from tests import servicekit as K
from tests.test_service import consume, dispatcher, make_config, readers


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    """4 shards of 10 samples."""
    return K.make_corpus(str(tmp_path_factory.mktemp("ends")), num_copies=4, base_samples=10,
                         base_shards=1)


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", line))


def _stream_end(config, caplog) -> tuple[dict[str, str], int]:
    """The one stream_end line's fields, and how many samples the trainer received."""
    caplog.set_level(logging.INFO, logger="mmdispatch")
    with dispatcher(config) as srv, readers(srv.reader_endpoint, 2):
        got = consume(srv.trainer_endpoint, 1)
    lines = [r.getMessage() for r in caplog.records if "event=stream_end" in r.getMessage()]
    assert len(lines) == 1, lines
    return _fields(lines[0]), sum(len(k) for _, mbs in got[0] for k in mbs)


def _per_source(value: str) -> dict[str, int]:
    return {name: int(n) for name, n in (part.split(":") for part in value.split(","))}


@pytest.mark.timeout(60)
def test_a_blend_says_which_source_ended_it_and_what_each_source_gave(shards, caplog):
    # Equal weights, sizes 10 and 30: the small source's one epoch ends the job.
    sources = [Source(name="small", shards=shards[:1]), Source(name="big", shards=shards[1:])]
    fields, served = _stream_end(make_config([], sources=sources, world_size=1, global_batch=4,
                                             num_microbatches=1), caplog)
    assert fields["reason"] == "max_epochs" and fields["source"] == "small"
    assert fields["max_epochs"] == "1"
    drawn = _per_source(fields["drawn"])
    assert drawn["small"] == 10 and abs(drawn["big"] - 10) <= 1
    assert sum(drawn.values()) == served
    assert _per_source(fields["epochs"]) == {"small": 1, "big": 0}


@pytest.mark.timeout(60)
def test_one_source_says_it_read_its_epochs(shards, caplog):
    fields, served = _stream_end(make_config(shards[:2], world_size=1, global_batch=4,
                                             num_microbatches=1, max_epochs=2), caplog)
    assert fields["reason"] == "max_epochs" and fields["source"] == "default"
    assert _per_source(fields["drawn"]) == {"default": served} and served == 40
    assert _per_source(fields["epochs"]) == {"default": 2}


@pytest.mark.timeout(60)
def test_a_step_limit_is_named_as_the_reason(shards, caplog):
    fields, served = _stream_end(make_config(shards, world_size=1, global_batch=4,
                                             num_microbatches=1, max_steps=3), caplog)
    assert fields["reason"] == "max_steps" and "source" not in fields
    assert fields["steps"] == "3" and served == 12


def _block_warnings(limit: int, shuffle: int, shards, caplog) -> list[str]:
    from dispatcher_server.config import FlowConfig

    caplog.set_level(logging.INFO, logger="mmdispatch")
    flow = FlowConfig(max_buffered_samples=256, max_buffered_bytes=limit, num_inflight_shards=2,
                      credit_batch=8)
    with dispatcher(make_config(shards, world_size=1, global_batch=4, num_microbatches=1,
                                flow=flow, shuffle_buffer=shuffle)) as srv, \
            readers(srv.reader_endpoint, 2):
        consume(srv.trainer_endpoint, 1)
    return [r.getMessage() for r in caplog.records
            if "event=shuffle_block_over_bytes" in r.getMessage()]


@pytest.mark.timeout(60)
def test_a_shuffle_block_past_the_byte_bound_is_said_once(shards, caplog):
    """A block is emitted only once complete: 40 inline samples of ~10 kB each cannot fit in
    50 kB, and the bytes held went past the bound with nothing said."""
    (line,) = _block_warnings(50_000, 40, shards, caplog)
    f = _fields(line)
    assert int(f["held_bytes"]) > 1.25 * 50_000 and f["max_buffered_bytes"] == "50000"
    # and what a whole block holds, which the dispatcher will come to hold
    assert 40 * 1_000 < int(f["block_bytes"]) < 40 * 100_000, line
    assert f["shuffle_buffer"] == "40"
    for fix in ("--payloads reference or direct", "a smaller --shuffle-buffer",
                "a larger --max-buffered-bytes"):
        assert fix in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit,shuffle", [(64 << 20, 40), (50_000, 0)])
def test_no_block_warning_when_the_blocks_fit_or_nothing_is_shuffled(shards, caplog, limit, shuffle):
    assert _block_warnings(limit, shuffle, shards, caplog) == []
