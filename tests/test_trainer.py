"""trainer.train / kimik3.train.run on the smoke model and the embedded corpus, in process."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kimik3.trainer as trainer_mod
from kimik3.config.schema import DataConfig
from kimik3.data import ShardedTokenDataset, TokenDataLoader, prepare_data
from kimik3.models import build_model
from kimik3.models.smoke import SmokeTestLM
from kimik3.optim import MuonAdamW, build_optimizer, muon
from kimik3.runs.metrics import MetricsWriter, read_events
from kimik3.runs.progress import Progress
from kimik3.train import run, seed_everything
from kimik3.trainer import TrainState, evaluate, train
from recipes import TINY_TRAIN


def _train(cfg, run_dir: Path, model=None, data: Path | None = None, state: TrainState | None = None):
    """train() on `cfg` with real loaders; returns (result, model, train_loader, events)."""
    seed_everything(cfg.train.seed, False)
    data = data or prepare_data(cfg.data, progress=False)
    train_ds, val_ds = ShardedTokenDataset(data, "train"), ShardedTokenDataset(data, "val")
    loaders = [TokenDataLoader(ds, cfg.train.batch_size, cfg.train.seq_len) for ds in (train_ds, val_ds)]
    model = model or build_model(cfg.model, train_ds.vocab_size)
    optimizer, _ = build_optimizer(model, cfg.train)
    run_dir.mkdir(parents=True, exist_ok=True)
    with MetricsWriter(run_dir) as metrics:
        progress = Progress(cfg.train.max_steps, 0, tty=False)
        result = train(model, optimizer, *loaders, cfg.train, state or TrainState(), device=torch.device("cpu"),
                       precision="fp32", metrics=metrics, save=lambda s: run_dir / f"ckpt-{s.step}", progress=progress)
        progress.close()
    return result, model, loaders[0], read_events(run_dir)


class NaNAt(SmokeTestLM):
    """A smoke model whose loss is non-finite on the forward calls listed in `bad_calls` (0-based),
    recording the trainer's hook calls."""

    def __init__(self, vocab_size: int, bad_calls: set[int], value: float = math.nan) -> None:
        super().__init__(vocab_size, 16)
        self.bad_calls, self.value, self.calls, self.hooks = bad_calls, value, 0, []

    def forward(self, input_ids, targets=None):
        out = super().forward(input_ids, targets)
        if self.training:
            if self.calls in self.bad_calls:
                out.loss = out.loss * self.value
                out.lm_loss = out.loss
            self.calls += 1
        return out

    def on_step_end(self, applied) -> None:
        self.hooks.append(bool(applied))


def test_run_writes_run_dir_and_returns_final_val_loss(smoke_cfg, tmp_path):
    cfg = smoke_cfg
    cfg.train.max_steps, cfg.train.checkpoint_interval = 12, 6
    objective = run(cfg, tmp_path / "run", run_id="r1")
    events = read_events(tmp_path / "run")
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert [e["step"] for e in events if e["event"] == "eval"] == [4, 8, 12]
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [6, 12]
    end = events[-1]
    assert end["status"] == "finished" and end["objective"] == objective == events[-3]["val_loss"]
    assert all(e["tokens"] == e["step"] * 2 * 32 for e in events)
    evals = [e["val_loss"] for e in events if e["event"] == "eval"]
    assert evals[-1] < evals[0]  # the smoke model learns byte bigrams
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert manifest["run_id"] == "r1" and manifest["model"]["arch"] == "smoke_test_lm"
    assert manifest["sessions"][0]["status"] == "finished" and manifest["sessions"][0]["step"] == 12
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000006.pt", "step-000012.pt"]


def test_objective_can_be_train_loss(smoke_cfg, tmp_path):
    smoke_cfg.train.objective = "train_loss"
    objective = run(smoke_cfg, tmp_path / "run", run_id="r")
    end = read_events(tmp_path / "run")[-1]
    assert objective == end["train_loss"] != end["val_loss"]


