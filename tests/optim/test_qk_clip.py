import math

import pytest
import torch

from kimik3.optim import apply_qk_clip, clip_qk, qk_clip_events
from kimik3.optim.qk_clip import mla_head_layout

TAU = 30.0


def tracked_max_logits(mla, x):
    mla.reset_max_logits()
    with torch.no_grad():
        mla(x)
    return mla.max_logits.clone()


def plant_huge_logit(mla, head):
    """Scale one head's query rows so its logits blow far past TAU."""
    q = mla.q_b_proj if hasattr(mla, "q_b_proj") else mla.q_proj
    rows = slice(head * (mla.nope + mla.rope), (head + 1) * (mla.nope + mla.rope))
    with torch.no_grad():
        q.weight[rows] *= 400.0


@pytest.mark.parametrize("q_lora", [None, 12], ids=["q_proj", "q_lora"])
def test_clip_brings_the_planted_head_to_tau_and_leaves_others(make_mla, q_lora):
    mla = make_mla(q_lora)
    x = torch.randn(2, 16, 32)
    plant_huge_logit(mla, head=1)
    before = tracked_max_logits(mla, x)
    assert before[1] > 10 * TAU and (before[[0, 2, 3]] < TAU).all()
    weights = {n: p.detach().clone() for n, p in mla.named_parameters()}

    events = apply_qk_clip(mla, TAU)

    assert [(e["layer"], e["head"]) for e in events] == [("", 1)]
    assert events[0]["max_logit"] == pytest.approx(before[1].item())
    assert events[0]["factor"] == pytest.approx(TAU / before[1].item())
    after = tracked_max_logits(mla, x)
    assert after[1] <= TAU * (1 + 1e-4) and after[1] == pytest.approx(TAU, rel=1e-4)
    torch.testing.assert_close(after[[0, 2, 3]], before[[0, 2, 3]], rtol=0, atol=0)
    unchanged = [n for n, p in mla.named_parameters() if torch.equal(p, weights[n])]
    changed = {"q_b_proj.weight" if q_lora else "q_proj.weight", "kv_b_proj.weight"}
    assert set(unchanged) == set(weights) - changed


def test_factor_split_between_nope_rope_and_shared_key(make_mla):
    mla = make_mla()
    lay = mla_head_layout(mla)
    assert (lay.num_heads, lay.nope, lay.rope, lay.v) == (4, 8, 4, 8)
    mla.max_logits.copy_(torch.tensor([1.0, 4 * TAU, 2.0, 3.0]))
    q0, kv_b0, kv_a0 = (mla.q_proj.weight.detach().clone(), mla.kv_b_proj.weight.detach().clone(),
                        mla.kv_a_proj.weight.detach().clone())
    apply_qk_clip(mla, TAU)
    q = mla.q_proj.weight.view(4, 12, 32) / q0.view(4, 12, 32)
    kv_b = mla.kv_b_proj.weight.view(4, 16, 16) / kv_b0.view(4, 16, 16)
    torch.testing.assert_close(q[1, :8], torch.full((8, 32), 0.5))      # q_nope: sqrt(1/4)
    torch.testing.assert_close(q[1, 8:], torch.full((4, 32), 0.25))     # q_rope: 1/4
    torch.testing.assert_close(kv_b[1, :8], torch.full((8, 16), 0.5))   # k_nope: sqrt(1/4)
    torch.testing.assert_close(kv_b[1, 8:], torch.ones(8, 16))          # v untouched
    assert torch.equal(mla.kv_a_proj.weight, kv_a0)                      # shared k_rope untouched
    assert torch.equal(q[[0, 2, 3]], torch.ones(3, 12, 32))


def test_disabled_when_threshold_is_none(make_mla):
    mla = make_mla()
    mla.max_logits.fill_(1e6)
    q0 = mla.q_proj.weight.detach().clone()
    assert apply_qk_clip(mla, None) == []
    assert torch.equal(mla.q_proj.weight, q0)


def test_nothing_happens_at_or_below_tau(make_mla):
    mla = make_mla()
    mla.max_logits.fill_(TAU)
    assert apply_qk_clip(mla, TAU) == []


def test_untracked_logits_or_bad_threshold_raise(make_mla):
    mla = make_mla()
    with pytest.raises(ValueError, match="must be > 0"):
        apply_qk_clip(mla, 0.0)
    mla.track_max_logits = False
    with pytest.raises(ValueError, match="track_max_logits is False"):
        apply_qk_clip(mla, TAU)


def test_events_name_the_layer_in_a_model(fake_kimi):
    mla = fake_kimi.layers[1].attn
    mla.max_logits.copy_(torch.tensor([2 * TAU, -math.inf]))
    events = apply_qk_clip(fake_kimi, TAU)
    assert events == [{"layer": "layers.1.attn", "head": 0, "max_logit": 2 * TAU, "factor": 0.5}]


def test_clip_qk_reads_nothing_on_the_host_and_a_skipped_step_clips_nothing(make_mla, monkeypatch):
    """The trainer's form: clip on the device (any host read would stall the GPU queue each step),
    gated by the step's keep flag; the events come later from the returned max logits."""
    mla = make_mla()
    mla.max_logits.copy_(torch.tensor([1.0, 4 * TAU, 2.0, 3.0]))
    q0 = mla.q_proj.weight.detach().clone()
    with monkeypatch.context() as m:
        for name in ("__bool__", "item", "tolist", "__float__", "__int__"):
            m.setattr(torch.Tensor, name, _refuse_host_read)
        s_skipped = clip_qk(mla, TAU, keep=torch.tensor(False))
        assert torch.equal(mla.q_proj.weight, q0)
        s_kept = clip_qk(mla, TAU, keep=torch.tensor(True))
    assert torch.equal(s_skipped, s_kept)
    q = mla.q_proj.weight.view(4, 12, 32) / q0.view(4, 12, 32)
    torch.testing.assert_close(q[1, :8], torch.full((8, 32), 0.5))
    assert torch.equal(q[[0, 2, 3]], torch.ones(3, 12, 32))  # unclipped heads: x 1.0, bit for bit
    assert qk_clip_events(mla, s_kept.tolist(), TAU) == [{"layer": "", "head": 1, "max_logit": 4 * TAU,
                                                          "factor": 0.25}]


def _refuse_host_read(*args, **kwargs):
    raise AssertionError("a host read of a device value")
