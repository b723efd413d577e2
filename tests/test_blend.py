"""Sources blended by weight and shuffled in seeded blocks, driven without sockets.

A simulated set of readers delivers each open shard's samples in random chunks at random times
(as real readers do); the steps must not depend on that timing, must hold every sample of a
source epoch exactly once, must follow the weights, and must continue identically from a
journaled position (a dispatcher restart) at any step.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dispatcher_server import protocol as P
from dispatcher_server.assembler import StepAssembler
from dispatcher_server.blend import Blend, block_permutation
from dispatcher_server.config import BatchConfig, FlowConfig, ServerConfig, Source
from dispatcher_server.ordering import ShardOrder
from dispatcher_server.planner import PlannerConfig


def _corpus(name: str, num_shards: int, sizes: random.Random) -> dict[str, list[str]]:
    """shard URL -> sample keys (shards of uneven size, a few empty)."""
    return {f"/{name}/s{i}.tar": [f"{name}{i}-{j}" for j in range(sizes.choice([0, 3, 7, 12, 20]))]
            for i in range(num_shards)}


def _assembler(sources: dict[str, dict[str, list[str]]], weights: list[float], *, shuffle: int,
               global_batch: int = 16, max_epochs: int | None = 2, mode: str = "deterministic",
               seed: int = 5, mix: int = 1, inflight: int = 8) -> StepAssembler:
    names = list(sources)
    config = ServerConfig(sources=[Source(name=n, shards=list(sources[n]), weight=w)
                                   for n, w in zip(names, weights)],
                          world_size=1, batch=BatchConfig(global_batch=global_batch),
                          planner=PlannerConfig(num_microbatches=1), shuffle_buffer=shuffle,
                          shuffle_shards=mix, seed=seed, max_epochs=max_epochs,
                          flow=FlowConfig(num_inflight_shards=inflight))
    one = len(names) == 1
    orders = [ShardOrder(list(sources[n]), seed, max_epochs, salt="" if one else n) for n in names]
    return StepAssembler(orders, mode=mode, batch=config.batch, names=names,
                         weights=config.weights, windows=config.windows,
                         block_sizes=config.block_sizes, seed=seed, mixes=config.mixes)


def _run(a: StepAssembler, shards: dict[str, list[str]], rng: random.Random, *,
         max_steps: int = 10_000, positions: list | None = None) -> list[list[str]]:
    """Deliver samples like readers would (random shard, random chunk, from the shard's resume
    point) until the assembler is exhausted or `max_steps` steps were taken; `positions` gets
    the position after each step, taken when the server journals it."""
    steps: list[list[str]] = []
    positions = [] if positions is None else positions
    for _ in range(200_000):
        a.open_window()
        a.fill()
        while a.step_ready() and len(steps) < max_steps:
            steps.append([s.key for s in a.take_step().samples])
            positions.append(a.position())
            a.fill()
        if len(steps) >= max_steps or a.exhausted:
            return steps
        deliver_some(a, shards, rng)
    raise AssertionError("the stream did not finish")


def deliver_some(a: StepAssembler, shards: dict[str, list[str]], rng: random.Random) -> None:
    """What a reader sends next: 1-6 samples of a random open shard from its resume point
    (and that the shard is done, after its last)."""
    open_ = [p for p, pr in a.progress.items() if not pr.reader_done]
    if not open_:
        return
    pos = rng.choice(open_)
    prog = a.progress[pos]
    keys = shards[prog.url]
    start = prog.next_index
    chunk = keys[start:start + rng.randint(1, 6)]
    headers = [P.SampleHeader(k, start + i, 5, 5, b"t", []) for i, k in enumerate(chunk)]
    a.receive(pos, headers, [], [])
    if start + len(chunk) >= len(keys):
        a.reader_done(pos)


@pytest.fixture(scope="module")
def blend3() -> dict[str, dict[str, list[str]]]:
    sizes = random.Random(1)
    return {"img": _corpus("img", 9, sizes), "asr": _corpus("asr", 5, sizes),
            "chat": _corpus("chat", 4, sizes)}


def _all(shards: dict[str, list[str]]) -> dict[str, list[str]]:
    return {url: keys for src in shards.values() for url, keys in src.items()}


def test_the_blend_schedule_follows_the_weights_in_every_window():
    weights = [0.5, 0.3, 0.15, 0.05]
    b = Blend(weights, seed=3)
    seq = []
    while len(seq) < 50_000:
        s, n = b.run(37)
        b.draw(s, n)
        seq += [s] * n
    for n in (100, 1000, 10_000):
        for lo in range(0, len(seq) - n + 1, n // 2):
            got = Counter(seq[lo:lo + n])
            err = max(abs(got[s] / n - w) for s, w in enumerate(weights))
            assert err <= 2.5 / n, (n, lo, err)
    # The seed moves the interleaving, not the shares; the same seed repeats it.
    other = Blend(weights, seed=4)
    seq2 = []
    while len(seq2) < 1000:
        s, n = other.run(1)
        other.draw(s, n)
        seq2.append(s)
    assert seq2 != seq[:1000]
    again = Blend(weights, seed=3, drawn=None)
    assert [again.run(1)[0] for _ in range(1)] == seq[:1]


@pytest.mark.parametrize("seed", range(8))
def test_weights_equal_to_source_sizes_draw_every_sample_once_before_any_source_twice(seed):
    """With --max-epochs 1 the job ends when a source would be drawn into its second epoch.
    Phases spread over [0, 1) let a source of 2 samples beside sources of 8000 run a whole
    sample ahead: seed 6 of this mix ended the epoch at 91% of the larger sources. At whole
    quotas every source now holds exactly its quota, so the first overdraw comes only after
    every sample of every source was drawn."""
    sizes = [2000, 8000, 500, 600, 10, 10, 200, 200, 8000, 2, 40, 10, 6, 2, 10, 10, 2000, 8000, 15, 10]
    blend = Blend([float(n) for n in sizes], seed)
    for _ in range(sum(sizes)):
        s = blend.next_source()
        assert blend.drawn[s] < sizes[s], f"source {s} drawn past its size at draw {blend.total}"
        blend.draw(s, 1)
    assert blend.drawn == sizes


def test_sources_of_equal_weight_take_turns_in_a_seeded_order():
    def first_draws(seed: int) -> list[int]:
        blend, out = Blend([1.0] * 4, seed), []
        for _ in range(8):
            out.append(blend.next_source())
            blend.draw(out[-1], 1)
        return out

    for seed in range(10):
        draws = first_draws(seed)
        assert sorted(draws[:4]) == [0, 1, 2, 3] and draws[4:] == draws[:4], draws
    assert len({tuple(first_draws(seed)) for seed in range(10)}) > 1, "the seed orders nothing"


def test_huge_weights_whose_sum_overflows_keep_their_ratio():
    """1.5e308 + 0.5e308 is inf: normalizing by the sum made every weight 0 and the blend even."""
    b = Blend([1.5e308, 0.5e308], seed=1)
    seq = []
    while len(seq) < 4000:
        s, n = b.run(1)
        b.draw(s, n)
        seq.append(s)
    assert Counter(seq) == {0: 3000, 1: 1000}
    config = ServerConfig(sources=[Source(name="a", shards=["/a.tar"], weight=1.5e308),
                                   Source(name="b", shards=["/b.tar"], weight=0.5e308)],
                          world_size=1, batch=BatchConfig(global_batch=4),
                          planner=PlannerConfig(num_microbatches=1))
    assert config.weights == [0.75, 0.25] and config.block_sizes == [750, 250]
    with pytest.raises(ValueError, match="finite and positive"):
        Blend([1.0, float("inf")], seed=1)


def test_a_block_permutation_depends_on_the_block_not_on_when_it_is_asked():
    p = block_permutation(7, "src", 12, 3, 100)
    assert sorted(p) == list(range(100)) and p != list(range(100))
    assert block_permutation(7, "src", 12, 3, 100) == p
    assert block_permutation(8, "src", 12, 3, 100) != p
    assert block_permutation(7, "src", 12, 4, 100) != p


@pytest.mark.parametrize("shuffle", [0, 40])
def test_steps_do_not_depend_on_reader_timing_and_hold_every_source_epoch_once(blend3, shuffle):
    weights = [0.6, 0.3, 0.1]
    runs = [_run(_assembler(blend3, weights, shuffle=shuffle), _all(blend3), random.Random(t))
            for t in range(3)]
    assert runs[0] == runs[1] == runs[2]
    steps = runs[0]
    assert all(len(s) == 16 for s in steps[:-1]) and steps[-1]
    seq = [k for s in steps for k in s]
    # Exactly once per source epoch: each source's draws are whole epochs, then a prefix of
    # the next (the job ends when a source it needs has read its last epoch).
    for name, shards in blend3.items():
        keys = sorted(k for ks in shards.values() for k in ks)
        drawn = [k for k in seq if k.startswith(name)]
        whole, rest = divmod(len(drawn), len(keys))
        for e in range(whole):
            assert sorted(drawn[e * len(keys):(e + 1) * len(keys)]) == keys, (name, e)
        assert len(set(drawn[whole * len(keys):])) == rest
    # One source ran out after its 2 epochs: that ended the job.
    assert any(Counter(k.split("-")[0].rstrip("0123456789") for k in seq)[n]
               == 2 * sum(map(len, blend3[n].values())) for n in blend3)
    # The realized mixture follows the weights.
    share = Counter(k[:3] if not k.startswith("chat") else "chat" for k in seq)
    for name, w in zip(blend3, weights):
        assert abs(share[name[:3] if name != "chat" else "chat"] / len(seq) - w) < 0.02


def test_shuffle_mixes_samples_across_shards_and_changes_between_epochs():
    sizes = random.Random(2)
    src = {"one": _corpus("one", 12, sizes)}
    in_order = [k for s in _run(_assembler(src, [1.0], shuffle=0), _all(src), random.Random(0))
                for k in s]
    shuffled_steps = _run(_assembler(src, [1.0], shuffle=64), _all(src), random.Random(0))
    shuffled = [k for s in shuffled_steps for k in s]
    n = sum(map(len, src["one"].values()))
    assert sorted(shuffled[:n]) == sorted(in_order[:n]) and sorted(shuffled[n:]) == sorted(in_order[n:])
    assert shuffled[:n] != in_order[:n]
    # Samples of several shards meet in a step (in order they come one shard after another).
    shard_mix = [len({k.split("-")[0] for k in step}) for step in shuffled_steps]
    assert max(shard_mix) >= 4
    # Epoch 1 is not epoch 0 in another order of the same steps.
    first = {frozenset(s) for s in shuffled_steps if all(k in set(shuffled[:n]) for k in s)}
    assert not first & {frozenset(s) for s in shuffled_steps[len(first):]}
    # One source, so steps never span its epochs.
    assert len(shuffled_steps[0]) == 16


@pytest.mark.parametrize("shuffle,stop", [(0, 3), (40, 1), (40, 4), (40, 7), (200, 5)])
def test_a_restart_from_the_journaled_position_continues_the_same_steps(blend3, shuffle, stop):
    """What a dispatcher restart does: a fresh assembler reset to the position after step `stop`
    (as journaled), with readers starting every shard at the resume point it names."""
    weights = [0.5, 0.3, 0.2]
    whole = _run(_assembler(blend3, weights, shuffle=shuffle), _all(blend3), random.Random(9))
    positions: list[dict] = []
    head = _run(_assembler(blend3, weights, shuffle=shuffle), _all(blend3), random.Random(4),
                max_steps=stop, positions=positions)
    resumed = _assembler(blend3, weights, shuffle=shuffle)
    resumed.reset(positions[-1])
    tail = _run(resumed, _all(blend3), random.Random(11))
    assert head + tail == whole


def test_a_resume_with_another_number_of_sources_is_refused(blend3):
    a = _assembler(blend3, [1, 1, 1], shuffle=10)
    position = a.position()
    two = _assembler({k: blend3[k] for k in ("img", "asr")}, [1, 1], shuffle=10)
    with pytest.raises(ValueError, match="3 sources cannot resume a dataset of 2"):
        two.reset(position)


def test_arrival_mode_blends_by_weight_and_keeps_every_sample_once(blend3):
    steps = _run(_assembler(blend3, [0.5, 0.25, 0.25], shuffle=30, mode="arrival", max_epochs=1),
                 _all(blend3), random.Random(3))
    seq = [k for s in steps for k in s]
    assert len(seq) == len(set(seq))


def test_a_shuffle_buffer_that_does_not_fit_the_sample_bound_is_refused_naming_both():
    with pytest.raises(ValueError, match="max_buffered_samples=4096 is too small.*--shuffle-buffer"):
        ServerConfig(shards=["/d/a.tar"], world_size=1, batch=BatchConfig(global_batch=256),
                     planner=PlannerConfig(num_microbatches=1), shuffle_buffer=3000)
    with pytest.raises(ValueError, match="global_batch = 5120 by at least the open shards") as info:
        ServerConfig(shards=["/d/a.tar"], world_size=1, batch=BatchConfig(global_batch=1024),
                     planner=PlannerConfig(num_microbatches=1), shuffle_buffer=0)
    assert "shuffle" not in str(info.value)  # no shuffle to lower: it said "shuffle buffer (1)"


def test_bench_mixture_measures_the_served_sequence_against_the_weights():
    from bench.mixture import max_abs_err, realized_sources

    # The measure itself: a sequence that alternates in blocks of 50 is 0.5 off in a window of 50.
    assert max_abs_err([0] * 50 + [1] * 50, [0.5, 0.5], 50) == pytest.approx(0.5)
    assert max_abs_err([0, 1] * 50, [0.5, 0.5], 10) == pytest.approx(0.0)
    seq, weights = realized_sources(20_000, shuffle=200, global_batch=64)
    assert len(seq) == 20_000 and set(seq) == {0, 1, 2}
    assert max_abs_err(seq, weights, 2_000) < 0.005


def test_a_source_emitting_a_complete_block_is_not_a_head_that_may_pass_the_memory_bounds():
    """Credit control lets the positions the order waits on have samples past the bounds. A
    source emitting a complete block waits on nothing: prefilling its next block must stay
    within the bounds (the slow-trainer stream went 20 MB over while it did not)."""
    src = {"one": {"/one/a.tar": [f"a-{j}" for j in range(20)], "/one/b.tar": [f"b-{j}" for j in range(20)]}}
    a = _assembler(src, [1.0], shuffle=8, global_batch=4)
    a.open_window()
    assert a.heads() == {0}  # the first block fills from position 0
    a.receive(0, [P.SampleHeader(f"a-{j}", j, 5, 5, b"", []) for j in range(12)], [], [])
    a.fill()
    assert a.step_ready() and a.streams[0].perm is not None
    assert a.heads() == set()
    while a.step_ready():
        a.take_step()
        a.fill()
    assert a.streams[0].perm is None and a.heads() == {0}  # emitted: the next block needs pos 0


def _big_shards(name: str, num_shards: int, rng: random.Random) -> dict[str, list[str]]:
    """Shards larger than the shuffle block, of uneven sizes, one empty."""
    return {f"/{name}/s{i}.tar": [f"{name}{i}-{j}" for j in range(0 if i == 3 else rng.randint(40, 90))]
            for i in range(num_shards)}


def _shards_per_step(steps: list[list[str]]) -> list[int]:
    return [len({k.split("-")[0] for k in step}) for step in steps]


@pytest.mark.parametrize("mix", [3, 6])
def test_blocks_that_mix_shards_do_not_depend_on_reader_timing_and_hold_each_sample_once(mix):
    """Shards larger than the block: pulled one after another, nearly every step held one
    shard, the same shard groups every epoch. Drawn side by side, steps hold `mix` shards, the
    same steps whatever the readers' timing, and every sample once per epoch."""
    src = {"one": _big_shards("one", 12, random.Random(4))}
    n = sum(map(len, src["one"].values()))
    runs = [_run(_assembler(src, [1.0], shuffle=32, mix=mix), _all(src), random.Random(t))
            for t in range(3)]
    assert runs[0] == runs[1] == runs[2]
    seq = [k for step in runs[0] for k in step]
    keys = sorted(k for ks in src["one"].values() for k in ks)
    assert sorted(seq[:n]) == keys and sorted(seq[n:]) == keys
    one_by_one = _run(_assembler(src, [1.0], shuffle=32), _all(src), random.Random(0))
    assert sorted(k for s in one_by_one for k in s) == sorted(seq)
    mixed, plain = _shards_per_step(runs[0]), _shards_per_step(one_by_one)
    assert sum(x >= min(mix, 3) for x in mixed) >= 0.8 * len(mixed)
    assert sum(x <= 2 for x in plain) >= 0.8 * len(plain)


