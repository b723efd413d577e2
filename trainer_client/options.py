"""Options of the reference training loop (`python -m trainer_client.train`), free of torch.

Kept apart from the loop so `mmdispatch` can validate a `[train]` table (and generate the
configuration reference) on a data node that has no torch. The counting rules the model inputs
must match (patch size, merge, pixel budget, audio rates, video sampling, the tokenizer) sit in
the file's shared `[counting]` table, as the data nodes read them: the model's vocabulary is the
tokenizer's (byte-level without one: 256 ids).
"""

from __future__ import annotations

import argparse

from dispatcher_server.cliopts import add_config_argument, add_logging_arguments, finite_float
from pipeline.counting import AudioConfig, ImageConfig
from pipeline.preprocess import PreprocessConfig, mel_stride
from pipeline.reader import counting_flag_errors
from pipeline.video import VideoConfig, video_config

#: The reference model's hidden size unless --hidden says otherwise (its towers' outputs,
#: float32 on the exchange: 4 bytes each).
DEFAULT_HIDDEN = 32

#: Preprocessing pool kinds and error modes of `trainer_client.prefetch.PrefetchConfig` (kept
#: here, free of torch, for the CLI).
POOL_KINDS = ("thread", "process")
ERROR_MODES = ("warn", "raise")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    image, audio, video = ImageConfig(), AudioConfig(), VideoConfig()
    add = parser.add_argument
    add_config_argument(parser)
    add("--dispatcher", required=True, help="trainer endpoint of the dispatcher, tcp://HOST:PORT")
    add("--connect-timeout", type=finite_float, default=None,
        help="seconds to keep trying to reach the dispatcher before failing with its address "
             "(default: 60)")
    add("--steps", type=int, default=0,
        help="stop after this many steps of this run, a resumed one too (0: until the dispatcher ends)")
    add("--lr", type=finite_float, default=3e-3, help="AdamW learning rate")
    add("--hidden", type=int, default=DEFAULT_HIDDEN, help="hidden size of every reference-model tower (a "
        "multiple of its 2 attention heads)")
    add("--exchange", choices=("single", "two_stage"), default="single",
        help="one world all-to-all, or intra-node then inter-node stages")
    add("--commit-every", type=int, default=10,
        help="every N steps: rank 0 writes the checkpoint (with --checkpoint-dir), then commit(step) "
             "to the dispatcher (0: never)")
    add("--checkpoint-dir", default=None,
        help="the model, optimizer and data position are saved here (checkpoint.pt, by rank 0 "
             "before each commit) and every rank resumes from it at start when present: a "
             "directory every rank can read")
    add("--train-log", default=None, help="rank 0 appends one JSON line per step here (train records)")
    add("--prefetch", type=int, default=2, help="steps of credit granted to the dispatcher")
    add("--backend", default="gloo",
        help="torch.distributed backend for the reference model, which runs on CPU: gloo (or a "
             "per-device spec with cpu:gloo)")
    add("--seed", type=int, default=0, help="model initialisation seed (same on every rank)")
    add("--curve-secret", default=None, help="CurveZMQ: this trainer's NAME.key_secret (with --curve-server-key)")
    add("--curve-server-key", default=None, help="CurveZMQ: the dispatcher's public NAME.key")
    add("--map-shards", action=argparse.BooleanOptionalAction, default=True,
        help="reference payloads: map the shard files; --no-map-shards copies items out of them "
             "(for files that may be truncated while read)")
    add("--malloc-keep-mb", type=int, default=0,
        help="reuse freed heap blocks up to this many MiB instead of fresh pages (glibc; set once "
             "per trainer process); 0 = off, glibc's own thresholds. Off, a long run's RSS can "
             "creep as glibc keeps freed tensor memory; a small value holds it flat but maps "
             "every larger tensor afresh (1: flat, steps ~1.2x as long in the reference trainer)")
    add("--preprocess-ahead", type=int, default=4,
        help="micro-batches whose model inputs (image patches, audio log-mels) are prepared "
             "beyond the step being trained")
    add("--preprocess-workers", type=int, default=2,
        help="workers preparing model inputs off the training loop (0: inside the loop)")
    add("--preprocess-pool", choices=POOL_KINDS, default="thread",
        help="worker kind; threads measured faster on 2 cores (bench.feed)")
    add("--preprocess-errors", choices=ERROR_MODES, default="warn",
        help="an item whose payload does not decode: warn (log it and train on a blank input of "
             "its planned rows, as every rank's shapes need) or raise (stop the loop)")
    add("--progress-every", type=finite_float, default=10.0,
        help="seconds between rank 0's progress lines when stderr is not a terminal (0: none)")
    counting = parser.add_argument_group("counting (the [counting] table; match the data nodes)")
    counting.add_argument("--patch-size", type=int, default=image.patch_size, help="vision patch side in pixels")
    counting.add_argument("--merge-size", "--merge", type=int, default=image.merge_size,
                          help="patches merged per side into one LLM token")
    counting.add_argument("--tokenizer", default=None,
                          help="the data nodes' HF tokenizers JSON file; the model's vocabulary "
                               "is its size (unset: the byte-level ids, 256)")
    counting.add_argument("--min-pixels", type=int, default=image.min_pixels, help="image resize lower pixel budget")
    counting.add_argument("--max-pixels", type=int, default=image.max_pixels, help="image resize upper pixel budget")
    counting.add_argument("--audio-frames-per-s", type=finite_float, default=audio.encoder_frames_per_s,
                          help="audio encoder frames per second (100/k: mel frames are 10 ms)")
    counting.add_argument("--audio-tokens-per-s", type=finite_float, default=audio.llm_tokens_per_s,
                          help="audio LLM tokens per second; a whole divisor of the frame rate pools the frames (50 / 25: floor(frames / 2), as Qwen2-Audio)")
    counting.add_argument("--audio-pad-window", type=finite_float, default=None,
                          help="audio encoder padded to windows of this many seconds "
                               "(default: unset, no padding)")
    counting.add_argument("--video-fps", type=finite_float, default=video.fps,
                          help="video frames sampled per second")
    counting.add_argument("--video-min-frames", type=int, default=video.min_frames,
                          help="fewest video frames sampled of a clip that holds them (qwen_vl_utils' "
                               "min_frames)")
    counting.add_argument("--video-max-pixels", type=int, default=video.max_pixels,
                          help="video resize upper pixel budget per frame")
    add_logging_arguments(parser)


def preprocess_config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    """The counting rules the trainer's model inputs must match, from the counting options; a
    value out of range is a ValueError naming its flag."""
    with counting_flag_errors():
        config = _preprocess_config(args)
        mel_stride(config.audio)  # the trainer always builds audio rows: refused now, by flag
    return config


def _preprocess_config(args: argparse.Namespace) -> PreprocessConfig:
    return PreprocessConfig(
        image=ImageConfig(patch_size=args.patch_size, merge_size=args.merge_size,
                          min_pixels=args.min_pixels, max_pixels=args.max_pixels),
        audio=AudioConfig(encoder_frames_per_s=args.audio_frames_per_s,
                          llm_tokens_per_s=args.audio_tokens_per_s, pad_window_s=args.audio_pad_window),
        video=video_config(fps=args.video_fps, min_frames=args.video_min_frames,
                           max_pixels=args.video_max_pixels, patch_size=args.patch_size,
                           merge_size=args.merge_size),
    )
