"""Sharded data parallelism (FSDP2, `fully_shard` via `trainer_client.dist.shard_model`) with
`forward_microbatch` and `train_microbatch`, on gloo CPU ranks.

The claim under test: training the reference model a few steps on a balanced plan, sharded,
gives the parameters and gradients of the replicated loop (`all_reduce_gradients`) on the same
data, with micro-batches where a rank encodes no image and no audio, or has no sample at all
(FSDP's all-gathers and reduce-scatters are collectives: every rank must make the same ones,
or the world hangs or sums the wrong tensors).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dispatcher_server.planner.cost import CostModel  # noqa: E402
from dispatcher_server.planner.plan import StepPlan  # noqa: E402
from dispatcher_server.planner.types import ENCODER_PHASES, Topology  # noqa: E402
from trainer_client.dist import run_local_group  # noqa: E402

from tests.test_exchange import make_inputs  # noqa: E402

PATCH, FRAME_DIM, VOCAB, HIDDEN = 4, 16, 97, 16
#: the two paths sum the same gradients in another order (measured: 4e-15 and 5e-6 on the
#: parameters after the steps; float32 as tests/test_exchange.py's F32_REL_TOL)
REL_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}


def uneven_plan(world_size: int, seed: int) -> StepPlan:
    """Two micro-batches: in the first the last rank encodes no image and no audio (it still
    runs the LLM for its samples); in the second rank 0 has no sample and encodes nothing."""
    inputs = make_inputs(seed, 4 * world_size, zero_items=True)
    rng = np.random.default_rng(seed)
    S, W = inputs.num_samples, world_size
    sample_mb = np.arange(S) % 2
    sample_rank = np.where(sample_mb == 0, rng.integers(0, W, S), rng.integers(1, W, S))
    item_rank = {}
    for p in ENCODER_PHASES:
        mb = sample_mb[inputs.items(p).sample]
        item_rank[p] = np.where(mb == 0, rng.integers(0, W - 1, len(mb)), rng.integers(1, W, len(mb)))
    return StepPlan(inputs=inputs, topology=Topology(world_size=W, ranks_per_node=W), num_microbatches=2,
                    sample_mb=sample_mb, sample_rank=sample_rank, item_rank=item_rank, cost=CostModel(),
                    bytes_per_token=dict.fromkeys(ENCODER_PHASES, HIDDEN * 8))


def _model(dtype):
    from trainer_client.model import ModelConfig, ReferenceModel

    torch.manual_seed(1234)
    return ReferenceModel(ModelConfig.tiny(patch_size=PATCH, frame_dim=FRAME_DIM, vocab_size=VOCAB,
                                           hidden=HIDDEN)).to(dtype)


def _full(t):
    from torch.distributed.tensor import DTensor

    t = t.full_tensor() if isinstance(t, DTensor) else t  # a collective: every rank calls it
    return t.detach().numpy().copy()


def _train(ctx, plan: StepPlan, sharded: bool, staged: bool, steps: int, dtype) -> dict:
    """`steps` optimizer steps of the reference loop (train.py's), replicated or sharded."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainer_client.dist import all_reduce_gradients, shard_model
    from trainer_client.exchange import Exchanger
    from trainer_client.model import forward_microbatch, synthetic_features, synthetic_text_ids, train_microbatch

    model = _model(dtype)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh

        shard_model(model, init_device_mesh("cpu", (ctx.world_size,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    exchanger = Exchanger(ctx=ctx)
    dims = {"vision": 3 * PATCH**2, "audio": FRAME_DIM}
    enc_len = {p: plan.inputs.items(p).enc_len for p in ENCODER_PHASES}
    out: dict = {"loss": [], "grads": None, "encoded": []}
    for step in range(steps):
        seed = 100 + step  # new data every step, one plan

        def item_input(phase, item):
            return synthetic_features(seed, phase, item, int(enc_len[phase][item]), dims[phase], dtype)

        def text_ids(sample):
            return synthetic_text_ids(seed, sample, int(plan.inputs.text_len[sample]), VOCAB)

        loss_sum, targets = 0.0, 0
        for mb in range(plan.num_microbatches):
            rmb = plan.rank_microbatch(ctx.rank, mb)
            out["encoded"].append({p: len(px.encode_items) for p, px in rmb.exchanges.items()}
                                  | {"samples": len(rmb.samples)})
            if staged:
                o = train_microbatch(model, rmb, item_input=item_input, text_ids=text_ids, exchanger=exchanger)
            else:
                o = forward_microbatch(model, rmb, item_input=item_input, text_ids=text_ids, exchanger=exchanger)
                o.loss_sum.backward()
            loss_sum += float(o.loss_sum.detach())
            targets += o.num_targets
        totals = torch.tensor([loss_sum, float(targets)], dtype=torch.float64)  # not a parameter's dtype
        dist.all_reduce(totals)
        all_reduce_gradients(model, divide_by=totals[1].item())
        out["loss"].append(totals[0].item() / totals[1].item())
        if step == 0:
            out["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    out["sharded_params"] = sum(isinstance(p, DTensor) for p in model.parameters())
    return out


def _compare(ctx, plan: StepPlan, modes: tuple[str, ...], steps: int, dtype) -> dict:
    """The replicated loop once, then the sharded one per mode: `train_microbatch`'s gradients
    are `forward_microbatch`'s (tests/test_exchange.py), so one replicated run serves both."""
    out = {"replicated": _train(ctx, plan, sharded=False, staged=True, steps=steps, dtype=dtype)}
    for mode in modes:
        out[mode] = _train(ctx, plan, sharded=True, staged=mode == "train_microbatch", steps=steps,
                           dtype=dtype)
    out["dtype"] = dtype
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / den) if den > 0 else float(np.linalg.norm(a))


def _check(results: list[dict], mode: str) -> None:
    for rank, r in enumerate(results):
        rep, sh, tol = r["replicated"], r[mode], REL_TOL[r["dtype"]]
        assert sh["sharded_params"] == len(sh["params"]) > 0  # every parameter really sharded
        assert rep["sharded_params"] == 0
        np.testing.assert_allclose(sh["loss"], rep["loss"], rtol=tol)
        assert set(sh["grads"]) == set(rep["grads"])
        for name in rep["grads"]:
            assert _rel(sh["grads"][name], rep["grads"][name]) <= tol, f"rank {rank} grad {name}"
            assert _rel(sh["params"][name], rep["params"][name]) <= tol, f"rank {rank} param {name}"
        # the encoders were trained through the exchange, not vacuously equal
        for name in ("patch_embed.weight", "frame_embed.weight", "audio_blocks.0.qkv.weight",
                     "vision_blocks.0.qkv.weight"):
            assert np.abs(sh["grads"][name]).sum() > 0, name
    # the plan really has ranks with nothing of a phase while their peers have some
    enc = [r[mode]["encoded"] for r in results]
    for k in range(len(enc[0])):
        for what in ("vision", "audio", "samples"):
            counts = [e[k][what] for e in enc]
            if k % 2 == 0 and what != "samples":
                assert counts[-1] == 0 and sum(counts) > 0, (k, what, counts)
            if k % 2 == 1:
                assert counts[0] == 0 and sum(counts) > 0, (k, what, counts)


MODES = ("forward_microbatch", "train_microbatch")


@pytest.fixture(scope="module")
def two_ranks():
    return run_local_group(_compare, world_size=2, local_world_size=2,
                           args=(uneven_plan(2, 3), MODES, 3, torch.float64), timeout_s=30)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_sharded_training_matches_the_replicated_loop_on_two_ranks(two_ranks, mode):
    """A rank that encodes no image and no audio, one with no sample: the collectives of
    FSDP stayed in step (else gloo times out) and the result is the replicated loop's."""
    _check(two_ranks, mode)


@pytest.mark.timeout(120)
def test_sharded_training_matches_the_replicated_loop_on_four_ranks():
    """float32, where FSDP would divide with PREMUL_SUM, which gloo lacks (shard_model sums)."""
    results = run_local_group(_compare, world_size=4, local_world_size=4,
                              args=(uneven_plan(4, 5), ("train_microbatch",), 2, torch.float32), timeout_s=30)
    _check(results, "train_microbatch")
