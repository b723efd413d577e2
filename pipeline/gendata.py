"""Write reproducible synthetic multimodal WebDataset shards with a realistic long-tailed mix.

Samples are text-only (most), image+text, multi-image, audio+text and image+audio+text, with
real JPEG/PNG/WAV/FLAC bytes whose sizes and durations span tiny icons to 4000x3000 photos and
half-second blips to ten-minute recordings; on request (`--video-share`) some also get a small
H.264 MP4 clip. Pixels and samples are smooth or silent so files
stay small while headers are real. Same seed, same bytes (fixed tar metadata, per-sample RNG).
Beside the shards, a small byte-level BPE tokenizer trained on their texts (tokenizer.json, plus
tokenizer_config.json with a ChatML chat template), the same for the same shards.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import tarfile

import numpy as np
import soundfile
from PIL import Image

from dispatcher_server.cliopts import check_output_dir, finite_float, say
from dispatcher_server.files import replace_file
from pipeline.shards import SHARD_SUFFIXES

#: Sample kinds and their shares of the mix.
MIX: dict[str, float] = {
    "text": 0.45,
    "image+text": 0.25,
    "multi-image": 0.10,
    "audio+text": 0.12,
    "image+audio+text": 0.08,
}

_WORDS = (
    "the of and to a in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "what more can out up about time said into some could them other than then now only its new "
    "two may first any like these over such our after most also made many before must through "
    "years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being under "
    "never day same another know while last might us great old year off come since against go came "
    "right used take three image picture shows describe audio speaker model training dataset token "
    "function variable returns parameter value error example number python string list object "
    "distributed gradient encoder attention sequence batch balanced dispatcher shard sample "
    "café naïve Zürich résumé 東京 数据 모델"
).split()
_PUNCT = (".", ",", "?", "!", ";", ":")
_ASPECTS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 3 / 2, 2 / 3, 2.0, 0.5, 4.0)


def _text(rng: np.random.Generator, mean_log_words: float) -> str:
    num_words = int(np.clip(rng.lognormal(mean_log_words, 1.1), 3, 30000))
    ranks = np.arange(1, len(_WORDS) + 1)
    p = 1.0 / ranks**1.1
    words = [_WORDS[i] for i in rng.choice(len(_WORDS), size=num_words, p=p / p.sum())]
    for pos in range(int(rng.integers(6, 16)), num_words, 12):
        words[pos] += _PUNCT[int(rng.integers(len(_PUNCT)))]
        if rng.random() < 0.15:
            words[pos] += f" {int(rng.integers(0, 100000))}"
    return " ".join(words)


def _text_members(rng: np.random.Generator, mean_log_words: float) -> dict[str, bytes]:
    if rng.random() < 0.4:
        turns = [
            {"from": "human" if i % 2 == 0 else "gpt", "value": _text(rng, mean_log_words - 0.7)}
            for i in range(2 * int(rng.integers(1, 4)))
        ]
        name, data = "json", json.dumps({"conversations": turns}, ensure_ascii=False).encode()
    else:
        name, data = "txt", _text(rng, mean_log_words).encode()
    if len(data) > 4096 and rng.random() < 0.5:
        return {name + ".gz": gzip.compress(data, compresslevel=6, mtime=0)}
    return {name: data}


def _image_size(rng: np.random.Generator) -> tuple[int, int]:
    u = rng.random()
    if u < 0.10:
        long_side = int(rng.integers(16, 97))  # icons
    elif u < 0.95:
        long_side = int(np.clip(rng.lognormal(np.log(640), 0.6), 100, 2000))
    else:
        long_side = int(rng.integers(2000, 4001))  # large photos
    aspect = _ASPECTS[int(rng.integers(len(_ASPECTS)))]
    if aspect >= 1:
        return long_side, max(1, round(long_side / aspect))
    return max(1, round(long_side * aspect)), long_side


def _image(rng: np.random.Generator) -> tuple[str, bytes]:
    width, height = _image_size(rng)
    seed_pixels = rng.integers(0, 256, size=(3, 4, 3), dtype=np.uint8)
    small = Image.fromarray(seed_pixels, "RGB")
    out = io.BytesIO()
    if rng.random() < 0.25:
        # Flat blocks: PNG's deflate shrinks them to almost nothing.
        small.resize((width, height), Image.Resampling.NEAREST).save(out, "PNG", compress_level=1)
        return "png", out.getvalue()
    small.resize((width, height), Image.Resampling.BILINEAR).save(out, "JPEG", quality=80)
    return "jpg", out.getvalue()


def _audio(rng: np.random.Generator) -> tuple[str, bytes]:
    if rng.random() < 0.04:
        duration = float(rng.uniform(180, 600))  # rare long recordings
    else:
        duration = float(np.clip(rng.lognormal(np.log(6.0), 1.0), 0.5, 180))
    long_clip = duration > 30
    rate = 8000 if long_clip or rng.random() < 0.6 else 16000
    n = int(duration * rate)
    signal = np.zeros(n, dtype=np.float32)
    # A few short tone bursts over silence: realistic headers, tiny FLAC files.
    for _ in range(int(rng.integers(1, 4))):
        start = int(rng.integers(0, max(1, n - rate // 4)))
        stop = min(n, start + rate // 4)
        t = np.arange(stop - start, dtype=np.float32) / rate
        signal[start:stop] = 0.3 * np.sin(2 * np.pi * float(rng.uniform(200, 800)) * t)
    out = io.BytesIO()
    if long_clip or rng.random() < 0.3:
        soundfile.write(out, signal, rate, format="FLAC", subtype="PCM_16")
        return "flac", out.getvalue()
    soundfile.write(out, signal, rate, format="WAV", subtype="PCM_U8" if rate == 8000 else "PCM_16")
    return "wav", out.getvalue()


#: Container name -> (FFmpeg muxer, encoder) of the clips `video_clip` writes.
_CLIP_FORMATS = {"mp4": ("mp4", "libx264"), "mov": ("mov", "libx264"),
                 "mkv": ("matroska", "libx264"), "webm": ("webm", "libvpx")}


def video_clip(width: int, height: int, fps: int, num_frames: int, *, seed: int = 0, fmt: str = "mp4") -> bytes:
    """A real `fmt` clip (mp4, mov, mkv: H.264; webm: VP8) of `num_frames` frames at `fps`.

    A colour gradient drifting across the frame: tiny files, real codec headers and frames.
    Encoded single-threaded with fixed settings (x264 keeps its B-frames), so the same
    arguments give the same bytes.
    Needs PyAV (the `[video]` extra). Sides must be even (4:2:0 chroma).
    """
    import av  # optional dependency: only clips need it

    if fmt not in _CLIP_FORMATS:
        raise ValueError(f"clip format {fmt!r} must be one of {', '.join(_CLIP_FORMATS)}")
    if width % 2 or height % 2 or num_frames < 1 or fps < 1:
        raise ValueError(f"clip {width}x{height}, {num_frames} frames at {fps} fps: need even sides, "
                         f">= 1 frame and fps >= 1")
    muxer, codec = _CLIP_FORMATS[fmt]
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=3).astype(np.float32)
    ramp = np.add.outer(np.arange(height), np.arange(width)).astype(np.float32)[..., None]
    out = io.BytesIO()
    # bitexact: no random segment ids or dates in Matroska, no encoder version strings.
    with av.open(out, "w", format=muxer, container_options={"fflags": "+bitexact"}) as container:
        # One thread, and x264 without macroblock-tree rate control and lookahead: with them
        # libx264 gave different bytes for the same frames in about one clip size in ten.
        options = {"threads": "1"} if codec != "libx264" else {
            "threads": "1", "x264-params": "no-mbtree=1:rc-lookahead=0"}
        stream = container.add_stream(codec, rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1
        for i in range(num_frames):
            pixels = (base + ramp * 2 + 8 * i) % 256
            frame = av.VideoFrame.from_ndarray(pixels.astype(np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def _video(rng: np.random.Generator) -> tuple[str, bytes]:
    """A 1-3 s MP4 clip, 64x48 to 160x120, at 4-12 fps."""
    width = 2 * int(rng.integers(32, 81))
    height = 2 * round(width * 3 / 8)
    fps = int(rng.integers(4, 13))
    frames = int(round(float(rng.uniform(1.0, 3.0)) * fps))
    return "mp4", video_clip(width, height, fps, frames, seed=int(rng.integers(1 << 31)))


def make_sample(seed: int, index: int, *, video_share: float = 0.0) -> dict[str, bytes]:
    """The members of sample `index` (suffix -> bytes); depends only on (seed, index, video_share).

    A `video_share` of the samples also get an MP4 clip; drawn last, so the other members of
    every sample are the same whatever the share.
    """
    rng = np.random.default_rng([seed, index])
    kind = list(MIX)[int(rng.choice(len(MIX), p=np.array(list(MIX.values()))))]
    members: dict[str, bytes] = {}
    if kind == "text":
        members.update(_text_members(rng, 4.5))
    else:
        members.update(_text_members(rng, 3.0))
    if kind in ("image+text", "image+audio+text"):
        ext, data = _image(rng)
        members[ext] = data
    elif kind == "multi-image":
        prefix = "img_" if rng.random() < 0.5 else ""
        for i in range(int(rng.integers(2, 7))):
            ext, data = _image(rng)
            members[f"{prefix}{i}.{ext}"] = data
    if kind in ("audio+text", "image+audio+text"):
        ext, data = _audio(rng)
        members[ext] = data
    if rng.random() < 0.3:
        members["cls"] = str(int(rng.integers(0, 1000))).encode()  # payload nobody counts
    if video_share and rng.random() < video_share:
        ext, data = _video(rng)
        members[ext] = data
    return members


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


#: The record gen-data keeps of what it wrote into a directory: {"written_by": WRITTEN_BY,
#: "files": {relative path: size in bytes, or null while being written}}. A later run replaces
#: exactly the files listed at their recorded size and nothing else: a name cannot tell,
#: shard-000000.tar is also the commonest name of a user's own shards.
MANIFEST = "gen-data.json"
WRITTEN_BY = "mmdispatch gen-data"
#: Files beside the shards that gen-data may write, so may not write over unless it wrote them.
_OTHER_OUTPUTS = ("dataset.toml", "tokenizer.json", "tokenizer_config.json")
BLEND_HEADER = "# Written by `mmdispatch gen-data --blend`"


class ForeignFiles(ValueError):
    """An output directory holds shards or other outputs gen-data did not write (`files`)."""

    def __init__(self, message: str, files: list[str]) -> None:
        super().__init__(message)
        self.files = files


def name_some(paths: list[str], limit: int = 3) -> str:
    """The first `limit` paths, and how many more."""
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


def read_manifest(out_dir: str) -> dict[str, int | None] | None:
    """The files gen-data recorded writing into `out_dir` ({} if it recorded none); None if
    a MANIFEST is there that gen-data did not write."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    files = doc.get("files") if isinstance(doc, dict) and doc.get("written_by") == WRITTEN_BY else None
    if not isinstance(files, dict):
        return None
    return files


