"""The dataset file and blended sources end to end: strict parsing with one-line errors, and a
three-source blend served by real processes, exactly once per source epoch, in the weights'
proportions, counted per source, and identical after the dispatcher is killed and restarted
from its journal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from mmdispatch.dataset import DatasetError, load_dataset
from tests import servicekit as K


def _write(tmp_path, text: str, name: str = "data.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return K.make_corpus(str(tmp_path_factory.mktemp("blend")), num_copies=18, base_samples=40,
                         base_shards=1)


def test_a_dataset_file_parses_into_sources_with_paths_relative_to_it(tmp_path):
    (tmp_path / "img").mkdir()
    for i in range(3):
        (tmp_path / "img" / f"{i:03d}.tar").write_bytes(b"")
    (tmp_path / "speech.tar").write_bytes(b"")
    path = _write(tmp_path, """
shuffle_buffer = 500
[[sources]]
name = "captions"
shards = "img/{000..002}.tar"
weight = 3
[sources.fields]
image = ["JPG", "png"]
text = ["txt"]

[[sources]]
name = "speech"
shards = ["speech.tar"]
""")
    sources, shuffle = load_dataset(path)
    assert shuffle == 500
    assert [s.name for s in sources] == ["captions", "speech"]
    assert sources[0].shards == [str(tmp_path / "img" / f"{i:03d}.tar") for i in range(3)]
    assert sources[0].weight == 3 and sources[1].weight == 1.0
    assert sources[0].fields == {"image": ["jpg", "png"], "text": ["txt"]}
    assert sources[1].fields is None



def test_relative_file_urls_and_names_with_a_colon_are_relative_to_the_dataset_file(tmp_path, monkeypatch):
    """Only specs without a colon were joined to the file's folder: `file:a/x.tar` and
    `ts/2024-01-01T10:00.tar` were read from the working directory, where a file of the same
    name was served in their place without a word."""
    data, cwd = tmp_path / "data", tmp_path / "cwd"
    for root in (data, cwd):
        (root / "a").mkdir(parents=True)
        (root / "ts").mkdir()
        (root / "a" / "x.tar").write_bytes(b"")
        (root / "ts" / "2024-01-01T10:00.tar").write_bytes(b"")
    path = _write(data, f"""
