"""Reference training loop under torchrun: dispatcher steps -> encoders -> exchange -> LLM.

What `make demo` and the compose `trainer` service run, and the shortest complete example of
the trainer API. Gradients are summed over micro-batches and ranks and divided by the global
number of target tokens, so the update equals one over the whole global batch however the
dispatcher balanced it (balancing only rearranges samples inside a step).

    torchrun --nproc-per-node 4 -m trainer_client.train --dispatcher tcp://127.0.0.1:5556
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch
import torch.distributed as dist

from trainer_client.client import ClientConfig, DispatcherClient, Microbatch
from trainer_client.dist import RankContext
from trainer_client.exchange import ExchangeConfig, Exchanger
from trainer_client.model import (
    ModelConfig, ReferenceModel, encoder_input, forward_microbatch, text_token_ids,
)

log = logging.getLogger("mmdispatch.train")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer_client.train",
        description="Train the reference multimodal model on micro-batches from an mmdispatch dispatcher "
                    "(run under torchrun; rank and topology come from its environment).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dispatcher", required=True, help="trainer endpoint of the dispatcher, tcp://HOST:PORT")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: until the dispatcher ends)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--hidden", type=int, default=32, help="hidden size of every reference-model tower")
    p.add_argument("--patch-size", type=int, default=14, help="image patch side; match the data nodes' counting")
    p.add_argument("--merge", type=int, default=2, help="patch merge factor; match the data nodes' counting")
    p.add_argument("--exchange", choices=("single", "two_stage"), default="single",
                   help="one world all-to-all, or intra-node then inter-node stages")
    p.add_argument("--commit-every", type=int, default=10, help="commit(step) to the dispatcher every N steps (0: never)")
    p.add_argument("--train-log", default=None, help="rank 0 appends one JSON line per step here (train records)")
    p.add_argument("--prefetch", type=int, default=2, help="steps of credit granted to the dispatcher")
    p.add_argument("--backend", default="gloo", help="torch.distributed backend (gloo on CPU, nccl on GPUs)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed (same on every rank)")
    p.add_argument("--curve-secret", default=None, help="CurveZMQ: this trainer's NAME.key_secret (with --curve-server-key)")
    p.add_argument("--curve-server-key", default=None, help="CurveZMQ: the dispatcher's public NAME.key")
    p.add_argument("--no-map-shards", dest="map_shards", action="store_false",
                   help="reference payloads: copy items out of the shard files instead of mapping them "
                        "(for files that may be truncated while read)")
    return p


class ItemInputs:
    """Encoder inputs and text ids of one micro-batch, decoded from the payloads the rank got."""

    def __init__(self, mb: Microbatch, model: ReferenceModel) -> None:
        self.mb, self.config = mb, model.config
        self.where = {ph: {int(i): k for k, i in enumerate(eb.item_ids.tolist())}
                      for ph, eb in mb.encoders.items()}
        self.sample_pos = {int(s): k for k, s in enumerate(mb.plan.samples.tolist())}

    def item(self, phase: str, item_id: int) -> torch.Tensor:
        eb = self.mb.encoders[phase]
        k = self.where[phase][item_id]
        return encoder_input(self.config, phase, bytes(eb.payloads[k]),
                             enc_len=int(eb.enc_len[k]), llm_len=int(eb.llm_len[k]))

    def text(self, sample_id: int) -> torch.Tensor:
        k = self.sample_pos[sample_id]
        return text_token_ids(self.mb.texts[k], int(self.mb.text_len[k]), self.config.llm.vocab_size)


def train(args: argparse.Namespace) -> int:
    if bool(args.curve_secret) != bool(args.curve_server_key):
        raise ValueError("--curve-secret and --curve-server-key go together")
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    ctx = RankContext.from_process_group()
    torch.manual_seed(args.seed)
    cfg = ModelConfig.tiny(patch_size=args.patch_size, hidden=args.hidden)
    cfg.vision.merge = args.merge
    model = ReferenceModel(cfg)
    for t in model.state_dict().values():
        dist.broadcast(t, 0)  # identical start on every rank, whatever the local RNG did
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    exchanger = Exchanger(ExchangeConfig(mode=args.exchange), ctx)
    client = DispatcherClient(args.dispatcher, ctx.rank, ctx.world_size, ctx.local_world_size,
                              config=ClientConfig(prefetch=args.prefetch, secret_file=args.curve_secret,
                                                  server_public_file=args.curve_server_key,
                                                  map_shards=args.map_shards))
    logf = open(args.train_log, "a", encoding="utf-8") if args.train_log and ctx.rank == 0 else None
    done = 0
    try:
        for step in client:
            t0 = time.perf_counter()
            loss_sum, targets, samples = 0.0, 0, 0
            for mb in step.microbatches:
                inputs = ItemInputs(mb, model)
                out = forward_microbatch(model, mb.plan, item_input=inputs.item, text_ids=inputs.text,
                                         exchanger=exchanger)
                out.loss_sum.backward()
                loss_sum += float(out.loss_sum.detach())
                targets += out.num_targets
                samples += len(mb.keys)
            totals = torch.tensor([loss_sum, float(targets), float(samples)], dtype=torch.float64)
            dist.all_reduce(totals)
            for prm in model.parameters():
                if prm.grad is None:
                    prm.grad = torch.zeros_like(prm)
                dist.all_reduce(prm.grad)
                prm.grad /= max(totals[1].item(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            done += 1
            seconds = time.perf_counter() - t0
            if logf is not None:
                rec = {"kind": "train", "step": step.step, "epoch": step.epoch, "time": time.time(),
                       "loss": totals[0].item() / max(totals[1].item(), 1.0),
                       "samples": int(totals[2].item()), "seconds": seconds,
                       "samples_per_s": totals[2].item() / seconds if seconds > 0 else None,
                       "exchange_bytes_rank0": exchanger.stats.as_dict()}
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
            if args.commit_every and (step.step + 1) % args.commit_every == 0:
                client.commit(step.step)
            if args.steps and done >= args.steps:
                break
    finally:
        client.close()
        if logf is not None:
            logf.close()
        dist.destroy_process_group()
    if ctx.rank == 0:
        log.info("mmdispatch event=train_done steps=%d", done)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return train(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