def test_non_finite_update_is_skipped_counted_and_logged(smoke_cfg, tmp_path):
    cfg = smoke_cfg
    cfg.train.grad_accum_steps = 2
    result, model, _, events = _train(cfg, tmp_path / "run", model=NaNAt(257, bad_calls={5}))  # step 3, micro 2
    assert result.state.skipped == 1 and result.state.step == 8
    assert model.hooks == [True, True, False, True, True, True, True, True]
    skips = [e for e in events if e["event"] == "skip"]
    assert len(skips) == 1 and skips[0]["step"] == 3 and skips[0]["reason"] == "non-finite loss"
    assert skips[0]["loss"] is None  # non-finite floats are written as null
    train_events = [e for e in events if e["event"] == "train"]
    assert train_events[1]["skipped"] == 1 and all(math.isfinite(e["loss"]) for e in train_events)


def test_skipped_step_leaves_parameters_untouched(smoke_cfg, tmp_path):
    cfg = smoke_cfg
    cfg.train.max_steps, cfg.train.warmup_steps = 3, 1
    result, skipped, _, events = _train(cfg, tmp_path / "a", model=NaNAt(257, bad_calls={2}, value=math.inf))
    assert result.state.skipped == 1
    assert [e["reason"] for e in events if e["event"] == "skip"] == ["non-finite loss"]
    cfg.train.max_steps = 2  # the same run stopped before the bad step 3
    _, clean, _, _ = _train(cfg, tmp_path / "b", model=NaNAt(257, bad_calls=set()))
    for a, b in zip(skipped.parameters(), clean.parameters()):
        assert torch.equal(a, b)


def test_step_order_accumulate_clip_step_qk_clip_hook(smoke_cfg, tmp_path, monkeypatch):
    """Per step: the micro-batches, the clip factor (handed to the optimizer step, which applies it:
    no in-place clipping pass), the step, QK-Clip, the model's hook."""
    cfg = smoke_cfg
    cfg.train.max_steps, cfg.train.grad_accum_steps = 2, 3
    order: list[str] = []
    model = NaNAt(257, bad_calls=set())
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a: (order.append("forward"), forward(*a))[1])
    monkeypatch.setattr(model, "on_step_end", lambda applied: order.append(f"on_step_end({bool(applied)})"))
    clip, step = trainer_mod.clip_coefficient, MuonAdamW.step
    monkeypatch.setattr(trainer_mod, "clip_coefficient", lambda *a: (order.append("clip"), clip(*a))[1])
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **kw: order.append("in-place clip"))
    monkeypatch.setattr(MuonAdamW, "step", lambda self, **kw: (
        order.append("step(clip_coef)" if kw.get("clip_coef") is not None else "step"), step(self, **kw))[1])
    monkeypatch.setattr(trainer_mod, "clip_qk", lambda m, tau, keep: order.append(f"qk_clip({tau})"))
    optimizer_steps = []
    monkeypatch.setattr(trainer_mod, "lr_multiplier", lambda s, c: (optimizer_steps.append(s), 1.0)[1])
    _train(cfg, tmp_path / "run", model=model)
    one_step = ["forward"] * 3 + ["clip", "step(clip_coef)", "qk_clip(100.0)", "on_step_end(True)"]
    assert order == one_step * 2 + ["forward"] * cfg.train.eval_steps  # then the final eval
    assert optimizer_steps == [0, 1]


def _one_batch_stepper(root, device: str = "cpu", micro_batches: int = 1):
    """(model, optimizer, step, batch): the root's model on `device`, prepared as train() prepares it,
    fused AdamW as on CUDA (the CPU has the fused kernel too; foreach AdamW would read its skip flag
    and lift its step's 1.0 from host data), and step(i) = trainer.train_step over one fixed batch
    (inputs, targets) repeated `micro_batches` times."""
    cfg, device = root.train, torch.device(device)
    with device:
        model = build_model(root.model, 257)
    trainer_mod.prepare_for_training(model, cfg)
    optimizer, _ = build_optimizer(model, cfg)
    for group in optimizer.param_groups:
        group["fused"] = group["kind"] == "adamw"
    tokens = torch.randint(0, 257, (cfg.batch_size, cfg.seq_len + 1))
    if device.type == "cuda":
        tokens = tokens.pin_memory()
    micro = [(tokens[:, :-1], tokens[:, 1:])] * micro_batches
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = trainer_mod.autocast_for(device, "bf16" if device.type == "cuda" else "fp32")

    def step(i: int) -> trainer_mod.StepResult:
        return trainer_mod.train_step(model, optimizer, micro, cfg, i, params=params, device=device,
                                      autocast=autocast)

    return model, optimizer, step, micro[0]