[[sources]]
name = "s"
shards = ["file:a/x.tar", "ts/2024-01-01T10:00.tar", "pipe:cat x.tar"]
""")
    monkeypatch.chdir(cwd)
    sources, _ = load_dataset(path)
    assert sources[0].shards == [f"file:{data / 'a' / 'x.tar'}", str(data / "ts" / "2024-01-01T10:00.tar"),
                                 "pipe:cat x.tar"]
    upper = _write(data, '[[sources]]\nname = "u"\nshards = ["FILE:a/x.tar", "PIPE:cat x.tar"]\n', "upper.toml")
    assert load_dataset(upper)[0][0].shards == [f"file:{data / 'a' / 'x.tar'}", "pipe:cat x.tar"]

@pytest.mark.parametrize("body,message", [
    ('[[sources]]\nname = "a"\nshards = "x.tar"\nwieght = 2\n',
     r"sources\[0\]\.wieght: unknown key \(allowed here: name, shards, weight, fields\)"),
    ('[[sources]]\nname = "a"\nshards = "x.tar"\nweight = "heavy"\n',
     r"sources\[0\]\.weight: expected .*number.*got 'heavy' \(a string\)"),
    ('[[sources]]\nname = "a"\nshards = "x.tar"\nweight = 0\n',
     r"sources\[0\]\.weight: expected greater than 0"),
    ('[[sources]]\nname = "a"\nshards = "x.tar"\nweight = inf\n',
     r"sources\[0\]\.weight: expected a finite number, got inf"),
    ('[[sources]]\nname = "a"\n', r"sources\[0\]\.shards: missing"),
    ('[[sources]]\nname = "a"\nshards = "x.tar"\n[sources.fields]\npictures = ["jpg"]\n',
     r"sources\[0\]\.fields\.pictures: unknown key \(allowed here: image, audio, video, text, "
     r"conversation\)"),
    ('[[sources]]\nname = "a"\nshards = "x.tar"\n[sources.fields]\nimage = ["png"]\ntext = ["png"]\n',
     r"extension 'png' is mapped to both image and text"),
    ('[[sources]]\nname = "a"\nshards = "x.tar"\n[[sources]]\nname = "a"\nshards = "x.tar"\n',
     r"source name 'a' is used twice"),
    ('[[sources]]\nname = "a"\nshards = "missing-*.tar"\n', r"sources\[0\] \('a'\)\.shards: "),
    # one shard in two sources (a copied block): each of its samples would be served twice
    ('[[sources]]\nname = "a"\nshards = "x.tar"\n[[sources]]\nname = "b"\nshards = "./x.tar"\n',
     r"sources\[1\] \('b'\)\.shards: shard .*x\.tar' is also in source 'a'"),
    ('sources = []\n', r": the dataset file lists no sources; add a \[\[sources\]\] table \(name, shards\)$"),
    ('shuffle_buffer = 10\n', r": the dataset file lists no sources; add a \[\[sources\]\] table"),
    ('shuffle_buffer = -1\n[[sources]]\nname = "a"\nshards = "x.tar"\n',
     r"data\.toml: shuffle_buffer: expected greater than or equal to 0, got -1 \(an integer\)$"),
    # an empty spec would be this file's folder: every shard beside the file, served silently
    ('[[sources]]\nname = "a"\nshards = ""\n', r"sources\[0\] \('a'\)\.shards: an empty path; give"),
    ('[[sources]]\nname = "a"\nshards = ["x.tar", " "]\n', r"sources\[0\] \('a'\)\.shards: an empty path"),
    ('[[sources]]\nname = "a"\nshards = []\n', r"sources\[0\] \('a'\)\.shards: an empty list"),
    ('[[sources]]\nname = "données"\nshards = "x.tar"\n',
     r"sources\[0\]\.name: expected a source name \(ASCII letters, .*got 'données'"),
    ('[[sources]]\nname = "a"\nshards = "x.tar"\n[sources.fields]\nimage = [".jpg"]\n',
     r"sources\[0\]\.fields\.image\[0\]: expected an extension such as 'jpg' .*got '\.jpg'"),
    ('shufle_buffer = 3\n[[sources]]\nname = "a"\nshards = "x.tar"\n', r"shufle_buffer: unknown key"),
    ('[[sources]\n', r"not valid TOML"),
    # probe: the item at fault, not the whole list as "expected string"; no internal class name
    ('[[sources]]\nname = "a"\nshards = ["x.tar", 5]\n',
     r"sources\[0\]\.shards\[1\]: expected string, got 5 \(an integer\)$"),
    ('[[sources]]\nname = "a"\nshards = 5\n', r"sources\[0\]\.shards: expected string, got 5"),
    ('[[sources]]\nname = "a"\nshards = "x.tar"\nfields = ["txt"]\n',
     r"sources\[0\]\.fields: expected a table of kind = \[extensions\] \(kinds: image, audio, "
     r"video, text, conversation\), got \['txt'\] \(an array\)$"),
    # a weight whose share of the blend underflows (or all but): refused, by the weight written
    *((f'[[sources]]\nname = "a"\nshards = "x.tar"\nweight = {w}\n'
       '[[sources]]\nname = "b"\nshards = "y.tar"\nweight = 1\n',
       rf"sources\[0\] \('a'\)\.weight: {w} is more than 1e\+12 times below the largest weight, "
       r"1\.0 \(source 'b'\): the blend would never draw it; raise it or leave the source out")
      for w in ("1e-320", "1e-300", "1e-13")),
    ('[[sources]]\nname = "a"\nshards = "x.tar"\nweight = 1e300\n'
     '[[sources]]\nname = "b"\nshards = "y.tar"\nweight = 1\n',
     r"sources\[1\] \('b'\)\.weight: 1\.0 is more than 1e\+12 times below the largest weight, "
     r"1e\+300 \(source 'a'\)"),
])
def test_a_bad_dataset_file_is_one_line_naming_file_and_key(tmp_path, body, message):
    (tmp_path / "x.tar").write_bytes(b"")
    (tmp_path / "y.tar").write_bytes(b"")
    path = _write(tmp_path, body)
    with pytest.raises(DatasetError, match=message) as e:
        load_dataset(path)
    assert "\n" not in str(e.value) and str(e.value).startswith(path)


def test_serve_refuses_a_bad_dataset_file_in_one_line(tmp_path):
    path = _write(tmp_path, '[[sources]]\nname = "a"\nshards = "x.tar"\ncolour = 1\n')
    r = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "serve", "--dataset", path,
                        "--world-size", "1", "--global-batch", "4"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "sources[0].colour: unknown key" in lines[0], r.stderr
    both = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "serve", "--dataset", path,
                           "--shards", "x.tar", "--world-size", "1", "--global-batch", "4"],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "not both" in both.stderr and "Traceback" not in both.stderr


def _blend_file(tmp_path, shards: list[str]) -> str:
    parts = {"captions": (shards[:9], 1), "speech": (shards[9:15], 1), "chat": (shards[15:], 2)}
    text = "".join(f'[[sources]]\nname = "{n}"\nshards = {json.dumps(s)}\nweight = {w}\n\n'
                   for n, (s, w) in parts.items())
    return _write(tmp_path, text)


def _keys_of(urls: list[str]) -> set[str]:
    return set(K.corpus_keys(urls))


def _flat(per_rank: dict[int, list]) -> list[list[str]]:
    """Each step's keys (all ranks, all micro-batches), in step order."""
    steps = {}
    for rank in sorted(per_rank):
        for step, mbs in per_rank[rank]:
            steps.setdefault(step, []).extend(k for mb in mbs for k in mb)
    return [steps[s] for s in sorted(steps)]