def record_output(out_dir: str, paths: list[str], *, written: bool = True) -> None:
    """Add `paths` (in `out_dir`) to its MANIFEST, with their sizes once `written`; the
    manifest is replaced whole, so an interrupted run leaves the old one or the new one."""
    files = read_manifest(out_dir) or {}
    files.update({os.path.relpath(p, out_dir): os.path.getsize(p) if written else None for p in paths})
    replace_file(os.path.join(out_dir, MANIFEST),
                 json.dumps({"written_by": WRITTEN_BY, "files": files}, indent=1).encode(),
                 durable=False)


def _outputs_present(out_dir: str) -> list[str]:
    """Files in `out_dir` a gen-data run could write over or mix with its own: shards (at the
    top and in the blend's source directories) and the other outputs."""
    found = []
    for directory in (out_dir, *(os.path.join(out_dir, s) for s in BLEND_SOURCES)):
        if os.path.isdir(directory):
            found += [os.path.join(directory, name) for name in sorted(os.listdir(directory))
                      if name.endswith(SHARD_SUFFIXES) and os.path.isfile(os.path.join(directory, name))]
    return found + [p for p in (os.path.join(out_dir, n) for n in _OTHER_OUTPUTS) if os.path.exists(p)]


def clear_previous_output(out_dir: str) -> list[str]:
    """Remove what an earlier gen-data wrote into `out_dir` (its MANIFEST's files, returned), so
    old shards never mix with new ones; ForeignFiles (a ValueError), removing nothing, if it
    holds shards or other outputs gen-data did not write, or changed since."""
    if not os.path.isdir(out_dir):
        return []
    recorded = read_manifest(out_dir)
    own: list[str] = []
    foreign = [os.path.join(out_dir, MANIFEST)] if recorded is None else []
    for path in _outputs_present(out_dir):
        size = (recorded or {}).get(os.path.relpath(path, out_dir), -1)  # -1: not recorded
        (own if size is None or size == os.path.getsize(path) else foreign).append(path)
    if foreign:
        raise ForeignFiles(f"output directory {out_dir!r} holds files gen-data did not write "
                           f"({name_some(foreign)}; it replaces only those its {MANIFEST} lists): "
                           "move them away, or generate into a new or empty directory, so your "
                           "data and the synthetic shards never mix", foreign)
    for path in own:
        os.remove(path)
    if os.path.exists(os.path.join(out_dir, MANIFEST)):
        os.remove(os.path.join(out_dir, MANIFEST))
    for directory in {os.path.dirname(p) for p in own} - {out_dir}:
        if not os.listdir(directory):  # a blend's source directory it emptied
            os.rmdir(directory)
    return own


