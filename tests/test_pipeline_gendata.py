"""gen-data: reproducible bytes, the promised mixture, real media headers."""

from __future__ import annotations

import hashlib

import pytest

from mmdispatch.cli import main
from pipeline.gendata import generate, generate_blend, make_sample, read_manifest
from pipeline.counting import CountingConfig, TextConfig
from pipeline.reader import ReaderConfig, iter_samples


def _digests(paths: list[str]) -> list[str]:
    return [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths]


def test_same_seed_same_bytes_different_seed_differs(tmp_path):
    a = generate(str(tmp_path / "a"), num_samples=24, num_shards=2, seed=7)
    b = generate(str(tmp_path / "b"), num_samples=24, num_shards=2, seed=7)
    c = generate(str(tmp_path / "c"), num_samples=24, num_shards=2, seed=8)
    assert [p.rsplit("/", 1)[1] for p in a] == ["shard-000000.tar", "shard-000001.tar"]
    assert _digests(a) == _digests(b)
    assert _digests(a) != _digests(c)


def test_cli_writes_shards(tmp_path):
    out = tmp_path / "cli"
    assert main(["gen-data", str(out), "--samples", "10", "--shards", "3", "--seed", "0"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["gen-data.json", "shard-000000.tar", "shard-000001.tar", "shard-000002.tar",
                     "tokenizer.json", "tokenizer_config.json"]
    assert sum(1 for _ in iter_samples([str(out / n) for n in names[1:4]])) == 10
    assert sorted(read_manifest(str(out))) == names[1:]  # every file it wrote, for the next run


def test_a_second_run_replaces_its_own_output_and_never_writes_beside_other_shards(tmp_path):
    """Regenerating with fewer shards left the old ones, and `serve --shards DIR` mixed them."""
    out = tmp_path / "out"
    generate(str(out), num_samples=12, num_shards=4, seed=0)
    (out / "notes.txt").write_text("mine")
    assert sorted(p.name for p in out.glob("*.tar")) == [f"shard-00000{i}.tar" for i in range(4)]
    generate(str(out), num_samples=12, num_shards=2, seed=1)
    assert sorted(p.name for p in out.glob("*.tar")) == ["shard-000000.tar", "shard-000001.tar"]
    pytest.importorskip("av")
    generate_blend(str(out), num_samples=20, num_shards=3, seed=0)
    assert not list(out.glob("*.tar")) and (out / "dataset.toml").exists()
    generate(str(out), num_samples=12, num_shards=2, seed=1)  # the blend's files go too
    assert not (out / "dataset.toml").exists() and not list(out.glob("*/*.tar"))
    assert (out / "notes.txt").read_text() == "mine"  # files not shards are left alone
    (out / "mine.tar").write_bytes((out / "shard-000000.tar").read_bytes())
    with pytest.raises(ValueError, match=r"holds files gen-data did not write \(.*mine.tar;"):
        generate(str(out), num_samples=12, num_shards=3, seed=1)
    assert sorted(p.name for p in out.glob("*.tar")) == ["mine.tar", "shard-000000.tar", "shard-000001.tar"]


def _user_shard(path, text: str) -> bytes:
    """A shard of the user's own at `path` (one text sample); returns its bytes."""
    import io
    import tarfile

    data = text.encode()
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("user0.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path.read_bytes()


def test_shards_of_the_users_named_as_gen_data_names_its_own_are_never_deleted(tmp_path):
    """shard-000000.tar is gen-data's name and the commonest name of a user's shards: only
    what gen-data recorded writing (its gen-data.json, at the size it wrote) is replaced."""
    out = tmp_path / "data"
    out.mkdir()
    theirs = {f"shard-00000{i}.tar": _user_shard(out / f"shard-00000{i}.tar", f"mine {i}") for i in range(3)}
    with pytest.raises(ValueError, match=r"did not write \(.*shard-000000.tar.*new or empty directory"):
        generate(str(out), num_samples=4, num_shards=1, seed=0)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == theirs
    # gen-data's own output with one shard swapped for the user's (another size) since
    generate(str(tmp_path / "gen"), num_samples=8, num_shards=2, seed=0)
    swapped = _user_shard(tmp_path / "gen" / "shard-000001.tar", "mine")
    with pytest.raises(ValueError, match="shard-000001.tar"):
        generate(str(tmp_path / "gen"), num_samples=8, num_shards=2, seed=1)
    assert (tmp_path / "gen" / "shard-000001.tar").read_bytes() == swapped
    assert (tmp_path / "gen" / "shard-000000.tar").exists()  # nothing removed on a refusal


def test_a_users_tokenizer_is_never_written_over(tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    assert main(["gen-data", str(out), "--samples", "4", "--shards", "1"]) == 2
    assert [p.name for p in out.iterdir()] == ["tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == "{}"


def test_an_interrupted_run_is_replaced_by_the_next(tmp_path, monkeypatch):
    """Its shards are recorded before they are written, so the half-written ones are its own."""
    from pipeline import gendata

    def make_sample(seed, index, **kw):
        if index == 6:
            raise KeyboardInterrupt
        return real(seed, index, **kw)

    real = gendata.make_sample
    monkeypatch.setattr(gendata, "make_sample", make_sample)
    with pytest.raises(KeyboardInterrupt):
        generate(str(tmp_path), num_samples=8, num_shards=2, seed=0)
    monkeypatch.setattr(gendata, "make_sample", real)
    paths = generate(str(tmp_path), num_samples=8, num_shards=2, seed=0)
    assert sum(1 for _ in iter_samples(paths)) == 8


def test_mixture_is_long_tailed_and_complete():
    kinds = {"text": 0, "image": 0, "multi": 0, "audio": 0, "image+audio": 0}
    exts: set[str] = set()
    for index in range(300):
        members = make_sample(0, index)
        images = [s for s in members if s.endswith(("jpg", "png"))]
        audio = [s for s in members if s.endswith(("wav", "flac"))]
        exts.update(s.rsplit(".", 1)[-1] for s in members)
        if len(images) > 1:
            kinds["multi"] += 1
        elif images and audio:
            kinds["image+audio"] += 1
        elif images:
            kinds["image"] += 1
        elif audio:
            kinds["audio"] += 1
        else:
            kinds["text"] += 1
    assert kinds["text"] == max(kinds.values())
    assert all(kinds.values()), kinds
    assert {"jpg", "png", "wav", "flac", "txt", "json"} <= exts


def test_sizes_span_orders_of_magnitude(small_shards):
    # Text lengths as a BPE would count them (the estimator): byte-level ids would flatten the
    # tail, since every sample's text is then several times longer.
    recs = list(iter_samples(small_shards, ReaderConfig(counting=CountingConfig(text=TextConfig(estimate=True)))))
    pixels = [it.meta["width"] * it.meta["height"] for r in recs for it in r.items if it.modality == "image"]
    assert min(pixels) < 64 * 64 and max(pixels) > 100 * min(pixels)
    lens = [r.llm_len for r in recs]
    assert max(lens) > 10 * sorted(lens)[len(lens) // 2]


def test_rejects_more_shards_than_samples(tmp_path):
    with pytest.raises(ValueError, match="num_shards=5"):
        generate(str(tmp_path), num_samples=3, num_shards=5, seed=0)


@pytest.mark.parametrize("samples, shards", [(3, 3), (17, 3), (24, 5), (512, 8)])
def test_a_blend_writes_the_shards_and_samples_asked_for(tmp_path, samples, shards):
    """Each source's share was rounded alone: --shards 3 wrote 4 shards (and --shards 2 wrote
    3); the parts now add up to what was asked, each source at least one."""
    pytest.importorskip("av")
    import tarfile

    _, paths = generate_blend(str(tmp_path), num_samples=samples, num_shards=shards, seed=0)
    assert len(paths) == shards
    keys = set()
    for path in paths:
        with tarfile.open(path) as tar:
            keys |= {m.name.split(".", 1)[0] for m in tar.getmembers()}
    assert len(keys) == samples
    with pytest.raises(ValueError, match="each source gets a shard"):
        generate_blend(str(tmp_path / "two"), num_samples=5, num_shards=2, seed=0)
