import copy
import io
import math
import os

import pytest
import torch

from kimik3.config.schema import TrainConfig
from kimik3.optim import build_optimizer, muon
from kimik3.optim.muon import NS_COEFFS, MuonAdamW, newton_schulz

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the adamw_triton kind's kernel on CPU tensors


def quintic_band(lowest: float, steps: int = 5) -> tuple[float, float]:
    """Range of the 5-fold quintic over normalised singular values in [lowest, 1] (fp64 grid)."""
    a, b, c = NS_COEFFS
    x = torch.logspace(math.log10(lowest), 0, 100_001, dtype=torch.float64)
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x.min().item(), x.max().item()


def reference_ns(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Plain fp64 Newton-Schulz on one 2-D matrix, written independently of kimik3."""
    a, b, c = NS_COEFFS
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + b * s @ x + c * s @ s @ x
    return (x.T if tall else x).float()


SHAPES = [(32, 64), (64, 32), (16, 256), (96, 128)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_newton_schulz_singular_values_lie_in_the_quintic_band(shape):
    torch.manual_seed(0)
    g = torch.randn(shape)
    sv = torch.linalg.svdvals(g)
    lo, hi = quintic_band(float(sv.min() / sv.norm()))
    assert 0.68 < lo and hi < 1.14  # the band these coefficients give for well-conditioned inputs
    out_sv = torch.linalg.svdvals(newton_schulz(g, 5))
    assert out_sv.min() >= lo - 1e-3 and out_sv.max() <= hi + 1e-3


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_newton_schulz_points_along_the_polar_factor(shape):
    torch.manual_seed(1)
    g = torch.randn(shape)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    o = newton_schulz(g, 5)
    cosine = (o * polar).sum() / (o.norm() * polar.norm())
    assert cosine > 0.97
    # Same singular vectors: o = U diag(f(s)) V^T, so U^T o V is diagonal.
    inner = u.T @ o @ vh.T
    assert (inner - torch.diag(inner.diagonal())).abs().max() < 1e-4


def test_newton_schulz_matches_reference_batched_and_transposed():
    torch.manual_seed(2)
    g = torch.randn(3, 24, 40)
    batched = newton_schulz(g, 5)
    for i in range(3):
        torch.testing.assert_close(batched[i], reference_ns(g[i], 5), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(newton_schulz(g.mT, 5), batched.mT, atol=1e-5, rtol=1e-4)


def blocks_of(u, split):
    """(index, block) pairs: every matrix of u [A, B] or [E, A, B], cut into the split's blocks."""
    matrices = [(i,) for i in range(u.shape[0])] if u.ndim == 3 else [()]
    axis, parts = split or (0, 1)
    size = u.shape[-2 + axis] // parts
    pairs = []
    for m in matrices:
        for h in range(parts):
            cut = slice(h * size, (h + 1) * size)
            index = m + ((cut,) if axis == 0 else (slice(None), cut))
            pairs.append((index, u[index]))
    return pairs


def reference_muon(w, grads, *, lr, wd, mu, scale, split=None):
    """Straightforward Muon: loop over steps, Nesterov momentum, NS per block, decoupled wd."""
    w, buf = w.clone(), torch.zeros_like(w)
    for g in grads:
        buf = mu * buf + g
        u = g + mu * buf
        w = w * (1 - lr * wd)
        for index, blk in blocks_of(u, split):
            w[index] -= lr * scale * math.sqrt(max(blk.shape)) * reference_ns(blk, 5)
    return w


def muon_group(p, split=None, **kw):
    group = dict(params=[p], name="muon", kind="muon", lr=0.02, base_lr=0.02, weight_decay=0.1,
                 momentum=0.95, nesterov=True, ns_steps=5, rms_scale=0.2, block_splits=[split])
    return {**group, **kw}


@pytest.mark.parametrize(
    "shape, split",
    [((24, 40), None), ((40, 24), None), ((3, 16, 24), None), ((3, 32, 24), (0, 2)),
     ((32, 24), (0, 4)), ((24, 32), (1, 4))],
    ids=["wide", "tall", "experts", "experts_gate_up", "per_head_rows", "per_head_cols"],
)
def test_muon_step_matches_reference(shape, split):
    torch.manual_seed(3)
    w0 = torch.randn(shape) * 0.1
    grads = [torch.randn(shape) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = MuonAdamW([muon_group(p, split)])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = reference_muon(w0, grads, lr=0.02, wd=0.1, mu=0.95, scale=0.2, split=split)
    torch.testing.assert_close(p.detach(), expected, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("shape, split", [((64, 256), None), ((256, 64), None), ((128, 64), (0, 4))])
def test_update_rms_matches_the_adamw_like_target(shape, split):
    """RMS(update) / lr = rms_scale * RMS of the singular values, i.e. 0.2 within the quintic band."""
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = MuonAdamW([muon_group(p, split, lr=1.0, weight_decay=0.0, momentum=0.0)])
    p.grad = torch.randn(shape)
    opt.step()
    rms = p.detach().pow(2).mean().sqrt().item()
    assert 0.2 * 0.68 < rms < 0.2 * 1.14
    assert rms == pytest.approx(0.2, rel=0.25)


def test_adamw_groups_match_torch_adamw_bitwise(fake_kimi):
    twin = copy.deepcopy(fake_kimi)
    opt, _ = build_optimizer(fake_kimi, TrainConfig(optimizer="adamw", lr=1e-2))
    name_of = {id(p): n for n, p in fake_kimi.named_parameters()}
    twin_params = dict(twin.named_parameters())
    ref = torch.optim.AdamW(
        [{"params": [twin_params[name_of[id(p)]] for p in g["params"]], "weight_decay": g["weight_decay"]}
         for g in opt.param_groups],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    torch.manual_seed(5)
    for _ in range(3):
        for p, q in zip(fake_kimi.parameters(), twin.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for (n, p), q in zip(fake_kimi.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n


def random_steps(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.device)
        opt.step()


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_state_dict_round_trip_gives_identical_next_steps(fake_kimi, optimizer):
    cfg = TrainConfig(optimizer=optimizer, muon_per_head=True)
    opt, _ = build_optimizer(fake_kimi, cfg)
    random_steps(fake_kimi, opt, 2, seed=6)
    buffer = io.BytesIO()
    torch.save({"model": fake_kimi.state_dict(), "optim": opt.state_dict()}, buffer)
    random_steps(fake_kimi, opt, 2, seed=7)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = copy.deepcopy(fake_kimi)
    resumed.load_state_dict(saved["model"])
    resumed_opt, _ = build_optimizer(resumed, cfg)
    resumed_opt.load_state_dict(saved["optim"])
    random_steps(resumed, resumed_opt, 2, seed=7)
    for (n, p), q in zip(fake_kimi.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n


def test_parameters_without_grad_are_left_alone(fake_kimi):
    opt, _ = build_optimizer(fake_kimi, TrainConfig(optimizer="muon"))
    before = {n: p.detach().clone() for n, p in fake_kimi.named_parameters()}
    fake_kimi.lm_head.weight.grad = torch.ones_like(fake_kimi.lm_head.weight)
    opt.step()
    changed = {n for n, p in fake_kimi.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"lm_head.weight"}


def test_bad_groups_raise_clear_errors():
    vec = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="2-D or 3-D"):
        MuonAdamW([muon_group(vec)])
    with pytest.raises(ValueError, match="block split"):
        MuonAdamW([muon_group(torch.nn.Parameter(torch.zeros(6, 4)), (0, 4))])
    with pytest.raises(ValueError, match="kind='sgd'"):
        MuonAdamW([{"params": [vec], "kind": "sgd"}])
    with pytest.raises(ValueError, match="lacks keys"):
        MuonAdamW([{"params": [vec], "kind": "adamw", "lr": 1.0}])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_newton_schulz_in_bf16_tracks_the_fp32_result():
    torch.manual_seed(8)
    g = torch.randn(4, 256, 512)
    cpu = newton_schulz(g, 5)
    gpu = newton_schulz(g.cuda(), 5)
    assert gpu.dtype == torch.bfloat16
    cosine = torch.nn.functional.cosine_similarity(gpu.float().cpu().flatten(1), cpu.flatten(1))
    assert (cosine > 0.99).all()


@pytest.mark.gpu
@cuda
def test_cuda_step_with_fused_adamw_resumes_exactly(fake_kimi):
    model = fake_kimi.cuda()
    cfg = TrainConfig(optimizer="muon", muon_per_head=True)
    opt, _ = build_optimizer(model, cfg)
    assert all(g["fused"] for g in opt.param_groups if g["kind"] == "adamw")
    twin = copy.deepcopy(model)
    twin_opt, _ = build_optimizer(twin, cfg)
    random_steps(model, opt, 2, seed=9)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    twin.load_state_dict(model.state_dict())
    random_steps(model, opt, 2, seed=10)
    random_steps(twin, twin_opt, 2, seed=10)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n


def adamw_group(p, fused):
    return dict(params=[p], name="adamw", kind="adamw", lr=0.01, base_lr=0.01, weight_decay=0.1,
                betas=(0.9, 0.95), eps=1e-8, fused=fused)


KINDS = ["muon", "adamw_fused", "adamw_foreach", "adamw_triton"]
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


def stepped_optimizer(kind: str, device: str, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Parameter, MuonAdamW]:
    """(p, opt): one [3, 16, 24] parameter on `device` in a group of `kind`, after one plain step, so
    there is state to keep (and a next update that depends on the gradient's scale: Muon's and Adam's
    first updates hardly do). adamw_triton: a fused group whose tensor ops.adamw updates (on the CPU
    under the Triton interpreter), as CUDA tensors of a million elements or more are."""
    if kind == "adamw_triton":
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("ops.adamw on CPU tensors needs the Triton interpreter (set only where there is no GPU)")
        monkeypatch.setattr(muon, "takes_triton_adamw", lambda *row: True)
    torch.manual_seed(5)
    p = torch.nn.Parameter((torch.randn(3, 16, 24) * 0.1).to(device))
    opt = MuonAdamW([muon_group(p) if kind == "muon" else adamw_group(p, fused=kind != "adamw_foreach")])
    p.grad = torch.randn_like(p)
    opt.step()
    return p, opt


@pytest.mark.parametrize("clip_coef", [None, 0.0, math.nan], ids=["no_clip", "clip_0", "clip_nan"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_skip_flag_leaves_everything_untouched_even_with_nan_grads(kind, device, clip_coef, monkeypatch):
    """step(skip=True) on the device: parameters and optimizer state stay bit for bit, also with the
    clip factor of a non-finite norm (0 for inf, NaN for NaN; fused AdamW's grad_scale 1/c is then inf
    or NaN); step(skip=False) is the plain step (same parameters as step() to rounding of the
    weight-decay factor)."""
    p, opt = stepped_optimizer(kind, device, monkeypatch)
    params, state = p.detach().clone(), copy.deepcopy(opt.state_dict()["state"])
    p.grad = torch.full_like(p, math.nan)
    p.grad[0] = math.inf
    coef = None if clip_coef is None else torch.tensor(clip_coef, device=device)
    opt.step(skip=torch.tensor(True, device=device), clip_coef=coef)
    assert torch.equal(p, params)
    for key, value in opt.state_dict()["state"][0].items():
        assert torch.equal(value, state[0][key]), key
    twin = copy.deepcopy(opt)
    g = torch.randn_like(p)
    p.grad, twin.param_groups[0]["params"][0].grad = g.clone(), g.clone()
    opt.step(skip=torch.tensor(False, device=device))
    twin.step()
    assert not torch.equal(p, params)
    torch.testing.assert_close(p.detach(), twin.param_groups[0]["params"][0].detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("skip", [None, False], ids=["no_skip_flag", "skip_false"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_clip_coef_step_equals_clipping_the_grads_then_stepping(kind, device, skip, monkeypatch):
    """step(clip_coef=c) is the step on the gradients scaled by c first (what the trainer did before,
    with torch.nn.utils.clip_grads_with_norm_'s g * c): the same parameters, optimizer state, and
    clipped gradients left in p.grad. Muon and foreach AdamW scale with clipping's own multiply: the
    same bits. Fused AdamW divides by 1/c inside its kernel, within 2 fp32 ulps of g * c, and ops.adamw
    multiplies by c inside its kernel (on the GPU possibly fused into the next multiply-add); through
    Adam's normalised update that stays at fp32 rounding (rtol 1e-6, atol 1e-7 here, where parameters
    are ~0.1 and an update ~lr = 1e-2). ops.adamw leaves p.grad as it came: it never writes it."""
    p, opt = stepped_optimizer(kind, device, monkeypatch)
    clipped, unclipped = copy.deepcopy(opt), copy.deepcopy(opt)
    g = torch.randn_like(p)
    c = torch.tensor(0.37, device=device)
    p.grad = g.clone()
    clipped.param_groups[0]["params"][0].grad = g * c
    unclipped.param_groups[0]["params"][0].grad = g.clone()
    flag = None if skip is None else torch.tensor(skip, device=device)
    opt.step(skip=flag, clip_coef=c)
    clipped.step(skip=flag)
    unclipped.step(skip=flag)
    exact = kind in ("muon", "adamw_foreach")  # the GPU kernels may contract g * c into an FMA
    tol = dict(rtol=0.0, atol=0.0) if exact else dict(rtol=1e-6, atol=1e-7)
    ref = clipped.param_groups[0]["params"][0]
    torch.testing.assert_close(p.detach(), ref.detach(), **tol)
    torch.testing.assert_close(p.grad, g if kind == "adamw_triton" else ref.grad, **tol)
    for key, value in opt.state_dict()["state"][0].items():
        torch.testing.assert_close(value, clipped.state_dict()["state"][0][key], **tol, msg=key)
    # Not a vacuous match: ignoring c would move the parameters elsewhere.
    assert (p - unclipped.param_groups[0]["params"][0]).abs().max() > 1e-4


def test_triton_adamw_moves_step_counts_without_host_reads(monkeypatch):
    """The bookkeeping around ops.adamw on meta tensors, where any host read (a sync on a GPU) raises:
    a step with a skip flag and a clip factor reaches the kernel once. (The foreach overload that takes
    one 0-dim tensor reads it on the host: that was a ~50 ms stall per kimi_3b_a1b step on the H200.)"""
    import kimik3.ops.adamw as ops_adamw

    calls = []
    monkeypatch.setattr(ops_adamw, "adamw_update_", lambda *args, **kwargs: calls.append(kwargs))
    meta = dict(device="meta")
    rows = [(*(torch.zeros(4, **meta) for _ in range(4)), torch.zeros((), **meta)) for _ in range(3)]
    group = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    muon._triton_adamw(group, rows, skip=torch.zeros((), dtype=torch.bool, **meta), clip_coef=torch.ones((), **meta))
    assert len(calls) == 1 and calls[0]["lr"] == 1e-3
