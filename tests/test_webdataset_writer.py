"""Shards written by webdataset's own writers read in mmdispatch exactly as webdataset reads them.

`webdataset.ShardWriter` and `webdataset.TarWriter` (with their own encoders: PIL images, dicts
to JSON, str to UTF-8, ints for `.cls`, numpy for `.npy`, gzip for `.gz`) write images, audio,
text, JSON, `.gz` text, multi-image samples (`0.jpg`, `1.jpg`, `10.jpg`) and keys with dots.
`iter_shard` must see webdataset's keys and members byte for byte, count what webdataset's own
decoders give, and count the members no kind maps; `mmdispatch inspect` must agree. webdataset
is a test dependency only: `pipeline/` never imports it (its package imports torch).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile

wds = pytest.importorskip("webdataset")
from PIL import Image  # noqa: E402

from mmdispatch.cli import main  # noqa: E402
from pipeline.counting import AudioConfig, ImageConfig, audio_lengths, image_lengths  # noqa: E402
from pipeline.errors import ErrorStats  # noqa: E402
from pipeline.fieldmap import FieldMap, ignored_label  # noqa: E402
from pipeline.reader import ReaderConfig, iter_shard  # noqa: E402
from pipeline.tokenize import ByteTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _wav(seconds: float, rate: int = 16000, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(int(seconds * rate), dtype=np.float32), rate, format=fmt)
    return buf.getvalue()


def _image(w: int, h: int, shade: int) -> Image.Image:
    return Image.new("RGB", (w, h), (shade, 100, 200 - shade))


def _samples() -> list[dict]:
    """Samples as a webdataset user writes them: values webdataset's encoder turns into bytes."""
    out = []
    for i in range(14):
        s: dict = {"__key__": f"sample{i:04d}"}
        kind = i % 7
        if kind == 0:
            s.update({"jpg": _image(64 + 8 * i, 48, i), "txt": f"a caption number {i}", "cls": i % 3})
        elif kind == 1:  # multi-image, natural order 0, 1, 10
            s.update({"0.jpg": _image(40, 40, 1), "1.jpg": _image(300, 120, 2),
                      "10.jpg": _image(90, 700, 3), "json": {"caption": f"three images {i}"}})
        elif kind == 2:
            s.update({"wav": _wav(1.5 + i / 10), "txt": "transcript " * (i + 1)})
        elif kind == 3:
            s.update({"flac": _wav(2.25, 22050, "FLAC"), "png": _image(33, 77, 9),
                      "json": {"conversations": [{"from": "human", "value": "what is this?"},
                                                 {"from": "gpt", "value": "a test " * i}]}})
        elif kind == 4:
            s.update({"txt.gz": "compressed text " * (10 + i), "npy": np.arange(i + 3)})
        elif kind == 5:  # a key with a dot: webdataset reads key "dotted{i}", suffix "v2.jpg"
            s.update({"__key__": f"dir/dotted{i}.v2", "jpg": _image(120, 90, 4),
                      "txt": "dotted key text"})
        else:
            s.update({"json": {"text": f"only json text {i}", "url": "http://x"}, "cls": 7})
        out.append(s)
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    """Three ShardWriter shards (5 samples each at most) and a gzip one from TarWriter."""
    out = tmp_path_factory.mktemp("wds")
    samples = _samples()
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=5, mtime=0) as sink:
        for s in samples[:12]:
            sink.write(s)
    with wds.TarWriter(str(out / "tail.tar.gz"), mtime=0) as tail:
        for s in samples[12:]:
            tail.write(s)
    return sorted(str(p) for p in out.glob("shard-*.tar")) + [str(out / "tail.tar.gz")]


def _wds_samples(url: str, *, decode: bool = False) -> list[dict]:
    ds = wds.WebDataset(url, shardshuffle=False)
    if decode:
        ds = ds.decode("pil")
    return list(ds)


