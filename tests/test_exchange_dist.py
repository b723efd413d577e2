"""RankContext from torchrun's environment, and the local launcher's failure path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainer_client.dist import INTER_NODE, INTRA_NODE, SAME_RANK, RankContext, run_local_group  # noqa: E402


def test_from_env_reads_torchrun_variables():
    ctx = RankContext.from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size, ctx.node) == (5, 8, 1, 4, 1)
    assert ctx.num_nodes == 2
    assert [ctx.locality(p) for p in (5, 4, 7, 0, 3)] == [SAME_RANK, INTRA_NODE, INTRA_NODE, INTER_NODE, INTER_NODE]


def test_from_env_defaults_and_overrides():
    single = RankContext.from_env({})
    assert (single.rank, single.world_size, single.local_world_size, single.node) == (0, 1, 1, 0)
    one_node = RankContext.from_env({"RANK": "2", "WORLD_SIZE": "4"})
    assert one_node.local_world_size == 4 and one_node.node == 0
    over = RankContext.from_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, local_world_size=2)
    assert (over.node, over.local_rank) == (1, 0)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "rank=4"),
        ({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "local_world_size=4 must divide"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x'"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=0"),
    ],
)
def test_from_env_rejects_inconsistent_layouts(env, match):
    with pytest.raises(ValueError, match=match):
        RankContext.from_env(env)


def _fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("boom from rank one")
    return ctx.rank


def test_local_group_reports_a_failing_rank_with_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*boom from rank one"):
        run_local_group(_fail_on_rank_one, world_size=2, local_world_size=1, timeout_s=60)


def _exit_on_rank_one(ctx, collective: bool):
    import os

    import torch.distributed as dist

    if ctx.rank == 1:
        os._exit(3)  # no traceback, no report: a crash in native code looks the same
    if collective:  # blocked on the rank that is gone: fails, or reports nothing
        dist.all_reduce(torch.ones(1))
    return ctx.rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collective", [False, True])
def test_local_group_says_a_rank_exited_with_its_code_and_keeps_the_others_errors(collective):
    """A rank that exited with code 3 was reported as 'did not report within 60s (exit codes
    {1: 3})' seconds after it exited, and once its peers failed on it, only their first error
    was told: the rank that caused it went unnamed."""
    with pytest.raises(RuntimeError) as raised:
        run_local_group(_exit_on_rank_one, world_size=3, local_world_size=3, args=(collective,),
                        timeout_s=60)
    message = str(raised.value)
    assert message.startswith("rank 1 exited with code 3 before it reported"), message
    assert "did not report" not in message
    if collective:  # its peers' errors (or their silence) are told after it
        assert "rank 0" in message and "rank 2" in message, message


def _sync_gradients(ctx, bucket_bytes: int):
    import trainer_client.dist as tdist

    tdist.GRAD_BUCKET_BYTES = bucket_bytes  # small: several buckets per dtype
    model = torch.nn.ModuleDict({
        "a": torch.nn.Linear(3, 2), "b": torch.nn.Linear(2, 2).to(torch.float64),
        "unused": torch.nn.Linear(2, 2), "frozen": torch.nn.Linear(2, 2)})
    model["frozen"].requires_grad_(False)
    for name in ("a", "b"):
        for p in model[name].parameters():
            p.grad = torch.full_like(p, float(ctx.rank + 1))
    if ctx.rank == 1:  # this rank had no item for it: no gradient, its peers have one
        model["unused"].weight.grad = torch.ones_like(model["unused"].weight)
    tdist.all_reduce_gradients(model, divide_by=2.0)
    return {n: (None if p.grad is None else p.grad.tolist(), str(p.grad.dtype) if p.grad is not None else None)
            for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucket_bytes", [1, 25 * 2**20])
def test_all_reduce_gradients_sums_every_rank_s_gradients_as_ddp_would(bucket_bytes):
    """The loop's gradient sync with forward_microbatch (DDP cannot wrap the model): every
    trainable gradient summed over ranks and divided, one missing on a rank counted as zeros
    (the ranks' collectives stay in step), a frozen parameter left alone, dtypes kept."""
    got = run_local_group(_sync_gradients, world_size=3, local_world_size=3, args=(bucket_bytes,),
                          timeout_s=60)
    assert got[0] == got[1] == got[2]
    grads = got[0]
    assert grads["a.weight"] == ([[3.0] * 3] * 2, "torch.float32")  # (1 + 2 + 3) / 2
    assert grads["b.bias"] == ([3.0, 3.0], "torch.float64")
    assert grads["unused.weight"] == ([[0.5, 0.5]] * 2, "torch.float32")  # rank 1's alone
    assert grads["unused.bias"] == ([0.0, 0.0], "torch.float32")
    assert grads["frozen.weight"] == (None, None)