def test_a_blend_is_served_once_per_source_epoch_by_weight_and_survives_a_dispatcher_kill(
        shards, tmp_path):
    dataset = _blend_file(tmp_path, shards)
    extra = ["--max-epochs", "2", "--step-log", str(tmp_path / "steps.jsonl")]
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    with K.Stack(dataset, str(ref_dir), num_readers=2, extra=extra, metrics=True) as st:
        trainers = K.Trainers(st.ready["trainers"], K.WORLD)
        try:
            reference = trainers.join(60)
            metrics = K.scrape(st.metrics_port)
        finally:
            trainers.close()
    seq = [k for step in _flat(reference) for k in step]
    keys = {"captions": _keys_of(shards[:9]), "speech": _keys_of(shards[9:15]),
            "chat": _keys_of(shards[15:])}
    drawn = {n: [k for k in seq if k in ks] for n, ks in keys.items()}
    # chat (weight 1/2, 120 samples) ends the job after its 2 epochs, each key once per epoch.
    assert len(drawn["chat"]) == 2 * len(keys["chat"])
    assert set(drawn["chat"][:len(keys["chat"])]) == keys["chat"]
    assert set(drawn["chat"][len(keys["chat"]):]) == keys["chat"]
    for n in ("captions", "speech"):  # within their first epoch: no key twice
        assert len(drawn[n]) == len(set(drawn[n])) and abs(len(drawn[n]) / len(seq) - 0.25) < 0.02
    # Per-source counts: the step log and the metrics agree with what trainers got.
    logged = Counter()
    with open(tmp_path / "steps.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "plan":
                logged.update(rec["sources"])
    assert logged == Counter({n: len(d) for n, d in drawn.items()})
    for n, d in drawn.items():
        assert metrics[f'mmdispatch_source_samples_total{{source="{n}"}}'] == len(d)

    # The same blend, the dispatcher SIGKILLed mid-run and restarted from its journal.
    run_dir = tmp_path / "kill"
    run_dir.mkdir()
    with K.Stack(dataset, str(run_dir), num_readers=2, extra=["--max-epochs", "2"],
                 fixed_ports=True, journal=True) as st:
        trainers = K.Trainers(st.ready["trainers"], K.WORLD, commit_every=5)
        try:
            K.wait_for(lambda: trainers.progress() >= 25, 30, "streaming")
            K.kill(st.server)
            st.start_server()
            got = trainers.join(60)
        finally:
            trainers.close()
    assert got == reference


def test_gen_data_blend_writes_three_sources_and_a_dataset_file_that_serves_them(tmp_path):
    from pipeline.gendata import BLEND_SOURCES, generate_blend
    from pipeline.reader import iter_samples

    dataset, paths = generate_blend(str(tmp_path / "a"), num_samples=40, num_shards=6, seed=2)
    _, again = generate_blend(str(tmp_path / "b"), num_samples=40, num_shards=6, seed=2)
    assert [open(p, "rb").read() for p in paths] == [open(p, "rb").read() for p in again]
    sources, _ = load_dataset(dataset)
    assert [(s.name, s.weight, s.fields) for s in sources] == [
        (n, w, f) for n, (w, f) in BLEND_SOURCES.items()]
    assert sorted(u for s in sources for u in s.shards) == sorted(paths)
    mixes = {s.name: Counter(r.modality_mix for r in iter_samples(s.shards)) for s in sources}
    assert set(mixes["captions"]) == {"image+text"} and set(mixes["speech"]) == {"audio+text"}
    assert set(mixes["chat"]) == {"image+text", "video+text"}
    assert sum(map(sum, (m.values() for m in mixes.values()))) == 40


def test_a_blend_of_real_media_reaches_trainers_as_tensors_of_exactly_the_planned_lengths(tmp_path):
    """Three sources (captions, speech, conversations with images and clips), a trained BPE
    tokenizer and its ChatML template, through a dispatcher and two readers to two ranks: every
    text, image, video and audio tensor has exactly the planned length, conversations carry a
    loss mask on their assistant tokens only, every sample of an epoch arrives once, naming the
    source it came from."""
    pytest.importorskip("torch")
    pytest.importorskip("av")
    from dispatcher_server.config import FlowConfig
    from pipeline.counting import AudioConfig, CountingConfig, ImageConfig, TextConfig
    from pipeline.gendata import generate_blend, write_tokenizer
    from pipeline.preprocess import PreprocessConfig
    from pipeline.reader import ReaderConfig, iter_samples
    from pipeline.video import VideoConfig
    from tests.test_service import consume, dispatcher, make_config, readers
    from trainer_client.prefetch import prepare_item

    dataset, paths = generate_blend(str(tmp_path), num_samples=36, num_shards=6, seed=4)
    tokenizer = write_tokenizer(str(tmp_path), paths)
    rules = dict(image=ImageConfig(max_pixels=224 * 224), audio=AudioConfig(encoder_frames_per_s=5,
                                                                             llm_tokens_per_s=2.5),
                 video=VideoConfig(max_pixels=64 * 28 * 28, min_pixels=64 * 28 * 28))
    reader = ReaderConfig(counting=CountingConfig(text=TextConfig(tokenizer_path=tokenizer), **rules))
    pre = PreprocessConfig(**rules)
    sources, _ = load_dataset(dataset)
    keys = {s.name: {r.key for r in iter_samples(s.shards, reader)} for s in sources}

    def record(step):
        seen = []
        for mb in step.microbatches:
            assert [t.numel() for t in mb.text_ids] == [m.numel() for m in mb.loss_mask] == mb.text_len.tolist()
            for k, m in zip(mb.keys, mb.loss_mask):
                if k in keys["chat"]:  # a conversation: targets are the assistant turns only
                    assert 0 < int(m.sum()) < m.numel(), k
                else:
                    assert bool(m.all()), k
            for phase, eb in mb.encoders.items():
                for i, payload in enumerate(eb.payloads):
                    arr = prepare_item(eb.modalities[i], payload, eb.meta[i], pre,
                                       enc_len=int(eb.enc_len[i]), key=eb.sample_keys[i],
                                       member=eb.members[i])
                    assert arr.shape[0] == int(eb.enc_len[i])
                    seen.append((phase, eb.modalities[i]))
            seen += [("llm", k) for k in mb.keys]
            # each sample names the source it was drawn from
            assert len(mb.sources) == len(mb.keys)
            assert all(k in keys[src] for k, src in zip(mb.keys, mb.sources)), mb.sources
            seen += [("source", src) for src in mb.sources]
        return seen

    config = make_config([], sources=sources, world_size=2, global_batch=6, max_epochs=1,
                         shuffle_buffer=12, flow=FlowConfig(max_buffered_samples=256,
                                                            num_inflight_shards=3, credit_batch=8))
    with dispatcher(config) as srv, readers(srv.reader_endpoint, 2, reader=reader):
        got = consume(srv.trainer_endpoint, 2, record=record)
    seen = [x for steps in got.values() for step in steps for x in step]
    assert {m for ph, m in seen if ph == "vision"} == {"image", "video"}
    assert {m for ph, m in seen if ph == "audio"} == {"audio"}
    delivered = Counter(k for ph, k in seen if ph == "llm")
    assert max(delivered.values()) == 1
    assert {src for ph, src in seen if ph == "source"} == set(keys)
    # The job ends when a source has been read once; the others are within one epoch.
    assert any(set(delivered) >= ks for ks in keys.values())


def test_serve_takes_the_dataset_file_s_shuffle_buffer_unless_the_user_sets_one(tmp_path):
    import argparse

    from mmdispatch import serve

    (tmp_path / "a.tar").write_bytes(b"")
    path = _write(tmp_path, 'shuffle_buffer = 300\n[[sources]]\nname = "a"\nshards = "a.tar"\n'
                            '[sources.fields]\nimage = ["png"]\n')
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    base = ["--dataset", path, "--world-size", "2", "--global-batch", "8"]
    config = serve.build_config(serve.resolve(parser.parse_args(base)))
    assert config.shuffle_buffer == 300 and [s.name for s in config.sources] == ["a"]
    assert config.sources[0].fields == {"image": ["png"]}
    flag = serve.build_config(serve.resolve(parser.parse_args([*base, "--shuffle-buffer", "0"])))
    assert flag.shuffle_buffer == 0 and flag.block_sizes == [1]
    shards = serve.build_config(serve.resolve(parser.parse_args(
        ["--shards", str(tmp_path / "a.tar"), "--world-size", "2", "--global-batch", "8"])))
    assert shards.shuffle_buffer == 1000 and [s.name for s in shards.sources] == ["default"]


def test_inspect_a_dataset_reports_each_source_and_the_mixture_of_its_weights(tmp_path, capsys):
    from mmdispatch.cli import main
    from pipeline.reader import ReaderConfig, iter_shard

    shards = K.make_corpus(str(tmp_path / "c"), num_copies=4, base_samples=10, base_shards=1)
    parts = {"captions": (shards[:2], 1), "speech": (shards[2:3], 1), "chat": (shards[3:], 2)}
    path = _write(tmp_path, "".join(f'[[sources]]\nname = "{n}"\nshards = {json.dumps(s)}\n'
                                    f'weight = {w}\n\n' for n, (s, w) in parts.items()))
    assert main(["inspect", "--json", "--dataset", path]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["sources"]) == list(out["mixture"]) == ["captions", "speech", "chat"]
    for name, urls in (("captions", shards[:2]), ("speech", shards[2:3]), ("chat", shards[3:])):
        records = [r for u in urls for r in iter_shard(u, ReaderConfig(keep_members=False))]
        assert out["sources"][name]["num_samples"] == len(records)
        per_sample = sum(r.llm_len for r in records) / len(records)
        assert out["mixture"][name]["llm_tokens_per_sample"] == pytest.approx(per_sample, abs=0.1)
    mix = out["mixture"]
    assert [mix[n]["sample_share"] for n in mix] == [0.25, 0.25, 0.5]  # weights 1, 1, 2
    assert sum(m["token_share"] for m in mix.values()) == pytest.approx(1.0, abs=1e-3)
    expected = {n: mix[n]["sample_share"] * mix[n]["llm_tokens_per_sample"] for n in mix}
    for n in mix:  # a source's token share: its weight times its tokens per sample, normalized
        assert mix[n]["token_share"] == pytest.approx(expected[n] / sum(expected.values()), abs=1e-3)
    # Shard specs with a dataset file, or neither: one line naming the fix.
    assert main(["inspect", "--dataset", path, shards[0]]) == 2
    assert "drop the shard specs and --map, or drop --dataset" in capsys.readouterr().err
    assert main(["inspect"]) == 2
    assert "give shard specs" in capsys.readouterr().err


def test_the_mixture_keeps_the_ratio_of_weights_whose_sum_overflows():
    from dispatcher_server.config import Source
    from mmdispatch.inspecting import MODALITIES, mixture

    sources = [Source(name="a", shards=["/a.tar"], weight=1.5e308),
               Source(name="b", shards=["/b.tar"], weight=0.5e308)]
    report = {"num_samples": 10, "modalities": {m: {"llm_len": {"sum": 100.0}} for m in MODALITIES}}
    mix = mixture(sources, {"a": report, "b": report})
    assert [mix[n]["sample_share"] for n in "ab"] == [0.75, 0.25]
    assert [mix[n]["token_share"] for n in "ab"] == [0.75, 0.25]


def test_relative_shard_paths_are_sent_to_readers_as_the_dispatcher_resolves_them(tmp_path, monkeypatch):
    """Inline payloads kept `--shards` as written: a reader started elsewhere opened another
    directory's files (open_failed, or other files of the same name, silently)."""
    import argparse

    from mmdispatch import serve

    (tmp_path / "d").mkdir()
    for name in ("a.tar", "b.tar"):
        (tmp_path / "d" / name).write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    for payloads in ("inline", "direct", "reference"):
        config = serve.build_config(serve.resolve(parser.parse_args(
            ["--shards", "d/a.tar", f"file:{tmp_path}/d/b.tar", "--world-size", "1",
             "--global-batch", "2", "--payloads", payloads])))
        assert config.sources[0].shards == [str(tmp_path / "d" / "a.tar"), str(tmp_path / "d" / "b.tar")]


def test_a_pipe_command_in_a_dataset_file_runs_as_written_and_the_docs_say_so(tmp_path):
    """Shard paths are relative to the dataset file; a `pipe:` command is a shell command,
    run as written in the reading process's working directory (it cannot be rewritten the way
    a path is): the file keeps it verbatim, and docs/datasets.md says so, where it said only
    that shards are relative to the file."""
    from pathlib import Path

    path = _write(tmp_path, '[[sources]]\nname = "p"\nshards = "pipe:cat x.tar"\n')
    assert load_dataset(path)[0][0].shards == ["pipe:cat x.tar"]
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "datasets.md").read_text().split())
    assert "A `pipe:` shard is a shell command" in docs and "working directory" in docs


