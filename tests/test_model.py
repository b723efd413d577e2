"""Single-process tests of the reference model, packing, labels and the item-input helpers."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dispatcher_server.planner import PlannerConfig, Topology, plan_step  # noqa: E402
from trainer_client.exchange import pack_llm_inputs  # noqa: E402
from trainer_client.model import (  # noqa: E402
    IGNORE_INDEX, ModelConfig, MultimodalModel, ReferenceModel, audio_frames, encoder_input, image_patches,
    packed_labels, synthetic_features, synthetic_text_ids,
)

from tests.test_exchange import make_inputs  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ReferenceModel(ModelConfig.tiny()).to(torch.float64)


def test_reference_model_satisfies_the_protocol(model):
    assert isinstance(model, MultimodalModel)
    assert model.hidden_size == 16


def test_encoders_emit_llm_len_tokens_and_keep_items_independent(model):
    a = synthetic_features(0, "vision", 0, 8, 48, torch.float64)
    b = synthetic_features(0, "vision", 1, 16, 48, torch.float64)
    both = model.encode_vision([a, b], [2, 4])
    assert both.shape == (6, 16)
    # an item's embedding must not depend on what else is in the batch
    torch.testing.assert_close(both[:2], model.encode_vision([a], [2]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(both[2:], model.encode_vision([b], [4]), rtol=1e-12, atol=1e-12)
    c = synthetic_features(0, "audio", 0, 13, 16, torch.float64)
    out = model.encode_audio([c, c[:0], c[:5]], [4, 0, 2])
    assert out.shape == (6, 16)
    torch.testing.assert_close(out[4:], model.encode_audio([c[:5]], [2]), rtol=1e-12, atol=1e-12)
    empty = model.encode_vision([], [])
    assert empty.shape == (0, 16) and empty.requires_grad  # stays in the graph for backward


def test_encoder_count_mismatches_raise(model):
    with pytest.raises(ValueError, match="multiple of merge"):
        model.encode_vision([torch.zeros(6, 48, dtype=torch.float64)], [1])
    with pytest.raises(ValueError, match="llm_len=3"):
        model.encode_vision([torch.zeros(8, 48, dtype=torch.float64)], [3])
    with pytest.raises(ValueError, match="expected"):
        model.encode_vision([torch.zeros(8, 47, dtype=torch.float64)], [2])
    with pytest.raises(ValueError, match="0 frames"):
        model.encode_audio([torch.zeros(0, 16, dtype=torch.float64)], [1])


def test_llm_sequences_attend_only_to_themselves(model):
    x = synthetic_features(1, "llm", 0, 11, 16, torch.float64)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    pos = torch.cat([torch.arange(4), torch.arange(7)])
    packed = model.llm(x, cu, pos).logits
    alone = model.llm(x[4:], torch.tensor([0, 7], dtype=torch.int32), torch.arange(7)).logits
    torch.testing.assert_close(packed[4:], alone, rtol=1e-12, atol=1e-12)
    # causal: changing a later token leaves earlier logits alone
    y = x.clone()
    y[9] += torch.linspace(-1.0, 1.0, 16, dtype=torch.float64)  # a constant shift would be normed away
    changed = model.llm(y, cu, pos).logits
    torch.testing.assert_close(changed[:9], packed[:9], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(changed[9:], packed[9:])
    with pytest.raises(ValueError, match="cu_seqlens"):
        model.llm(x, torch.tensor([0, 4, 10], dtype=torch.int32), pos)


def test_pack_places_rows_at_planned_offsets_and_labels_follow_text():
    inputs = make_inputs(11, 10)
    plan = plan_step(inputs, Topology(world_size=2, ranks_per_node=1), PlannerConfig(num_microbatches=2))
    seen_samples = 0
    for rank in range(2):
        for mb in range(2):
            rmb = plan.rank_microbatch(rank, mb)
            seen_samples += len(rmb.samples)
            # value of a row = (tag, item/sample id, row within it): checkable after the gather
            text = torch.cat([torch.tensor([[0.0, s, j] for j in range(int(n))]).reshape(-1, 3)
                              for s, n in zip(rmb.samples, rmb.text_len)] + [torch.zeros(0, 3)])
            got = {p: torch.cat([torch.tensor([[1.0 + k, i, j] for j in range(int(n))]).reshape(-1, 3)
                                 for i, n in zip(px.recv_items, px.recv_llm_len)] + [torch.zeros(0, 3)])
                   for k, (p, px) in enumerate(rmb.exchanges.items())}
            packed, cu, pos = pack_llm_inputs(rmb, text, got)
            assert packed.shape == (rmb.total_len, 3)
            assert cu.tolist() == rmb.cu_seqlens.tolist()
            for i, s in enumerate(rmb.samples):
                a, b = int(cu[i]), int(cu[i + 1])
                assert pos[a:b].tolist() == list(range(b - a))
                seq = packed[a:b]
                # layout: vision items, audio items (item order), then the sample's text
                want = [(1.0, int(it), j) for it in np.flatnonzero(inputs.items("vision").sample == s)
                        for j in range(int(inputs.items("vision").llm_len[it]))]
                want += [(2.0, int(it), j) for it in np.flatnonzero(inputs.items("audio").sample == s)
                         for j in range(int(inputs.items("audio").llm_len[it]))]
                want += [(0.0, int(s), j) for j in range(int(inputs.text_len[s]))]
                assert [tuple(r) for r in seq.tolist()] == want
            ids = [torch.arange(int(n)) + 100 * int(s) for s, n in zip(rmb.samples, rmb.text_len)]
            labels = packed_labels(rmb, ids)
            for i, s in enumerate(rmb.samples):
                a, b = int(cu[i]), int(cu[i + 1])
                n = int(inputs.text_len[s])
                lab = labels[a:b].tolist()
                assert lab[-1] == IGNORE_INDEX
                first = 0 if b - a > n else 1
                assert lab[b - a - n - 1 + first: b - a - 1] == [100 * int(s) + j for j in range(first, n)]
                assert all(v == IGNORE_INDEX for v in lab[: b - a - n - 1 + first])
    assert seen_samples == inputs.num_samples


def test_pack_rejects_tensors_that_do_not_fit_the_plan():
    inputs = make_inputs(12, 6)
    plan = plan_step(inputs, Topology(world_size=1, ranks_per_node=1), PlannerConfig(num_microbatches=1))
    rmb = plan.rank_microbatch(0, 0)
    text = torch.zeros(int(rmb.text_len.sum()), 4)
    got = {p: torch.zeros(int(px.recv_llm_len.sum()), 4) for p, px in rmb.exchanges.items()}
    packed, _, _ = pack_llm_inputs(rmb, text, got)
    assert packed.shape == (rmb.total_len, 4)
    with pytest.raises(ValueError, match="text_embeds has"):
        pack_llm_inputs(rmb, torch.zeros(text.shape[0] + 1, 4), got)
    with pytest.raises(ValueError, match="exchanged tensor has shape"):
        pack_llm_inputs(rmb, text, {**got, "vision": torch.zeros(got["vision"].shape[0] + 1, 4)})
    with pytest.raises(ValueError, match="text ids given"):
        packed_labels(rmb, torch.zeros(text.shape[0] + 2, dtype=torch.long))
    with pytest.raises(ValueError, match="not in the plan"):
        pack_llm_inputs(rmb, text, {**got, "video": torch.zeros(0, 4)})


def test_synthetic_inputs_are_deterministic_and_distinct():
    a = synthetic_features(3, "vision", 5, 8, 48)
    assert torch.equal(a, synthetic_features(3, "vision", 5, 8, 48))
    assert not torch.equal(a, synthetic_features(3, "vision", 6, 8, 48))
    assert not torch.equal(a, synthetic_features(4, "vision", 5, 8, 48))
    ids = synthetic_text_ids(0, 1, 20, 97)
    assert ids.shape == (20,) and int(ids.max()) < 97 and torch.equal(ids, synthetic_text_ids(0, 1, 20, 97))


def test_loss_mask_leaves_exactly_the_masked_tokens_out_of_the_targets():
    inputs = make_inputs(12, 6)
    plan = plan_step(inputs, Topology(world_size=1, ranks_per_node=1), PlannerConfig(num_microbatches=1))
    rmb = plan.rank_microbatch(0, 0)
    rng = np.random.default_rng(0)
    ids = [torch.as_tensor(rng.integers(0, 97, int(n)), dtype=torch.int32) for n in rmb.text_len]
    masks = [torch.as_tensor(rng.random(int(n)) < 0.5) for n in rmb.text_len]
    unmasked, masked = packed_labels(rmb, ids), packed_labels(rmb, ids, masks)
    flat_mask = torch.cat(masks)
    # Every target of the unmasked labels is kept where its token's mask is 1, dropped where 0.
    targets = unmasked != IGNORE_INDEX
    kept = torch.zeros_like(targets)
    t = 0
    for off, start, n in zip(rmb.text_offsets, rmb.sample_offsets, rmb.text_len):
        for j in range(int(n)):
            pos = int(off) - 1 + j
            if pos >= int(start) and flat_mask[t + j]:
                kept[pos] = True
        t += int(n)
    assert torch.equal(masked != IGNORE_INDEX, kept & targets) and 0 < int(kept.sum()) < int(targets.sum())
    assert torch.equal(masked[kept], unmasked[kept])
    with pytest.raises(ValueError, match="loss mask of"):
        packed_labels(rmb, ids, masks[:-1])


def test_image_bytes_become_merged_patch_blocks():
    from PIL import Image

    w, h = 64, 32  # wide image: 8 tokens should be laid out 2 (rows) x 4 (cols)
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[:, w // 2:] = 255  # right half white
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    patches = image_patches(buf.getvalue(), 8, patch_size=4, merge=2)
    assert patches.shape == (8 * 4, 48)
    block_means = patches.reshape(8, 4 * 48).mean(dim=1)  # one value per merged token
    # token grid 2 x 4 in row-major order: columns 0-1 black, 2-3 white
    assert block_means.reshape(2, 4)[:, :2].max() < -0.9
    assert block_means.reshape(2, 4)[:, 2:].min() > 0.9
    assert image_patches(buf.getvalue(), 0, patch_size=4, merge=2).shape == (0, 48)


def test_audio_bytes_become_enc_len_frames():
    import soundfile

    sr = 16000
    t = np.arange(sr) / sr
    wave = np.concatenate([np.zeros(sr // 2), np.sin(2 * np.pi * 440 * t[: sr // 2])]).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, wave, sr, format="WAV")
    frames = audio_frames(buf.getvalue(), 10, frame_dim=16)
    assert frames.shape == (10, 16)
    assert float(frames[:5].abs().max()) == 0.0  # silence
    assert float(frames[5:].max()) > 0.1


def test_raw_payloads_run_through_the_encoders(model):
    import soundfile
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(buf, format="JPEG")
    img = buf.getvalue()
    wav = io.BytesIO()
    soundfile.write(wav, np.random.default_rng(1).standard_normal(8000).astype(np.float32), 16000, format="WAV")
    cfg = model.config
    v = encoder_input(cfg, "vision", img, enc_len=24, llm_len=6).to(torch.float64)
    a = encoder_input(cfg, "audio", wav.getvalue(), enc_len=20, llm_len=5).to(torch.float64)
    assert model.encode_vision([v], [6]).shape == (6, 16)
    assert model.encode_audio([a], [5]).shape == (5, 16)
    with pytest.raises(ValueError, match="merges 2x2"):
        encoder_input(cfg, "vision", img, enc_len=25, llm_len=6)
    with pytest.raises(ValueError, match="video"):
        encoder_input(cfg, "video", img, enc_len=1, llm_len=1)