@pytest.mark.parametrize("stop", [1, 3, 6, 11, 17])
def test_a_restart_inside_a_block_that_mixes_shards_continues_the_same_steps(stop):
    src = {"one": _big_shards("one", 10, random.Random(8))}
    whole = _run(_assembler(src, [1.0], shuffle=32, mix=4), _all(src), random.Random(9))
    positions: list[dict] = []
    head = _run(_assembler(src, [1.0], shuffle=32, mix=4), _all(src), random.Random(4),
                max_steps=stop, positions=positions)
    assert positions[-1]["streams"][0]["mix"] == 4
    resumed = _assembler(src, [1.0], shuffle=32, mix=4)
    resumed.reset(positions[-1])
    tail = _run(resumed, _all(src), random.Random(11))
    assert head + tail == whole


def test_a_blend_whose_blocks_mix_shards_restarts_and_keeps_its_weights(blend3):
    weights = [0.5, 0.3, 0.2]
    whole = _run(_assembler(blend3, weights, shuffle=60, mix=2), _all(blend3), random.Random(2))
    positions: list[dict] = []
    head = _run(_assembler(blend3, weights, shuffle=60, mix=2), _all(blend3), random.Random(5),
                max_steps=4, positions=positions)
    resumed = _assembler(blend3, weights, shuffle=60, mix=2)
    resumed.reset(positions[-1])
    assert head + _run(resumed, _all(blend3), random.Random(6)) == whole