def test_a_source_too_light_for_its_share_of_the_shuffle_buffer_is_said_to_be_unshuffled(
        tmp_path, caplog):
    import argparse
    import logging

    from mmdispatch import serve

    for name in ("a.tar", "b.tar"):
        (tmp_path / name).write_bytes(b"")
    path = _write(tmp_path, '[[sources]]\nname = "big"\nshards = "a.tar"\nweight = 1999\n'
                            '[[sources]]\nname = "rare"\nshards = "b.tar"\nweight = 1\n')
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    config = serve.build_config(serve.resolve(parser.parse_args(
        ["--dataset", path, "--world-size", "1", "--global-batch", "8"])))
    assert config.block_sizes == [1000, 1]
    with caplog.at_level(logging.WARNING, logger="mmdispatch"):
        serve._warn_unshuffled(config)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "event=source_not_shuffled source=rare" in line
    enough = int(line.split("--shuffle-buffer ")[1].split()[0])  # 3000, give or take round-off
    w = config.weights[1]
    assert abs(enough - 3000) <= 1 and round(enough * w) >= 2 > round((enough - 1) * w)


@pytest.mark.parametrize("weights", [(1e-12, 1), (1e-320, 1e-320), (1e300, 1e289)])
def test_weights_within_the_ratio_the_blend_can_draw_are_taken(tmp_path, weights):
    for name in ("x.tar", "y.tar"):
        (tmp_path / name).write_bytes(b"")
    path = _write(tmp_path, "".join(f'[[sources]]\nname = "{n}"\nshards = "{n}.tar"\nweight = {w!r}\n'
                                    for n, w in zip("xy", weights)))
    sources, _ = load_dataset(path)
    assert [s.weight for s in sources] == list(weights)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shuffle", ["1000", "0"])