def generate(out_dir: str, *, num_samples: int, num_shards: int, seed: int, video_share: float = 0.0) -> list[str]:
    """Write `num_shards` shards `shard-000000.tar`... holding `num_samples` samples in total;
    `video_share` of them (default none) with an MP4 clip (needs PyAV, the `[video]` extra).
    What an earlier run wrote there is replaced (`clear_previous_output`)."""
    if num_shards < 1 or num_samples < num_shards:
        raise ValueError(f"need 1 <= num_shards={num_shards} <= num_samples={num_samples}")
    if not 0.0 <= video_share <= 1.0:
        raise ValueError(f"video_share={video_share} must be in [0, 1]")
    if video_share:
        try:
            import av  # noqa: F401
        except ImportError:
            raise ValueError("--video-share needs PyAV to encode clips: pip install 'mmdispatch[video]'") from None
    clear_previous_output(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    bounds = np.linspace(0, num_samples, num_shards + 1).round().astype(int)
    paths = [os.path.join(out_dir, f"shard-{shard:06d}.tar") for shard in range(num_shards)]
    record_output(out_dir, paths, written=False)  # first, so an interrupted run's are its own
    for shard, path in enumerate(paths):
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for index in range(bounds[shard], bounds[shard + 1]):
                for suffix, data in make_sample(seed, index, video_share=video_share).items():
                    _add(tar, f"{index:08d}.{suffix}", data)
    record_output(out_dir, paths)
    return paths


#: The sources of `--blend`: name -> (blend weight, field map). Field maps name what each
#: source's members are; `cls` members stay unmapped (counted as ignored).
BLEND_SOURCES: dict[str, tuple[float, dict[str, list[str]]]] = {
    "captions": (5.0, {"image": ["jpg", "png"], "text": ["txt"]}),
    "speech": (3.0, {"audio": ["wav", "flac"], "text": ["txt"]}),
    "chat": (2.0, {"image": ["jpg", "png"], "video": ["mp4"], "conversation": ["json"]}),
}


def make_source_sample(source: str, seed: int, index: int) -> dict[str, bytes]:
    """Sample `index` of a `--blend` source (see BLEND_SOURCES); depends only on its arguments.

    captions: one image (sometimes 2-4) and a short caption; speech: a clip and its transcript;
    chat: a conversation (a JSON list of {role, content} turns) with an image or a short clip.
    """
    rng = np.random.default_rng([seed, index, sum(map(ord, source))])
    members: dict[str, bytes] = {}
    if source == "captions":
        count = 1 if rng.random() < 0.85 else int(rng.integers(2, 5))
        for i in range(count):
            ext, data = _image(rng)
            members[ext if count == 1 else f"{i}.{ext}"] = data
        members["txt"] = _text(rng, 2.5).encode()
    elif source == "speech":
        ext, data = _audio(rng)
        members[ext] = data
        members["txt"] = _text(rng, 3.0).encode()
    elif source == "chat":
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": _text(rng, 2.8)}
                 for i in range(2 * int(rng.integers(1, 4)))]
        members["json"] = json.dumps(turns, ensure_ascii=False).encode()
        if rng.random() < 0.5:
            ext, data = _video(rng)
        else:
            ext, data = _image(rng)
        members[ext] = data
    else:
        raise ValueError(f"unknown blend source {source!r}: one of {', '.join(BLEND_SOURCES)}")
    if rng.random() < 0.2:
        members["cls"] = str(int(rng.integers(0, 1000))).encode()  # payload nobody counts
    return members


