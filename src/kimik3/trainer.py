"""The training loop: TrainState and `train()`.

One optimizer attempt (a "step"; skipped ones count, so the schedule, the budget and the profiler
window advance the same way whether or not an update was applied):
  1. lr = base_lr * lr_multiplier(step) for every group
  2. grad_accum_steps micro-batches: forward under autocast, (loss / accum).backward()
  3. grad norm over all parameters and, with train.grad_clip set, the clip factor
     c = min(grad_clip / (norm + 1e-6), 1); the optimizer step applies it as it reads the gradients
     (fused AdamW: its grad_scale) rather than a pass of its own scaling them in place first
  4. skip = the summed loss or the grad norm is not finite, decided on the device:
       optimizer.step(skip=skip, clip_coef=c) -> clip_qk(keep=~skip) -> model.on_step_end(~skip);
       a skipped step changes no parameter, optimizer state or router bias.
  5. the step's loss, grad norm, skip flag and MLA max logits are copied to the host without waiting
     (StepOutcome) and read one step later, after the next step is queued: a skipped step is then
     counted and logged as a "skip" event, clipped heads as "qk_clip" events, each with its own step.
  6. every log_interval steps: the only syncs (loss, grad norm, tokens/s, MFU, model diagnostics)
     -> a "train" event; every eval_interval: eval; every checkpoint_interval: save.
No step waits for the device: a per-step sync (an earlier version read the skip decision on the
host, as GradScaler does) drained the queue each step, and the next step's forward, whose many small
kernels the host launches more slowly than the GPU runs them, then left the GPU idle.

Evaluation rewinds the val loader and reads the same first eval_steps batches every time, so val
losses of one run (and across runs on the same data) are comparable point by point.

End of the train split: data_end=next_epoch rewinds it (an "epoch" event) and keeps going;
data_end=stop ends the run with status end_of_data after its last whole step.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import Tensor
from torch.profiler import record_function

from kimik3.config.schema import TrainConfig
from kimik3.config.validate import planned_steps, resolve_precision
from kimik3.data import EndOfData, TokenDataLoader
from kimik3.distributed import (full_value, mean_over_ranks, replicate_plain_tensors, set_grad_sync,
                                sum_step_trackers)
from kimik3.models import LanguageModel
from kimik3.models.kda import KDAMixer
from kimik3.ops.kda.device_check import check_triton_kda
from kimik3.optim import MuonAdamW, clip_qk, lr_multiplier, qk_clip_events
from kimik3.optim.qk_clip import is_mla
from kimik3.runs.metrics import MetricsWriter, mfu
from kimik3.runs.profile import StepProfiler
from kimik3.runs.progress import Progress


@dataclass
class TrainState:
    """Counters that make a resumed run continue exactly where it stopped (saved in checkpoints)."""

    step: int = 0
    """Optimizer attempts done, skipped ones included (the schedule's step)."""
    tokens: int = 0
    """Train tokens consumed (all ranks together)."""
    skipped: int = 0
    """Attempts whose update was skipped for a non-finite loss or gradient."""
    train_loss: Optional[float] = None
    """Mean train loss of the last log window."""
    val_loss: Optional[float] = None
    """Last eval's val loss."""
    window: Optional[dict] = None
    """The open log window's sums when the checkpoint was taken (`_Window.state_dict`): a resume from a
    step between two log steps (a crash's, or a longer plan after a final step off the log interval)
    then logs the same window means as an uninterrupted run. None: an empty window."""

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class TrainResult:
    status: str
    """finished | end_of_data"""
    state: TrainState


@dataclass
class Throughput:
    """What MFU needs besides tokens/s: FLOPs per token (None: unknown) and the named peak."""

    flops_per_token: Optional[float] = None
    peak: Optional[tuple[str, float]] = None
    world_size: int = 1


def train(model: LanguageModel, optimizer: torch.optim.Optimizer, train_loader: TokenDataLoader,
          val_loader: TokenDataLoader, cfg: TrainConfig, state: TrainState, *, device: torch.device,
          precision: str, metrics: MetricsWriter, save: Callable[[TrainState], object],
          progress: Progress, profiler: Optional[StepProfiler] = None,
          throughput: Optional[Throughput] = None) -> TrainResult:
    """Run optimizer steps from `state.step` to the plan; `save(state)` writes a checkpoint."""
    throughput = throughput or Throughput()
    tokens_per_step = train_loader.tokens_per_step * cfg.grad_accum_steps
    last_step = planned_steps(cfg, tokens_per_step)
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = autocast_for(device, precision)
    batches = _overfit_batches(train_loader, cfg.grad_accum_steps) if cfg.overfit_batch else None
    window = _Window(device, state.window)
    status = "finished"
    prepare_for_training(model, cfg)
    pending: Optional[_Pending] = None  # the last step's outcome, read after the next step is queued

    def settle() -> None:
        nonlocal pending
        if pending is not None:
            _settle(pending, model, cfg, metrics, progress, state)
            pending = None

    while state.step < last_step:
        micro = batches if batches is not None else _micro_batches(train_loader, cfg, metrics, state)
        result = train_step(model, optimizer, micro, cfg, state.step, params=params, device=device,
                            autocast=autocast)
        if result.micro_batches < cfg.grad_accum_steps:  # data_end=stop and the split ran out mid-step
            status = "end_of_data"
            break
        settle()
        pending = _Pending(state.step + 1, state.tokens + tokens_per_step, result.outcome)
        window.add(result.loss, result.grad_norm, result.skipped)
        state.step += 1
        state.tokens += tokens_per_step
        window.tokens += tokens_per_step
        if profiler is not None:
            profiler.step()
        progress.advance()
        final = state.step == last_step
        log_now = state.step % cfg.log_interval == 0 or final
        eval_now = state.step % cfg.eval_interval == 0 or final
        save_now = state.step % cfg.checkpoint_interval == 0 or final
        if log_now or eval_now or save_now:
            settle()  # logs, eval and checkpoints see every step's skips and clip events
        if log_now:
            _log_train(model, optimizer, metrics, progress, state, window, throughput, cfg.log_interval)
        if eval_now:
            state.val_loss = evaluate(model, val_loader, cfg.eval_steps, device, autocast)
            metrics.log("eval", state.step, state.tokens, {"val_loss": state.val_loss})
            progress.message(f"eval step {state.step}: val_loss {state.val_loss:.4f}")
            model.train()
            track_max_logits(model, cfg.qk_clip_threshold is not None)
            window.restart_clock()
        if save_now:
            _save(save, metrics, progress, state, window)
            window.restart_clock()
    settle()
    if status == "end_of_data" and state.step > 0:
        if state.step % cfg.log_interval:
            _log_train(model, optimizer, metrics, progress, state, window, throughput, cfg.log_interval)
        state.val_loss = evaluate(model, val_loader, cfg.eval_steps, device, autocast)
        metrics.log("eval", state.step, state.tokens, {"val_loss": state.val_loss})
        _save(save, metrics, progress, state, window)
    return TrainResult(status=status, state=state)


@dataclass
class StepResult:
    """What one optimizer attempt leaves behind; tensors stay on the device (no sync)."""

    micro_batches: int
    """Micro-batches run; fewer than train.grad_accum_steps: the split ended mid-step, nothing applied."""
    loss: Optional[Tensor] = None
    """Mean lm loss over the step's micro-batches (and ranks), 0-dim."""
    grad_norm: Optional[Tensor] = None
    """Total grad norm before clipping, 0-dim."""
    skipped: Optional[Tensor] = None
    """0-dim bool, True: non-finite loss or grad norm, the update was skipped."""
    outcome: Optional["StepOutcome"] = None
    """The same values (and the MLA max logits) on their way to the host."""


@dataclass(frozen=True)
class StepValues:
    """A step's outcome, read on the host."""

    loss: float
    grad_norm: float
    skipped: bool
    max_logits: Optional[list[float]]
    """Every MLA head's max logit (what QK-Clip compared with tau), None with QK-Clip off."""


class StepOutcome:
    """A step's loss, grad norm, skip flag and max logits, copied to pinned host memory as soon as
    they are computed, without waiting. `read()` waits only for that copy (a CUDA event), which the
    trainer calls after queueing the next step, when the copy is long done."""

    def __init__(self, loss: Tensor, grad_norm: Tensor, skipped: Tensor, max_logits: Optional[Tensor]) -> None:
        parts = [loss.float().reshape(1), grad_norm.float().reshape(1), skipped.float().reshape(1)]
        if max_logits is not None:
            parts.append(max_logits.float().flatten())
        packed = torch.cat(parts)
        self._event: Optional[torch.cuda.Event] = None
        if packed.is_cuda:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed
        self._with_logits = max_logits is not None

    def read(self) -> StepValues:
        if self._event is not None:
            self._event.synchronize()
        v = self._host.tolist()
        return StepValues(loss=v[0], grad_norm=v[1], skipped=v[2] != 0.0,
                          max_logits=v[3:] if self._with_logits else None)


def train_step(model: LanguageModel, optimizer: MuonAdamW, micro_batches: Iterable[tuple[Tensor, Tensor]],
               cfg: TrainConfig, step: int, *, params: list[Tensor], device: torch.device,
               autocast: contextlib.AbstractContextManager) -> StepResult:
    """One optimizer attempt, steps 1-5 of the module docstring (schedule, forward/backward over the
    micro-batches, grad norm and clip factor, skip decision, optimizer (which applies the clip),
    QK-Clip, MoE bias update, zero_grad), queued without a host sync.

    `train()` and benchmarks/train_step.py both call this, so the benchmark times the step that
    kimik3-train runs. `step`: optimizer attempts done so far (the schedule's position).
    """
    mult = lr_multiplier(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * mult
    lm_sum = torch.zeros((), device=device)
    n_micro = 0
    for inputs, targets in micro_batches:
        set_grad_sync(model, n_micro == cfg.grad_accum_steps - 1)  # DDP: one all-reduce per step
        with autocast:
            out = model(inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True))
        (out.loss / cfg.grad_accum_steps).backward()
        lm_sum += out.lm_loss.detach()
        n_micro += 1
    if n_micro < cfg.grad_accum_steps:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(micro_batches=n_micro)
    # Profiler ranges (benchmarks/train_step.py reads them). This one holds the norm and the clip
    # factor; the scaling itself runs inside optimizer.step (its "optimizer" line).
    with record_function("kimik3::grad_norm_clip"):
        grad_norm = _grad_norm(params)
        clip_coef = None if cfg.grad_clip is None else clip_coefficient(grad_norm, cfg.grad_clip)
    loss = mean_over_ranks(lm_sum / cfg.grad_accum_steps)  # all ranks: one skip decision, the global mean
    applied = torch.isfinite(loss + grad_norm)
    skipped = ~applied
    optimizer.step(skip=skipped, clip_coef=clip_coef)
    with record_function("kimik3::qk_clip"), replicate_plain_tensors():  # FSDP: per-row scales meet shards
        max_logits = clip_qk(model, cfg.qk_clip_threshold, keep=applied)
    sum_step_trackers(model)  # MoE load over all ranks before the router-bias update
    with record_function("kimik3::step_end"):
        model.on_step_end(applied)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(micro_batches=n_micro, loss=loss, grad_norm=grad_norm, skipped=skipped,
                      outcome=StepOutcome(loss, grad_norm, skipped, max_logits))


@dataclass(frozen=True)
class _Pending:
    """A queued step whose outcome the host has not read yet."""

    step: int
    tokens: int
    outcome: StepOutcome


def _settle(pending: _Pending, model: LanguageModel, cfg: TrainConfig, metrics: MetricsWriter,
            progress: Progress, state: TrainState) -> None:
    """Read a step's outcome (one step late, see the module docstring): count and log a skip, log the
    heads QK-Clip clipped."""
    values = pending.outcome.read()
    if values.skipped:
        state.skipped += 1
        _log_skip(metrics, progress, pending.step, pending.tokens, values, state.skipped)
    elif values.max_logits is not None:
        for event in qk_clip_events(model, values.max_logits, cfg.qk_clip_threshold):
            metrics.log("qk_clip", pending.step, pending.tokens, event)


@torch.no_grad()
def evaluate(model: LanguageModel, val_loader: TokenDataLoader, steps: int, device: torch.device,
             autocast: contextlib.AbstractContextManager) -> float:
    """Mean lm loss over the val split's first `steps` batches (fewer if the split is shorter)."""
    model.eval()
    track_max_logits(model, False)  # eval logits must not feed the next QK-Clip
    val_loader.rewind()
    total, n = torch.zeros((), device=device), 0
    for _ in range(steps):
        try:
            inputs, targets = val_loader.next_batch()
        except EndOfData:
            break
        with autocast:
            total += model(inputs.to(device), targets.to(device)).lm_loss.float()
        n += 1
    return mean_over_ranks(total).item() / n


class _Window:
    """Device-side sums of the current log window (read, with one sync, at log steps).

    A window spans the steps since the last multiple of train.log_interval, and its sums travel in
    checkpoints (TrainState.window), so where a run logs does not depend on where it was resumed."""

    _SUMS = ("loss_sum", "grad_norm", "applied")

    def __init__(self, device: torch.device, saved: Optional[dict] = None) -> None:
        self.device = device
        for name in self._SUMS:  # fp32, as accumulated: a saved sum comes back bit for bit
            setattr(self, name, torch.full((), (saved or {}).get(name, 0.0), device=device))
        self.tokens = 0
        self.restart_clock()

    def state_dict(self) -> dict:
        """The sums as floats, for a checkpoint (one sync; checkpoints sync anyway)."""
        return {name: getattr(self, name).item() for name in self._SUMS}

    def add(self, loss: Tensor, grad_norm: Tensor, skipped: Tensor) -> None:
        """Count an applied step's loss and grad norm; a skipped one's (non-finite) are left out."""
        self.loss_sum += torch.where(skipped, 0.0, loss)
        self.grad_norm = torch.where(skipped, self.grad_norm, grad_norm)
        self.applied += (~skipped).float()

    def restart_clock(self) -> None:
        """Start timing from now (after eval / checkpoint, which are not training throughput)."""
        self.tokens = 0
        self.started = time.perf_counter()

    def take(self, reset: bool = True) -> tuple[Optional[float], float, float]:
        """(mean loss or None if every step was skipped, last grad norm, tokens/s); `reset` starts a new
        window (a run's last step, logged off the interval, keeps its window open for a longer plan)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = max(time.perf_counter() - self.started, 1e-9)
        applied = self.applied.item()
        loss = self.loss_sum.item() / applied if applied else None
        result = (loss, self.grad_norm.item(), self.tokens / seconds)
        if reset:
            self.loss_sum.zero_()
            self.applied.zero_()
        self.restart_clock()
        return result


def _micro_batches(loader: TokenDataLoader, cfg: TrainConfig, metrics: MetricsWriter,
                   state: TrainState) -> Iterator[tuple[Tensor, Tensor]]:
    """cfg.grad_accum_steps batches; at the end of the split: rewind (next_epoch) or stop early."""
    for _ in range(cfg.grad_accum_steps):
        try:
            yield loader.next_batch()
        except EndOfData:
            if cfg.data_end == "stop":
                return
            loader.rewind()
            metrics.log("epoch", state.step, state.tokens, {"epoch": loader.epoch})
            yield loader.next_batch()


def _overfit_batches(loader: TokenDataLoader, n: int) -> list[tuple[Tensor, Tensor]]:
    """The fixed micro-batches `overfit_batch` repeats: the split's first n, read once. Read from the
    split's start, not from the cursor: a resumed run's restored cursor is already past them (the
    first session read them), and the run must keep repeating the same batch."""
    loader.position = 0
    return [loader.next_batch() for _ in range(n)]


def _grad_norm(params: list[Tensor]) -> Tensor:
    """Total L2 grad norm (a 0-dim tensor, no sync), the same on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    return full_value(torch.nn.utils.get_total_norm(grads))  # FSDP: a DTensor of shard norms -> the global norm


def clip_coefficient(norm: Tensor, clip: float) -> Tensor:
    """The factor global-norm clipping scales every gradient by, min(clip / (norm + 1e-6), 1), as a
    0-dim tensor on the norm's device (no sync), for `MuonAdamW.step(clip_coef=...)`. The same
    expression as torch.nn.utils.clip_grads_with_norm_, so the same bits: 0 for an inf norm, NaN for a
    NaN one (such a step is skipped)."""
    return torch.clamp(clip / (norm + 1e-6), max=1.0)


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The forward's autocast for a resolved precision (bf16: autocast to bfloat16; fp32: none)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def prepare_for_training(model: LanguageModel, cfg: TrainConfig) -> None:
    """The recipe's per-session model switches: train mode, MLA max-logit tracking when QK-Clip is on,
    per-block activation checkpointing, recomputing the KDA conv outputs and chunk states and the MoE's
    GEMM inputs; on CUDA the on-device check of the Triton KDA kernels; and last,
    freeze_startup_objects. `train()` calls it, and so does benchmarks/train_step.py."""
    check_kda_kernels(model, cfg, next(model.parameters()).device)
    blocks = [m for m in model.modules() if hasattr(m, "checkpoint_blocks")]
    if cfg.activation_checkpointing and not blocks:
        raise ValueError(f"train.activation_checkpointing=true but {type(model).__name__} has no blocks to "
                         "checkpoint; use a kimi_k3 model or train.activation_checkpointing=false")
    for module in blocks:
        module.checkpoint_blocks = cfg.activation_checkpointing
    for module in model.modules():
        if hasattr(module, "recompute_conv"):
            module.recompute_conv = cfg.recompute_conv
        if hasattr(module, "recompute_kda_states"):
            module.recompute_kda_states = cfg.recompute_kda_states
        if hasattr(module, "recompute_experts"):
            module.recompute_experts = cfg.recompute_experts
    track_max_logits(model, cfg.qk_clip_threshold is not None)
    model.train()
    freeze_startup_objects()


def freeze_startup_objects() -> None:
    """Collect, then move every object alive now (imported code, the model, its parameters, the
    optimizer, the data pipeline) to the cyclic collector's permanent generation.

    Why: Python's full (generation-2) collection walks every tracked object, and a training session
    holds ~330,000 of them before its first step. Steps of a kimi_3b_a1b-shaped model (all 24 layers,
    tiny widths, on a 2-core CPU) triggered one such collection every 30-60 steps, 117-128 ms each.
    On a GPU that is a stall in whichever step it hits when the host sets the pace (the MoE forward
    does; see kimik3.runs.gpu_idle). After the freeze the full collections walk only what the steps
    allocate: 1.2-1.7 ms each, every ~20 steps, in the same run. Reference counting still frees frozen objects, and each step's
    garbage is still collected. Only reference cycles among the frozen objects wait:
    runs.session.release_process_state unfreezes them between the jobs of a sweep. (gc.freeze is
    what CPython documents for long-lived processes; torchtitan disables the collector instead and
    collects every N steps.)"""
    gc.collect()
    gc.freeze()


def check_kda_kernels(model: LanguageModel, cfg: TrainConfig, device: torch.device) -> None:
    """Run ops/kda/device_check.py once for each distinct Triton KDA layer shape of a model on CUDA, in
    the dtype the step will feed the kernels; a miscompiled build stops the run before its first step
    (KernelCheckError) instead of training on wrong gradients. Under train.recompute_kda_states=null
    both recurrence variants are checked (which one runs depends on each micro-batch's size)."""
    if device.type != "cuda":
        return
    dtype = torch.bfloat16 if resolve_precision(cfg.precision, device) == "bf16" else torch.float32
    keeps = (False, True) if cfg.recompute_kda_states is None else (not cfg.recompute_kda_states,)
    for module in model.modules():
        if isinstance(module, KDAMixer) and module.impl == "triton":
            for keep_states in keeps:
                check_triton_kda(module.num_heads, module.head_dim, dtype, device, gate_form=module.gate_form,
                                 lower_bound=module.gate_lower_bound, keep_states=keep_states)


def track_max_logits(model: LanguageModel, on: bool) -> None:
    """MLA layers record their max logit only when QK-Clip will read it (and never during eval);
    called before the first `train_step` with on = (train.qk_clip_threshold is not None)."""
    for module in model.modules():
        if is_mla(module):
            module.track_max_logits = on


def _log_skip(metrics: MetricsWriter, progress: Progress, step: int, tokens: int, values: StepValues,
              skipped: int) -> None:
    reason = "non-finite loss" if not math.isfinite(values.loss) else "non-finite grad norm"
    metrics.log("skip", step, tokens,
                {"reason": reason, "loss": values.loss, "grad_norm": values.grad_norm, "skipped": skipped})
    progress.message(f"step {step}: update skipped ({reason}); {skipped} skipped so far")


def _log_train(model: LanguageModel, optimizer: torch.optim.Optimizer, metrics: MetricsWriter,
               progress: Progress, state: TrainState, window: _Window, throughput: Throughput,
               log_interval: int) -> None:
    loss, grad_norm, tokens_per_s = window.take(reset=state.step % log_interval == 0)
    lr = optimizer.param_groups[0]["lr"]
    fields = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": round(tokens_per_s, 1),
              "skipped": state.skipped}
    util = mfu(throughput.flops_per_token, tokens_per_s, throughput.peak, throughput.world_size)
    if util is not None:
        fields["mfu"] = round(util, 4)
    peak = peak_memory_gib(next(model.parameters()).device)
    if peak is not None:
        fields["peak_mem_gib"] = peak
    fields.update(model.diagnostics())
    metrics.log("train", state.step, state.tokens, fields)
    if loss is not None:
        state.train_loss = loss
        progress.report(state.step, loss, lr, tokens_per_s)


def peak_memory_gib(device: torch.device) -> Optional[float]:
    """Peak memory this process has allocated on a CUDA device so far (GiB, what sizing a run needs);
    None elsewhere, where torch keeps no such counter."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


def _save(save: Callable[[TrainState], object], metrics: MetricsWriter, progress: Progress,
          state: TrainState, window: _Window) -> None:
    state.window = window.state_dict()
    path = save(state)
    metrics.log("checkpoint", state.step, state.tokens, {"path": str(path)})
    progress.message(f"checkpoint step {state.step}: {path}")