def test_a_position_written_before_blocks_mixed_shards_resumes_one_shard_after_another():
    """A journal written without `mix` resumes its block as it was pulled: one shard after
    another (the fingerprint refuses a change of shuffle_shards, so such a journal's blocks
    stay so)."""
    src = {"one": _big_shards("one", 10, random.Random(8))}
    whole = _run(_assembler(src, [1.0], shuffle=32), _all(src), random.Random(9))
    positions: list[dict] = []
    head = _run(_assembler(src, [1.0], shuffle=32), _all(src), random.Random(4), max_steps=5,
                positions=positions)
    assert "mix" not in positions[-1]["streams"][0]
    resumed = _assembler(src, [1.0], shuffle=32)
    resumed.reset(positions[-1])
    assert head + _run(resumed, _all(src), random.Random(11)) == whole


def test_shuffle_shards_opens_that_many_shards_and_is_part_of_the_fingerprint():
    def config(**kw):
        return ServerConfig(shards=[f"/s{i}.tar" for i in range(20)], world_size=1,
                            batch=BatchConfig(global_batch=8), planner=PlannerConfig(num_microbatches=1),
                            flow=FlowConfig(num_inflight_shards=2), **kw)
    assert config(shuffle_shards=6).windows == [6] and config().windows == [2]
    assert config(shuffle_shards=6).fingerprint() != config().fingerprint()
    assert "shuffle_shards" not in config().dataset_fingerprint()  # as before the option
    assert config().fingerprint()["shuffle_shards"] == 1  # the journal's: recorded, so compared
    with pytest.raises(ValueError, match="shuffle_shards=4 applies to deterministic mode"):
        config(shuffle_shards=4, mode="arrival")
    with pytest.raises(ValueError, match="shuffle_buffer=0 turns the shuffle off"):
        config(shuffle_shards=4, shuffle_buffer=0)