def _shares(total: int, weights: list[float], most: list[int]) -> list[int]:
    """`total` split by `weights` into whole parts of 1 to most[i] each that add up to it: each
    weight's rounded share, then moved by one where rounding was furthest off (rounding alone
    wrote 3 shards for 2, or 9 for 8)."""
    raw = [total * w / sum(weights) for w in weights]
    parts = [min(most[i], max(1, round(r))) for i, r in enumerate(raw)]
    while sum(parts) > total:
        i = max((i for i in range(len(parts)) if parts[i] > 1), key=lambda i: parts[i] - raw[i])
        parts[i] -= 1
    while sum(parts) < total:
        i = min((i for i in range(len(parts)) if parts[i] < most[i]), key=lambda i: parts[i] - raw[i])
        parts[i] += 1
    return parts


def generate_blend(out_dir: str, *, num_samples: int, num_shards: int, seed: int) -> tuple[str, list[str]]:
    """Write one directory of shards per BLEND_SOURCES source, `num_samples` and `num_shards`
    shared by weight (at least one shard of one sample each), and `dataset.toml` naming them
    with their weights and field maps; returns (dataset file, every shard). Needs PyAV for the
    chat source's clips. What an earlier run wrote there is replaced (`clear_previous_output`)."""
    clear_previous_output(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if not len(BLEND_SOURCES) <= num_shards <= num_samples:
        raise ValueError(f"need {len(BLEND_SOURCES)} <= num_shards={num_shards} <= "
                         f"num_samples={num_samples}: each source gets a shard")
    weights = [w for w, _ in BLEND_SOURCES.values()]
    counts = _shares(num_samples, weights, [num_samples] * len(weights))
    lines = [f"{BLEND_HEADER}: three sources blended by weight.\n"]
    paths: list[str] = []
    dataset = os.path.join(out_dir, "dataset.toml")
    for (name, (weight, fields)), n, k in zip(BLEND_SOURCES.items(), counts,
                                             _shares(num_shards, weights, counts)):
        src_dir = os.path.join(out_dir, name)
        os.makedirs(src_dir, exist_ok=True)
        bounds = np.linspace(0, n, k + 1).round().astype(int)
        shards = [os.path.join(src_dir, f"{shard:06d}.tar") for shard in range(k)]
        record_output(out_dir, shards, written=False)  # first, so an interrupted run's are its own
        for shard, path in enumerate(shards):
            with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
                for index in range(bounds[shard], bounds[shard + 1]):
                    for suffix, data in make_source_sample(name, seed, index).items():
                        _add(tar, f"{name}{index:08d}.{suffix}", data)
        paths += shards
        field_lines = "".join(f"{kind} = {json.dumps(exts)}\n" for kind, exts in fields.items())
        lines.append(f'\n[[sources]]\nname = "{name}"\nshards = "{name}/{{000000..{k - 1:06d}}}.tar"\n'
                     f"weight = {weight}\n[sources.fields]\n{field_lines}")
    record_output(out_dir, [dataset], written=False)
    with open(dataset, "w", encoding="utf-8") as f:
        f.write("".join(lines))
    record_output(out_dir, [*paths, dataset])
    return dataset, paths


#: The trained tokenizer's vocabulary: 256 byte ids, the chat special tokens, then merges.
TOKENIZER_VOCAB_SIZE = 512
#: Special tokens of the generated tokenizer: ChatML's turn markers and an end of text.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _shard_texts(paths: list[str]):
    """The text of every text member of the shards, in shard and member order (a conversation
    member gives each turn's text)."""
    for path in paths:
        with tarfile.open(path) as tar:
            for info in tar:
                name = info.name.rsplit("/", 1)[-1]
                suffix = name[name.find(".") + 1:] if "." in name else ""
                if suffix not in ("txt", "txt.gz", "json", "json.gz"):
                    continue
                data = tar.extractfile(info).read()
                if suffix.endswith(".gz"):
                    data = gzip.decompress(data)
                if suffix.startswith("json"):
                    doc = json.loads(data)
                    turns = doc if isinstance(doc, list) else doc.get("conversations", [])
                    for turn in turns:
                        yield turn.get("value", turn.get("content", ""))
                else:
                    yield data.decode("utf-8")


def write_tokenizer(out_dir: str, paths: list[str], *, vocab_size: int = TOKENIZER_VOCAB_SIZE) -> str:
    """Train a byte-level BPE tokenizer on the shards' texts and write tokenizer.json and
    tokenizer_config.json (ChatML chat template) into `out_dir`; returns tokenizer.json's path.
    Beside gen-data's shards (a MANIFEST in `out_dir`), both are recorded there as its output.

    Deterministic: a fixed corpus order, and the `tokenizers` BPE trainer breaks ties between
    equally frequent pairs by the pair itself, so the same shards give the same file.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pipeline.tokenize import CHATML

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_shard_texts(paths), trainer)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None,
              "model_max_length": 32768, "tokenizer_class": "PreTrainedTokenizerFast"}
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if read_manifest(out_dir):  # beside gen-data's shards: a later run replaces these too
        record_output(out_dir, [path, config_path])
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output directory (created if missing); what an earlier gen-data "
                                    "wrote there (listed in its gen-data.json) is replaced, other "
                                    "shards are refused")
    parser.add_argument("--samples", type=int, default=512, help="number of samples in total")
    parser.add_argument("--shards", type=int, default=8, help="number of shard files")
    parser.add_argument("--seed", type=int, default=0, help="random seed; same seed, same bytes")
    parser.add_argument("--video-share", type=finite_float, default=0.0,
                        help="share of samples that also get a 1-3 s MP4 clip (needs the [video] extra)")
    parser.add_argument("--blend", action="store_true",
                        help="write three sources instead (captions, speech, chat with images and "
                             "clips; samples and shards shared by weight) and dataset.toml naming "
                             "them for `serve --dataset` (needs the [video] extra)")


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.shards <= args.samples:
        raise ValueError(f"--shards {args.shards} and --samples {args.samples}: need at least one "
                         f"shard and at least one sample per shard")
    if args.seed < 0:  # numpy's seeding refuses it later without naming the flag
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if not 0.0 <= args.video_share <= 1.0:
        raise ValueError(f"--video-share must be from 0 to 1 (the share of samples with a clip), "
                         f"got {args.video_share}")
    if args.video_share and args.blend:
        raise ValueError("--video-share applies without --blend; a blend's chat source has its "
                         "own clips")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"output directory {args.out!r} is a file, not a directory: give a "
                         f"directory (created if missing)")
    check_output_dir("output directory", args.out)  # /proc/nope: one line, not a bare errno
    if args.blend and args.shards < len(BLEND_SOURCES):
        raise ValueError(f"--blend writes {len(BLEND_SOURCES)} sources ({', '.join(BLEND_SOURCES)}), "
                         f"each in its own shards: --shards must be >= {len(BLEND_SOURCES)}, got "
                         f"{args.shards}")
    if args.blend:
        try:
            import av  # noqa: F401
        except ImportError:
            raise ValueError("--blend writes video clips and needs PyAV: pip install 'mmdispatch[video]'") from None
        _, paths = generate_blend(args.out, num_samples=args.samples, num_shards=args.shards,
                                  seed=args.seed)
    else:
        paths = generate(args.out, num_samples=args.samples, num_shards=args.shards,
                         seed=args.seed, video_share=args.video_share)
    total = sum(os.path.getsize(p) for p in paths)
    tokenizer = write_tokenizer(args.out, paths)
    say(f"wrote {args.samples} samples in {len(paths)} shards ({total / 1e6:.1f} MB) and their "
        f"tokenizer {tokenizer} to {args.out}", level="INFO")  # JSON under --log-format json
    return 0