def test_serve_refuses_a_weight_too_small_to_blend_in_one_line(tmp_path, shuffle):
    """1e-320 beside 1 crashed the start with an OverflowError (1e-300 beside 1e300: a
    ZeroDivisionError) from the shuffle warning; without a shuffle it named the normalized
    weights [0.0, 1.0], not the ones written."""
    for name in ("x.tar", "y.tar"):
        (tmp_path / name).write_bytes(b"")
    path = _write(tmp_path, '[[sources]]\nname = "rare"\nshards = "x.tar"\nweight = 1e-320\n'
                            '[[sources]]\nname = "big"\nshards = "y.tar"\nweight = 1\n')
    r = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "serve", "--dataset", path,
                        "--world-size", "1", "--global-batch", "4", "--shuffle-buffer", shuffle,
                        "--probe-samples", "0"], capture_output=True, text=True, timeout=50)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "sources[0] ('rare').weight: 1e-320 is more than" in lines[0]


def test_a_server_config_refuses_a_weight_too_small_to_blend():
    from dispatcher_server.config import BatchConfig, ServerConfig, Source
    from dispatcher_server.planner.config import PlannerConfig

    with pytest.raises(ValueError, match=r"source 'rare': weight 1e-300 is more than 1e\+12 "
                                         r"times below the largest weight, 1e\+300 \(source 'big'\)"):
        ServerConfig(sources=[Source(name="rare", shards=["/x.tar"], weight=1e-300),
                              Source(name="big", shards=["/y.tar"], weight=1e300)],
                     world_size=1, batch=BatchConfig(global_batch=4),
                     planner=PlannerConfig(num_microbatches=1))