@pytest.mark.parametrize("optimizer_name", ["adamw", "muon"])
def test_train_step_reads_nothing_on_the_host(compose, monkeypatch, optimizer_name):
    """A step is only queued: the skip decision, the optimizer (Muon, fused AdamW as on CUDA), QK-Clip
    and the hooks take device tensors, so no host read drains the GPU queue; the outcome is read
    afterwards. (kimi_k3_tiny with dense FFNs: the CPU's expert loop reads its counts.)"""
    root = compose(["model=kimi_k3_tiny", "model.num_experts=0", *TINY_TRAIN, f"train.optimizer={optimizer_name}",
                    "train.grad_accum_steps=2"])
    model, optimizer, step, _ = _one_batch_stepper(root, micro_batches=2)
    assert {g["kind"] for g in optimizer.param_groups} >= {optimizer_name}
    with monkeypatch.context() as m:
        for name in ("__bool__", "item", "tolist", "__float__", "__int__"):
            m.setattr(torch.Tensor, name, _refuse_host_read)
        result = step(0)
    values = result.outcome.read()
    assert not values.skipped and math.isfinite(values.loss) and values.grad_norm > 0
    assert values.loss == pytest.approx(result.loss.item())
    assert values.max_logits is not None and len(values.max_logits) == sum(
        mla.max_logits.numel() for _, mla in model.mla_layers())


