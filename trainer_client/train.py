"""Reference training loop under torchrun: dispatcher steps -> encoders -> exchange -> LLM.

What `make demo` and the compose `trainer` service run, and the shortest complete example of
the trainer API. Gradients are summed over micro-batches and ranks and divided by the global
number of target tokens, so the update equals one over the whole global batch however the
dispatcher balanced it (balancing only rearranges samples inside a step).

    torchrun --nproc-per-node 4 -m trainer_client.train --dispatcher tcp://127.0.0.1:5556
"""

from __future__ import annotations

import sys

PROG = "python -m trainer_client.train"

try:  # torch takes seconds to load: a Ctrl-C meanwhile is no bug, and has nothing to unwind
    import argparse
    import io
    import json
    import logging
    import math
    import os
    import time
    from contextlib import nullcontext

    from dispatcher_server.cliopts import interrupt_exits

    with interrupt_exits(PROG) if __name__ == "__main__" else nullcontext():
        import torch
        import torch.distributed as dist

        from dispatcher_server.cliopts import (
            HelpFormatter, OneLineParser, check_curve_pair, check_endpoint, check_malloc_keep_mb,
            check_output_file, run_reporting_errors, say, setup_logging, unwind_on_sigterm,
        )
        from dispatcher_server.files import replace_file
        from mmdispatch.settings import ConfigError, apply_file
        from pipeline.tokenize import load_tokenizer, tokenizer_identity
        from trainer_client.calibrate import PhaseTimer
        from trainer_client.client import ClientConfig, DispatcherClient, Microbatch
        from trainer_client.dist import RankContext, all_reduce_gradients
        from trainer_client.exchange import ExchangeConfig, Exchanger
        from pipeline.preprocess import TEMPORAL_PATCH, audio_row_dim
        from trainer_client.model import (
            ModelConfig, ReferenceModel, microbatch_timings, train_microbatch,
        )
        from trainer_client.options import add_arguments, preprocess_config_from_args
        from trainer_client.prefetch import PrefetchConfig, PrefetchPool
except KeyboardInterrupt:
    print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
    sys.exit(130)

log = logging.getLogger("mmdispatch.train")


class PeerRankStopped(RuntimeError):
    """A collective broke because another rank left mid-step: said in one line (run_reporting_errors)."""


def collective_failed(error: RuntimeError) -> bool:
    """Whether `error` is a collective that broke (a peer rank gone): torch's distributed errors,
    and gloo's, which torch raises as plain RuntimeErrors naming its transport."""
    text = str(error)
    return isinstance(error, dist.DistError) or "gloo/" in text or "Connection closed by peer" in text

CHECKPOINT_FILE = "checkpoint.pt"


def load_checkpoint(directory: str) -> dict | None:
    """The checkpoint `save_checkpoint` left in `directory`, or None when there is none yet."""
    path = os.path.join(directory, CHECKPOINT_FILE)
    if not os.path.exists(path):
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a torn or foreign file: torch raises many types
        raise ValueError(f"checkpoint {path!r} cannot be loaded ({e}): remove it to start "
                         "afresh, or pass another --checkpoint-dir") from None