def _members(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def test_the_shards_hold_what_webdataset_wrote(shards):
    assert len(shards) == 4 and sum(len(_wds_samples(u)) for u in shards) == 14
    keys = [s["__key__"] for u in shards for s in _wds_samples(u)]
    assert "dir/dotted5" in keys and "dir/dotted12" in keys


def test_iter_shard_reads_what_webdataset_reads(shards):
    fm = FieldMap()
    for url in shards:
        theirs = _wds_samples(url)
        stats = ErrorStats()
        ours = list(iter_shard(url, ReaderConfig(), stats=stats))
        assert stats.num_errors == 0, stats.as_dict()
        assert [r.key for r in ours] == [s["__key__"] for s in theirs]
        for rec, sample in zip(ours, theirs):
            members = _members(sample)
            assert {k: bytes(v) for k, v in rec.members.items()} == members
            images = [m for m in members if fm.classify(m)[0] == "image"]
            audio = [m for m in members if fm.classify(m)[0] == "audio"]
            assert sorted(it.member for it in rec.items if it.modality == "image") == sorted(images)
            assert [it.member for it in rec.items if it.modality == "audio"] == audio
        expected_ignored = Counter(ignored_label(m) for s in theirs for m in _members(s)
                                   if fm.classify(m)[0] is None)
        assert stats.ignored_members == expected_ignored


def test_counts_match_webdataset_decoded_content(shards):
    for url in shards:
        for rec, sample in zip(iter_shard(url, ReaderConfig()), _wds_samples(url, decode=True)):
            assert rec.key == sample["__key__"]
            # Images and audio: lengths from what webdataset's decoders give (decoded pixels;
            # soundfile on the raw bytes), not from mmdispatch's header parsers.
            for it in rec.items:
                if it.modality == "image":
                    w, h = sample[it.member].size
                    assert (it.enc_len, it.llm_len) == image_lengths(w, h, ImageConfig())
                else:
                    info = soundfile.info(io.BytesIO(bytes(rec.members[it.member])))
                    assert (it.enc_len, it.llm_len) == audio_lengths(info.duration, AudioConfig())
            multi = [it.member for it in rec.items if it.modality == "image"]
            if "10.jpg" in multi:
                assert multi == ["0.jpg", "1.jpg", "10.jpg"]  # natural order, not tar order
            # Text: webdataset decodes txt (and txt.gz) to str and json to objects.
            # Text: webdataset decodes txt (and txt.gz) to str and json to objects; readers ship
            # byte-level ids by default, conversations rendered through ChatML.
            texts = []
            for suffix in sorted(_members(sample)):  # one text per sample here: any order
                value, kind = sample[suffix], FieldMap().classify(suffix)[0]
                if kind == "text":
                    texts.append(value)
                elif kind == "conversation" and "conversations" in value:
                    roles = {"human": "user", "gpt": "assistant"}
                    texts.append("".join(f"<|im_start|>{roles[t['from']]}\n{t['value']}<|im_end|>\n"
                                         for t in value["conversations"]))
                elif kind == "conversation":
                    texts.append(value.get("text", value.get("caption")))
            assert ByteTokenizer.decode(rec.tokens.ids) == "".join(texts)
            assert rec.text_len == len("".join(texts).encode())
            assert rec.llm_len == rec.text_len + sum(it.llm_len for it in rec.items)


def test_inspect_agrees_with_webdataset(shards, capsys):
    theirs = [s for u in shards for s in _wds_samples(u)]
    fm = FieldMap()
    assert main(["inspect", "--json", *shards]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_samples"] == len(theirs) and report["errors"]["num_errors"] == 0
    kinds = Counter(fm.classify(m)[0] for s in theirs for m in _members(s))
    assert report["modalities"]["image"]["count"] == kinds["image"]
    assert report["modalities"]["audio"]["count"] == kinds["audio"]
    assert report["errors"]["ignored_members"] == {"cls": 4, "npy": 2}
    per = Counter(sum(fm.classify(m)[0] == "image" for m in _members(s)) for s in theirs)
    assert report["images_per_sample"] == {str(k): v for k, v in sorted(per.items())}


def test_webdataset_is_a_test_dependency_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("webdataset") for d in project["dependencies"])
    assert any(d.startswith("webdataset") for d in project["optional-dependencies"]["test"])
    probe = ("import sys, pipeline.reader, pipeline.inspect, pipeline.service, pipeline.probe, "
             "pipeline.gendata; sys.exit('webdataset' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