class _RefuseHostData(TorchDispatchMode):
    """Fails on a tensor built from Python data (`torch.tensor`, `new_tensor`): on a GPU that is a
    blocking host-to-device copy, which waits for the whole queue."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            raise AssertionError("a tensor built from host data inside the step (a blocking copy on a GPU)")
        return func(*args, **(kwargs or {}))


def test_train_step_builds_no_tensor_from_host_data(compose):
    """With the MoE on (the host-read test above turns it off for the CPU's expert loop): no layer,
    loss or optimizer hook copies host data to the device in a step."""
    root = compose(["model=kimi_k3_tiny", *TINY_TRAIN, "train.optimizer=muon", "train.grad_accum_steps=2"])
    model, _, step, _ = _one_batch_stepper(root, micro_batches=2)
    assert any(True for _ in model.moe_layers())
    with _RefuseHostData():
        result = step(0)
    assert not result.outcome.read().skipped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optimizer_name", ["muon", "adamw"])
def test_train_step_never_synchronizes_cuda(compose, monkeypatch, optimizer_name):
    """kimi_k3_tiny on CUDA (Triton KDA, MLA, grouped-GEMM MoE, Muon or AdamW, QK-Clip): a step after
    the first runs under torch.cuda.set_sync_debug_mode("error"), which raises on any call that makes
    the host wait for the GPU (a host read, a blocking copy, a data-dependent shape). Every AdamW
    tensor takes ops.adamw here (the tiny model's are below its size threshold otherwise)."""
    monkeypatch.setattr(muon, "TRITON_ADAMW_MIN_NUMEL", 0)
    root = compose(["model=kimi_k3_tiny", *TINY_TRAIN, f"train.optimizer={optimizer_name}", "train.grad_accum_steps=2"])
    _, _, step, _ = _one_batch_stepper(root, "cuda", micro_batches=2)
    step(0).outcome.read()  # the first step compiles the kernels
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = step(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not result.outcome.read().skipped


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer_name", ["adamw", "muon"])
def test_a_non_finite_step_changes_nothing_on_the_device(compose, monkeypatch, optimizer_name, device):
    """The device-side skip (fused AdamW's found_inf; Muon's gated momentum and update; QK-Clip and
    the router bias gated too): after an inf loss, parameters, optimizer state and buffers are
    bit-identical to before, and the outcome reads as skipped."""
    root = compose(["model=kimi_k3_tiny", *TINY_TRAIN, f"train.optimizer={optimizer_name}"])
    model, optimizer, run_step, _ = _one_batch_stepper(root, device)

    def step(i: int) -> trainer_mod.StepValues:
        return run_step(i).outcome.read()

    assert not step(0).skipped
    before = copy.deepcopy((model.state_dict(), optimizer.state_dict()["state"]))
    forward = model.forward

    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.loss = out.loss * math.inf
        out.lm_loss = out.loss
        return out

    monkeypatch.setattr(model, "forward", poisoned)
    assert step(1).skipped
    after = (model.state_dict(), optimizer.state_dict()["state"])
    for key, value in before[0].items():
        assert torch.equal(after[0][key], value), key
    for index, state in before[1].items():
        for key, value in state.items():
            assert torch.equal(after[1][index][key], value), (index, key)


@pytest.mark.parametrize("norm", [0.3, 1.0, 7.5, math.inf, math.nan])
def test_clip_coefficient_is_the_factor_clip_grads_with_norm_scales_by(norm):
    """Bit for bit: 1 under the clip, clip / (norm + 1e-6) over it, 0 for an inf norm and NaN for a
    NaN one (steps the trainer skips)."""
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)  # 1 * c is c exactly
    torch.nn.utils.clip_grads_with_norm_([p], 1.0, torch.tensor(norm))
    coef = trainer_mod.clip_coefficient(torch.tensor(norm), 1.0)
    assert coef.shape == () and coef.dtype == torch.float32
    torch.testing.assert_close(coef.expand(3), p.grad, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("optimizer_name", ["adamw", "muon"])
def test_clipped_train_step_equals_clip_grad_norm_then_step(compose, optimizer_name):
    """With train.grad_clip binding, train_step (the clip factor applied inside the optimizer step)
    gives the parameters and optimizer state of what it replaced: backward, then
    torch.nn.utils.clip_grad_norm_, then optimizer.step(); its grad_norm is the norm before clipping.
    To fp32 rounding: fused AdamW divides by 1/c inside its kernel, within 2 fp32 ulps of clipping's
    g * c (Muon's matrices match bit for bit). CPU only: on CUDA two backward passes need not agree
    bit for bit (SDPA's backward is not deterministic by default) and bf16 Newton-Schulz would carry
    that past fp32 rounding; the CUDA optimizer paths are compared in tests/optim/test_muon.py.
    (Dense FFNs, QK-Clip off: nothing after the optimizer moves a weight, so the reference needs no
    more than these three calls.)"""
    root = compose(["model=kimi_k3_tiny", "model.num_experts=0", *TINY_TRAIN, f"train.optimizer={optimizer_name}",
                    "train.grad_clip=0.05", "train.qk_clip_threshold=null"])
    model, optimizer, step, (inputs, targets) = _one_batch_stepper(root)
    step(0)  # optimizer state, so the next update depends on the gradients' scale
    ref_model, ref_optimizer = copy.deepcopy((model, optimizer))
    result = step(1)
    for group, ref_group in zip(optimizer.param_groups, ref_optimizer.param_groups):
        ref_group["lr"] = group["lr"]
    ref_model(inputs, targets).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for p in ref_model.parameters() if p.requires_grad],
                                          root.train.grad_clip)
    ref_optimizer.step()
    assert norm > 2 * root.train.grad_clip  # the clip binds
    assert torch.equal(result.grad_norm, norm)
    tol = dict(rtol=1e-6, atol=1e-7)
    for (name, p), ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, ref, **tol, msg=name)
    ref_state = ref_optimizer.state_dict()["state"]
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(value, ref_state[index][key], **tol, msg=f"{index} {key}")


def _refuse_host_read(*args, **kwargs):
    raise AssertionError("a host read of a device value inside the step")