def save_checkpoint(directory: str, state: dict) -> None:
    """`state` as `directory`/checkpoint.pt, durable when this returns (a commit follows)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    replace_file(os.path.join(directory, CHECKPOINT_FILE), buf.getbuffer())


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Train the reference multimodal model on micro-batches from an mmdispatch dispatcher "
                    "(run under torchrun; rank and topology come from its environment).",
        formatter_class=HelpFormatter,
    )
    add_arguments(p)
    return p


class Progress:
    """Rank 0's progress: steps/s, samples/s and the share of time spent waiting for data.

    A live line on a terminal (rich), else one log line every `every_s` seconds, so a job's
    log shows whether the trainer or the data path is the bottleneck.
    """

    def __init__(self, every_s: float, *, enabled: bool) -> None:
        self.every_s, self.enabled = every_s, enabled
        self.start = self.last = time.perf_counter()
        self.steps = self.samples = 0
        self.step: int | None = None  # the dispatcher's number of the last step trained
        self.wait_s = 0.0
        self.live = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress as Bar, TextColumn, TimeElapsedColumn

            self.live = Bar(TextColumn("[bold]train[/] {task.fields[line]}"), TimeElapsedColumn(),
                            console=Console(stderr=True))
            self.live.start()
            self.task = self.live.add_task("train", line="waiting for the first step")

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        where = f"step {self.step} ({self.steps} this run)" if self.step is not None else f"step {self.steps}"
        return (f"{where} | {self.steps / elapsed:.2f} steps/s | "
                f"{self.samples / elapsed:.1f} samples/s | data wait {100 * self.wait_s / elapsed:.0f}%")

    def update(self, samples: int, wait_s: float, step: int | None = None) -> None:
        if not self.enabled:
            return
        self.steps += 1
        self.step = step
        self.samples += samples
        self.wait_s += wait_s
        now = time.perf_counter()
        if self.live is not None:
            self.live.update(self.task, line=self.line())
        elif self.every_s > 0 and now - self.last >= self.every_s:
            self.last = now
            elapsed = max(now - self.start, 1e-9)
            # fields, so a JSON log has them as keys (the rich line above is for a terminal)
            log.info("mmdispatch event=train_progress step=%s steps_this_run=%d steps_per_s=%.2f "
                     "samples_per_s=%.1f data_wait_pct=%.0f",
                     self.step if self.step is not None else self.steps, self.steps,
                     self.steps / elapsed, self.samples / elapsed, 100 * self.wait_s / elapsed)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


class ItemInputs:
    """Text ids and loss masks of one micro-batch, as the rank received them (its encoder
    inputs come ready from the PrefetchPool)."""

    def __init__(self, mb: Microbatch, model: ReferenceModel) -> None:
        self.mb, self.config = mb, model.config
        self.sample_pos = {int(s): k for k, s in enumerate(mb.plan.samples.tolist())}

    def text(self, sample_id: int) -> torch.Tensor:
        """The data node's token ids, checked against the plan and the model's vocabulary."""
        k = self.sample_pos[sample_id]
        ids, vocab = self.mb.text_ids[k], self.config.llm.vocab_size
        if ids.numel() != int(self.mb.text_len[k]):
            raise ValueError(f"sample {self.mb.keys[k]!r}: {ids.numel()} text ids but the plan has "
                             f"{int(self.mb.text_len[k])}")
        if ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            raise ValueError(f"sample {self.mb.keys[k]!r}: token id {int(ids.max())} is outside the "
                             f"model's vocabulary of {vocab}: give the trainer the data nodes' "
                             f"--tokenizer (the [counting] table)")
        return ids

    def mask(self, sample_id: int) -> torch.Tensor:
        return self.mb.loss_mask[self.sample_pos[sample_id]]


def _check_backend(backend: str) -> None:
    """ValueError naming --backend when this torch lacks it: init_process_group would fail with
    an assertion or a build error that names neither the flag nor the way out."""
    # "cpu:gloo,cuda:nccl" gives a backend per device
    parts = [part.partition(":") if ":" in part else ("", "", part) for part in backend.split(",")]
    names = [name.strip() for _, _, name in parts]
    cpu = next((name.strip() for device, _, name in parts if device.strip() in ("", "cpu")), None)
    if cpu in (None, "nccl"):
        # Its collectives carry the CPU model's gradients and loss totals: NCCL fails on them.
        raise ValueError(f"--backend {backend!r}: the reference trainer runs its model on CPU, and "
                         "NCCL carries GPU tensors only; use --backend gloo (the default). On GPUs, "
                         "train your model in your own loop with the client (README, Trainer API)")
    if "nccl" in names and not torch.cuda.is_available():
        raise ValueError(f"--backend {backend!r}: NCCL needs GPUs and this machine has none "
                         "(torch.cuda.is_available() is False); use --backend gloo")
    missing = [n for n in names if not n or not dist.is_backend_available(n)]
    if missing:
        here = [b for b in dist.Backend.backend_list
                if b not in ("undefined", "fake") and dist.is_backend_available(b)]
        raise ValueError(f"--backend {backend!r}: this torch has no {missing[0]!r} backend (it has "
                         f"{', '.join(here) or 'none'}); use --backend gloo")


#: what torchrun sets for every rank; env:// initialisation needs the first four
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _check_launched_by_torchrun() -> None:
    missing = [v for v in TORCHRUN_VARIABLES[:4] if v not in os.environ]
    if missing:
        raise ValueError(f"environment variable {missing[0]} is not set: launch the trainer under "
                         f"torchrun (torchrun --nproc-per-node N -m trainer_client.train ...) or set "
                         f"{', '.join(TORCHRUN_VARIABLES)}")


def client_config(args: argparse.Namespace) -> ClientConfig:
    """The trainer's client settings from its options (the heap setting included: the client
    applies it once in this process when it starts)."""
    timeouts = {} if args.connect_timeout is None else {"connect_timeout_s": args.connect_timeout}
    return ClientConfig(prefetch=args.prefetch, secret_file=args.curve_secret,
                        server_public_file=args.curve_server_key, map_shards=args.map_shards,
                        malloc_keep_mb=args.malloc_keep_mb, **timeouts)


def train(args: argparse.Namespace) -> int:
    check_endpoint("--dispatcher", args.dispatcher, connect=True)
    check_curve_pair(args.curve_secret, args.curve_server_key)
    if args.train_log:
        check_output_file("--train-log", args.train_log)
    if args.connect_timeout is not None and args.connect_timeout <= 0:
        raise ValueError(f"--connect-timeout must be > 0 seconds, got {args.connect_timeout}")
    for flag, value, least, meaning in (("--steps", args.steps, 0, "0: until the dispatcher ends"),
                                        ("--commit-every", args.commit_every, 0, "0: never"),
                                        ("--prefetch", args.prefetch, 1, "steps of credit"),
                                        ("--hidden", args.hidden, 1, "the model's hidden size"),
                                        ("--preprocess-ahead", args.preprocess_ahead, 1, "micro-batches"),
                                        ("--preprocess-workers", args.preprocess_workers, 0,
                                         "0: inside the loop"),
                                        ("--progress-every", args.progress_every, 0, "seconds; 0: none")):
        if value < least:
            raise ValueError(f"{flag} must be >= {least} ({meaning}), got {value}")
    from dispatcher_server.protocol import MAX_AHEAD, MAX_PREFETCH

    # the dispatcher refuses a HELLO asking for more (prefetch, and the pool's ahead + 1)
    for flag, value, most in (("--prefetch", args.prefetch, MAX_PREFETCH),
                              ("--preprocess-ahead", args.preprocess_ahead, MAX_AHEAD - 1)):
        if value > most:
            raise ValueError(f"{flag} must be at most {most}, got {value}")
    towers = ModelConfig.tiny(hidden=args.hidden)
    heads = math.lcm(*(t.num_heads for t in (towers.vision, towers.audio, towers.llm)))
    if args.hidden % heads:  # said here, not by every rank's model after torchrun started
        raise ValueError(f"--hidden must be a multiple of {heads} (the reference model's "
                         f"attention heads per tower), got {args.hidden}")
    check_malloc_keep_mb("--malloc-keep-mb", args.malloc_keep_mb)
    if args.lr <= 0:
        raise ValueError(f"--lr must be > 0 (the AdamW learning rate, e.g. 3e-3), got {args.lr}")
    if args.checkpoint_dir is not None:
        if os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
            raise ValueError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file: pass a directory")
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        checkpoint = load_checkpoint(args.checkpoint_dir)
    else:
        checkpoint = None
    _check_backend(args.backend)
    vocab_size = load_tokenizer(args.tokenizer).vocab_size  # the ids readers send
    # checked before joining the process group: a bad value is one line, not a hung world
    preprocess = preprocess_config_from_args(args)
    frame_dim = audio_row_dim(preprocess.audio)
    prefetch = PrefetchConfig(ahead=args.preprocess_ahead, workers=args.preprocess_workers,
                              kind=args.preprocess_pool, preprocess=preprocess,
                              errors=args.preprocess_errors)
    torch.set_num_threads(1)
    _check_launched_by_torchrun()
    dist.init_process_group(args.backend)
    ctx = RankContext.from_process_group()
    torch.manual_seed(args.seed)
    cfg = ModelConfig.tiny(patch_size=args.patch_size, hidden=args.hidden, merge=args.merge_size,
                           temporal_patch=TEMPORAL_PATCH, frame_dim=frame_dim, vocab_size=vocab_size)
    model = ReferenceModel(cfg)
    for t in model.state_dict().values():
        dist.broadcast(t, 0)  # identical start on every rank, whatever the local RNG did
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    exchanger = Exchanger(ExchangeConfig(mode=args.exchange), ctx)
    timer = PhaseTimer("cpu")  # the reference model runs on CPU
    client = DispatcherClient(args.dispatcher, ctx.rank, ctx.world_size, ctx.local_world_size,
                              config=client_config(args),
                              inputs={**preprocess.identity(), **tokenizer_identity(args.tokenizer)})
    if checkpoint is not None:  # every rank loads the one file: all resume at one step
        try:
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
        except (KeyError, RuntimeError, ValueError) as e:  # torch says which tensors differ
            client.close()
            detail = " ".join(str(e).split())
            raise ValueError(
                f"checkpoint in --checkpoint-dir {args.checkpoint_dir!r} was saved for another "
                f"model ({detail[:300]}): resume with the flags it was saved with (--hidden, "
                "--tokenizer, --patch-size, --audio-frames-per-s...), or pass a new "
                "--checkpoint-dir") from None
        client.load_state_dict(checkpoint["data"])
        if ctx.rank == 0:
            log.info("mmdispatch event=train_resumed step=%d checkpoint=%s",
                     checkpoint["data"]["next_step"], args.checkpoint_dir)
    pool = PrefetchPool(client, prefetch)
    logf = open(args.train_log, "a", encoding="utf-8") if args.train_log and ctx.rank == 0 else None
    progress = Progress(args.progress_every, enabled=ctx.rank == 0)
    done = 0
    try:
        steps = iter(pool)  # model inputs prepared ahead, off this loop
        while True:
            t_wait = time.perf_counter()
            step = next(steps, None)
            if step is None:
                break
            t0 = time.perf_counter()
            loss_sum, targets, samples = 0.0, 0, 0
            measured = []
            for mb in step.microbatches:
                inputs = ItemInputs(mb, model)
                timer.reset()
                out = train_microbatch(model, mb.plan, item_input=mb.inputs.item, item_name=mb.inputs.name,
                                       text_ids=inputs.text, loss_mask=inputs.mask,
                                       exchanger=exchanger, timer=timer)
                measured.append(microbatch_timings(mb.plan, timer.seconds()))
                loss_sum += float(out.loss_sum)
                targets += out.num_targets
                samples += len(mb.keys)
            totals = torch.tensor([loss_sum, float(targets), float(samples)], dtype=torch.float64)
            dist.all_reduce(totals)
            all_reduce_gradients(model, divide_by=max(totals[1].item(), 1.0))
            opt.step()
            opt.zero_grad(set_to_none=True)
            client.report_timings(step.step, measured)  # predicted vs measured, per phase
            done += 1
            seconds = time.perf_counter() - t0
            progress.update(int(totals[2].item()), t0 - t_wait, step.step)
            if logf is not None:
                rec = {"kind": "train", "step": step.step, "epoch": step.epoch, "time": time.time(),
                       "loss": totals[0].item() / max(totals[1].item(), 1.0),
                       "samples": int(totals[2].item()), "seconds": seconds, "data_wait_s": t0 - t_wait,
                       "samples_per_s": totals[2].item() / seconds if seconds > 0 else None,
                       "exchange_bytes_rank0": exchanger.stats.as_dict()}  # this step's
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
            exchanger.stats.reset()  # counted per step: the log's records are per step
            if args.commit_every and (step.step + 1) % args.commit_every == 0:
                # The commit lets the dispatcher forget the steps before: it follows the
                # checkpoint that resumes after them, once that is durable.
                if args.checkpoint_dir is None:
                    client.commit(step.step)
                elif ctx.rank == 0:
                    save_checkpoint(args.checkpoint_dir, {
                        "model": model.state_dict(), "optimizer": opt.state_dict(),
                        "data": pool.state_dict()})
                    client.commit(step.step)
            if args.steps and done >= args.steps:
                break
    except RuntimeError as e:
        if not collective_failed(e):
            raise
        # A peer rank left mid-step (it stopped on its own error, e.g. no dispatcher to answer
        # it): this rank's collective breaks with gloo's or NCCL's traceback, which reads as a
        # crash in the exchange.
        raise PeerRankStopped(f"rank {ctx.rank}: a collective with the other ranks failed after "
                              f"{done} step(s): a peer rank stopped; its own log says why "
                              f"({' '.join(str(e).split())[:200]})") from None
    finally:
        progress.close()
        client.close()  # first: a pool's feeder waiting on it for a step stops at once; its BYE
        pool.close()  # says where the loop stopped (the pool's position), whichever closes first
        if logf is not None:
            logf.close()
        dist.destroy_process_group()
    if ctx.rank == 0:
        log.info("mmdispatch event=train_done steps=%d", done)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # reading --config and parsing come before run_reporting_errors
        return _main(argv)
    except KeyboardInterrupt:
        say(f"{PROG}: interrupted")
        return 130


def _main(argv: list[str]) -> int:
    with interrupt_exits(PROG):
        parser = build_parser()
        try:
            apply_file(parser, "train", argv)
        except ConfigError as e:
            parser.refuse(argv, str(e))
        args = parser.parse_args(argv)
        setup_logging(args.log_format, args.log_level)
    # torchrun, Kubernetes and compose stop a trainer with SIGTERM: unwind the loop, so the
    # client says BYE (the dispatcher moves on at once, not after its timeout) and the process
    # group ends, instead of dying where the signal found it.
    unwind_on_sigterm("mmdispatch event=train_stopped signal=SIGTERM")
    return run_reporting_errors(lambda: train(args), parser.prog, debug=args.debug,
                                args=args)


if __name__ == "__main__":
    sys.exit(main())