@pytest.mark.parametrize("weight", [0.0, 1e-320, 5e-324])
def test_the_unshuffled_warning_survives_a_share_no_buffer_can_shuffle(weight, caplog):
    """The warning computed 1.5 / weight: a ZeroDivisionError at 0, an OverflowError at 1e-320."""
    import logging
    from types import SimpleNamespace

    from dispatcher_server.config import Source
    from mmdispatch import serve

    config = SimpleNamespace(shuffle_buffer=1000, weights=[weight, 1.0], block_sizes=[1, 1000],
                             sources=[Source(name="rare", shards=["/x.tar"]),
                                      Source(name="big", shards=["/y.tar"])])
    with caplog.at_level(logging.WARNING, logger="mmdispatch"):
        serve._warn_unshuffled(config)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "event=source_not_shuffled source=rare" in line and "too small for any practical buffer" in line


def test_serve_names_a_bad_shuffle_buffer_in_the_dataset_file_by_its_key(tmp_path):
    """The file's `shuffle_buffer = -1` was reported as `--shuffle-buffer`, a flag not given."""
    import argparse

    from mmdispatch import serve

    (tmp_path / "a.tar").write_bytes(b"")
    path = _write(tmp_path, 'shuffle_buffer = -1\n[[sources]]\nname = "a"\nshards = "a.tar"\n')
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(DatasetError) as e:
        serve.build_config(serve.resolve(parser.parse_args(
            ["--dataset", path, "--world-size", "1", "--global-batch", "4"])))
    assert str(e.value) == f"{path}: shuffle_buffer: expected greater than or equal to 0, got -1 (an integer)"
    # The flags are still named as flags.
    with pytest.raises(ValueError, match=r"^--shuffle-buffer must be >= 0"):
        serve.build_config(serve.resolve(parser.parse_args(
            ["--dataset", path, "--world-size", "1", "--global-batch", "4", "--shuffle-buffer", "-2"])))