def test_grad_accumulation_equals_one_bigger_batch(smoke_cfg, tmp_path):
    """2 micro-batches of B=2 read the same 4 sequences as one batch of B=4 (contiguous cursor)."""
    cfg = smoke_cfg
    cfg.train.device = "cpu"  # equal to fp32 rounding: bf16 autocast (CUDA's default) is not that exact
    cfg.train.max_steps, cfg.train.warmup_steps, cfg.train.grad_clip = 1, 0, None
    cfg.train.schedule = "constant"
    cfg.train.batch_size, cfg.train.grad_accum_steps = 2, 2
    _, accum, _, _ = _train(cfg, tmp_path / "a")
    cfg2 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=4, grad_accum_steps=1))
    _, big, _, _ = _train(cfg2, tmp_path / "b")
    # Adam's first update is ~lr * sign(grad) (lr 3e-3), so a gradient near eps turns a summation-order
    # difference (the CPU's thread count: 16 cores read 2.8e-6 once) into ~1e-6; other data: ~lr.
    for a, b in zip(accum.parameters(), big.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_overfit_batch_repeats_one_batch(smoke_cfg, tmp_path):
    cfg = smoke_cfg
    cfg.train.overfit_batch, cfg.train.max_steps, cfg.train.log_interval, cfg.train.lr = True, 40, 10, 3e-2
    result, _, loader, events = _train(cfg, tmp_path / "run")
    assert loader.position == cfg.train.batch_size * cfg.train.seq_len  # read once, then repeated
    losses = [e["loss"] for e in events if e["event"] == "train"]
    assert losses[-1] < 0.5 * losses[0]


def test_overfit_batch_stays_the_same_batch_across_a_resume(compose, tiny_train, tmp_path, monkeypatch):
    """The checkpoint's train cursor is past the fixed batch: a resumed run must not take the next one."""
    inputs_per_step: list[torch.Tensor] = []
    step = trainer_mod.train_step

    def recording_step(model, optimizer, micro, *args, **kwargs):
        inputs_per_step.append(torch.cat([inputs for inputs, _ in micro]))
        return step(model, optimizer, micro, *args, **kwargs)

    monkeypatch.setattr(trainer_mod, "train_step", recording_step)
    overrides = ["model=smoke", *tiny_train, "train.overfit_batch=true", "train.grad_accum_steps=2",
                 "train.max_steps=6", "train.log_interval=1"]
    run(compose(overrides), tmp_path / "straight", run_id="a")
    split = tmp_path / "split"
    run(compose([*overrides, "train.max_steps=3"]), split, run_id="b")
    run(compose([*overrides, f"train.resume={split}"]), split, run_id="b", resume_here=True)
    straight_inputs, split_inputs = inputs_per_step[:6], inputs_per_step[6:]
    assert len(split_inputs) == 6 and all(torch.equal(a, b) for a, b in zip(straight_inputs, split_inputs))
    losses = [[e["loss"] for e in read_events(tmp_path / d) if e["event"] == "train"] for d in ("straight", "split")]
    assert losses[0] == losses[1]


def test_max_tokens_caps_the_run(smoke_cfg, tmp_path):
    smoke_cfg.train.max_tokens = 5 * 2 * 32 + 7  # room for 5 whole steps
    result, *_ = _train(smoke_cfg, tmp_path / "run")
    assert result.state.step == 5 and result.status == "finished"


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """~6k tokens of text: the train split ends after a few tiny steps."""
    root = tmp_path_factory.mktemp("small")
    (root / "text.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(200)))
    return prepare_data(DataConfig(source=str(root / "text.txt"), prepared_dir=str(root / "prepared"),
                                   val_fraction=0.2), progress=False)


@pytest.mark.parametrize("policy", ["stop", "next_epoch"])
def test_end_of_train_split(smoke_cfg, tmp_path, small_data, policy):
    cfg = smoke_cfg
    cfg.train.batch_size, cfg.train.seq_len, cfg.train.max_steps = 4, 64, 40
    cfg.train.data_end = policy
    num_train = ShardedTokenDataset(small_data, "train").num_tokens
    steps_per_epoch = (num_train - 1) // (4 * 64)
    result, _, loader, events = _train(cfg, tmp_path / "run", data=small_data)
    if policy == "stop":
        assert result.status == "end_of_data" and result.state.step == steps_per_epoch
        assert [e["event"] for e in events][-2:] == ["eval", "checkpoint"]
    else:
        assert result.status == "finished" and result.state.step == 40
        epochs = [e["epoch"] for e in events if e["event"] == "epoch"]
        assert epochs == list(range(1, 1 + len(epochs))) and len(epochs) == loader.epoch >= 1


def test_eval_reads_the_same_val_batches_each_time(smoke_cfg, embedded_data):
    ds = ShardedTokenDataset(embedded_data, "val")
    loader = TokenDataLoader(ds, 2, 32)
    model = build_model(smoke_cfg.model, ds.vocab_size)
    first = evaluate(model, loader, 3, torch.device("cpu"), contextlib.nullcontext())
    loader.next_batch()  # wherever the cursor is left, the next eval starts from the beginning again
    assert evaluate(model, loader, 3, torch.device("cpu"), contextlib.nullcontext()) == first
    assert not model.training


def test_profile_window_writes_a_chrome_trace(smoke_cfg, tmp_path):
    cfg = smoke_cfg
    cfg.train.max_steps = 6
    cfg.train.profile.enabled, cfg.train.profile.wait, cfg.train.profile.warmup, cfg.train.profile.active = True, 1, 1, 2
    run(cfg, tmp_path / "run", run_id="p")
    traces = list((tmp_path / "run" / "profile").iterdir())
    assert [t.name for t in traces] == ["trace_steps3-4.json"]
    trace = json.loads(traces[0].read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("ProfilerStep#" in n for n in names) and any(n.startswith("aten::") for n in names)


@pytest.mark.parametrize("steps,traces", [(3, ["trace_steps3-3.json"]), (2, [])])
def test_a_session_that_ends_inside_or_before_the_profile_window(smoke_cfg, tmp_path, caplog, steps, traces):
    """train.max_tokens ends the run after `steps` of the window 3-4: the trace holds the attempts
    recorded and is named by them; none recorded, none written (it would hold only the final eval)."""
    cfg = smoke_cfg
    cfg.train.max_steps = 6
    cfg.train.max_tokens = steps * cfg.train.batch_size * cfg.train.seq_len * cfg.train.grad_accum_steps
    cfg.train.profile.enabled, cfg.train.profile.wait, cfg.train.profile.warmup, cfg.train.profile.active = True, 1, 1, 2
    run(cfg, tmp_path / "run", run_id="p")
    assert read_events(tmp_path / "run")[-1]["step"] == steps
    profile_dir = tmp_path / "run" / "profile"
    if traces:
        assert sorted(t.name for t in profile_dir.iterdir()) == traces
        trace = json.loads((profile_dir / traces[0]).read_text())
        assert "ProfilerStep#2" in {e.get("name", "") for e in trace["traceEvents"]}  # attempt 3
    else:
        assert not profile_dir.exists()
    warned = "the session ended after 2 optimizer attempt(s), before the profiler's window (attempts 3-4"
    assert (warned in caplog.text) == (not traces)


def test_bf16_autocast_on_cpu_when_asked(smoke_cfg, tmp_path):
    smoke_cfg.train.precision, smoke_cfg.train.max_steps = "bf16", 2
    run(smoke_cfg, tmp_path / "run", run_id="b")
    start = read_events(tmp_path / "run")[0]
    assert start["precision"] == "bf16"
    assert math.isfinite(read_events(tmp_path / "run")[-1]["val_loss"])


def test_peak_memory_is_reported_for_cuda_devices_only(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: seen.append(device) or 3 * 2**30 + 2**28)
    assert trainer_mod.peak_memory_gib(torch.device("cuda", 1)) == 3.25
    assert seen == [torch.device("cuda", 1)]
    assert trainer_mod.peak_memory_gib(torch.device("cpu")) is None


class _Cycle:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_prepare_for_training_freezes_startup_objects_and_a_finished_job_releases_them(compose):
    """After prepare_for_training the model and what existed before it are out of the collector's
    reach (a full collection no longer walks them); release_process_state, which ends every job of a
    sweep, gives their reference cycles back to the collector."""
    import gc
    import weakref

    from kimik3.train import release_process_state

    root = compose(["model=kimi_k3_tiny", *TINY_TRAIN])
    model, _, step, _ = _one_batch_stepper(root)
    cycle = _Cycle()
    alive = weakref.ref(cycle)
    trainer_mod.prepare_for_training(model, root.train)
    assert gc.get_freeze_count() > 0
    tracked = {id(o) for o in gc.get_objects()}
    assert id(model) not in tracked and id(model.embed.weight) not in tracked
    step(0)  # what the steps allocate is still tracked and collected as usual
    del cycle
    gc.collect()
    assert alive() is not None  # frozen: its cycle waits
    release_process_state(torch.device("cpu"))
    assert gc.get_freeze_count() == 0 and alive() is None