@pytest.mark.parametrize("written, rewritten", [
    ((5, 3, 2), (0.5, 0.3, 0.2)), ((6, 3, 1), (0.6, 0.3, 0.1)), ((7, 2, 1), (0.7, 0.2, 0.1)),
    ((3, 3, 4), (0.3, 0.3, 0.4)), ((6, 3, 1), (1.2, 0.6, 0.2)), ((1, 1, 3), (0.1, 0.1, 0.3)),
])
def test_weights_written_another_way_are_the_same_blend_for_journals_and_checkpoints(
        tmp_path, written, rewritten):
    """5/3/2 and 0.5/0.3/0.2 draw the same sequence: a resume with either is the same job; a
    resume with weights that draw another sequence is refused, naming the sources. Float
    division made 6/3/1 and 0.6/0.3/0.1 two blends (0.09999999999999999 against 0.1): refused."""
    from dispatcher_server.blend import as_drawn, differing
    from dispatcher_server.journal import Journal, JournalError, StepEntry
    from trainer_client.client import dataset_difference

    def config(*weights):
        return ServerConfig(sources=[Source(name=n, shards=[f"/{n}/s{i}.tar" for i in range(4)],
                                            weight=w) for n, w in zip("abc", weights)],
                            world_size=1, batch=BatchConfig(global_batch=8),
                            planner=PlannerConfig(num_microbatches=1), shuffle_buffer=40)
    first, again, other = config(*written), config(*rewritten), config(0.4, 0.4, 0.2)
    def draws(weights):
        blend, out = Blend(weights, 7), []
        for _ in range(3000):
            out.append(blend.next_source())
            blend.draw(out[-1], 1)
        return out
    assert draws(first.weights) == draws(again.weights)
    assert (first.weights, first.windows, first.block_sizes) == (
        again.weights, again.windows, again.block_sizes)
    journal = Journal(str(tmp_path), first.fingerprint())
    journal.record_step(StepEntry(step=0, epoch=0, world_size=1, num_samples=8,
                                  cursor_after={"base": 1}, digest="d", plan={"p": 0}))
    journal.close()
    journal = Journal(str(tmp_path), again.fingerprint())
    assert journal.last_step == 0
    journal.close()
    with pytest.raises(JournalError, match=rf"sources: journal has .*'a', {written[0]}"):
        Journal(str(tmp_path), other.fingerprint())
    assert differing(first.dataset_fingerprint(), again.dataset_fingerprint()) == []
    assert differing(first.dataset_fingerprint(), other.dataset_fingerprint()) == ["sources"]
    assert dataset_difference(first.dataset_fingerprint(), again.dataset_fingerprint()) == ""
    renamed = ServerConfig(sources=[Source(name=n, shards=[f"/{m}/s{i}.tar" for i in range(4)],
                                           weight=w) for n, m, w in zip("xbc", "abc", written)],
                           world_size=1, batch=BatchConfig(global_batch=8),
                           planner=PlannerConfig(num_microbatches=1), shuffle_buffer=40)
    assert differing(first.dataset_fingerprint(), renamed.dataset_fingerprint()) == ["sources"]
    assert as_drawn(first.dataset_fingerprint()) == as_drawn(again.dataset_fingerprint())
    assert as_drawn(first.dataset_fingerprint()) != as_drawn(other.dataset_fingerprint())