@pytest.mark.parametrize("weights, practical", [((1999, 1), True), ((47410, 10), True),
                                                ((1e6, 1e-6), False)])
def test_the_unshuffled_warnings_fix_starts_and_shuffles_the_source(tmp_path, caplog, weights, practical):
    """The warning's --shuffle-buffer was refused at start where the buffer alone outgrew
    --max-buffered-samples (4742 for a source of weight 10 in 47420), and for weights 1e6/1e-6
    it told a buffer of 1.5e12 samples."""
    import argparse
    import logging

    from mmdispatch import serve

    for name in ("a.tar", "b.tar"):
        (tmp_path / name).write_bytes(b"")
    path = _write(tmp_path, f'[[sources]]\nname = "big"\nshards = "a.tar"\nweight = {weights[0]!r}\n'
                            f'[[sources]]\nname = "rare"\nshards = "b.tar"\nweight = {weights[1]!r}\n')
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    base = ["--dataset", path, "--world-size", "1", "--global-batch", "8", "--max-buffered-samples", "4096"]
    config = serve.build_config(serve.resolve(parser.parse_args(base)))
    with caplog.at_level(logging.WARNING, logger="mmdispatch"):
        serve._warn_unshuffled(config)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "event=source_not_shuffled source=rare" in line
    if not practical:
        assert "too small for any practical buffer" in line, line
        return
    fix = line.split("fix=")[1].strip("'")
    flags = fix[fix.index("--shuffle-buffer"):].replace(" or more", "").split(" (")[0]
    flags = flags.replace(" shuffles it", "").replace(",", "").replace(" with", "").split()
    fixed = serve.build_config(serve.resolve(parser.parse_args([*base, *flags])))  # not refused
    assert fixed.block_sizes[1] >= 2, (flags, fixed.block_sizes)


def test_a_dataset_file_given_where_shards_or_settings_go_points_to_dataset(tmp_path):
    """Probe: `--shards ds.toml` said a shard must end in .tar; `--config ds.toml` said to move
    shuffle_buffer into a [serve] table. Neither said it is a dataset file `--dataset` takes."""
    from mmdispatch.settings import ConfigError, load
    from pipeline.shards import expand_shards

    (tmp_path / "x.tar").write_bytes(b"")
    path = _write(tmp_path, 'shuffle_buffer = 10\n[[sources]]\nname = "a"\nshards = "x.tar"\n')
    with pytest.raises(ValueError, match=f"a dataset file is given as --dataset {path}"):
        expand_shards([path])
    with pytest.raises(ConfigError, match=rf"{path} is a dataset file \(\[\[sources\]\]\), not a "
                                          rf"settings file: give it as --dataset {path}$"):
        load(path)


def test_shards_given_where_the_dataset_file_goes_and_back_say_which_flag_takes_them(tmp_path):
    """Probe: `--shards DIR` of a dataset (its dataset.toml beside the source folders) advised
    a glob that serves every source as one, weights and field maps gone; `--dataset DIR`,
    `--dataset x.tar` and `--dataset 'x/*.tar'` named no fix."""
    from pipeline.shards import expand_shards

    (tmp_path / "captions").mkdir()
    path = _write(tmp_path, '[[sources]]\nname = "a"\nshards = "captions"\n', "dataset.toml")
    with pytest.raises(FileNotFoundError,
                       match=f"it holds {path!r}: a dataset file is given as --dataset {path}$"):
        expand_shards([str(tmp_path)])
    with pytest.raises(DatasetError, match=f"is a directory: give the file in it, --dataset {path}$"):
        load_dataset(str(tmp_path))
    shard = tmp_path / "captions" / "0.tar"
    shard.write_bytes(b"\xff" * 1024)
    with pytest.raises(DatasetError, match=r"is a shard, not a TOML file \(shards are given as --shards\)"):
        load_dataset(str(shard))
    with pytest.raises(DatasetError, match=r"does not exist \(shards are given as --shards\)"):
        load_dataset(str(tmp_path / "captions" / "*.tar"))


def test_shards_given_twice_are_all_served_and_a_second_dataset_file_is_refused(tmp_path):
    """Probe: `serve --shards A --shards B` served B alone (A never read, the job 'done');
    `--dataset` twice kept the last file without a word."""
    import subprocess
    import sys

    from mmdispatch.cli import build_parser

    args = build_parser("serve").parse_args(["--shards", "a.tar", "b.tar", "--shards", "c.tar",
                                             "--world-size", "1", "--global-batch", "4"])
    assert args.shards == ["a.tar", "b.tar", "c.tar"]
    out = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "serve", "--dataset", "a.toml",
                          "--dataset", "b.toml", "--world-size", "1", "--global-batch", "4"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--dataset is given twice ('a.toml', 'b.toml')" in out.stderr
