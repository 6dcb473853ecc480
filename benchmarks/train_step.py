"""Training-step throughput of a model preset, optionally beside a peer of the same shape, one process.

    python benchmarks/train_step.py --model kda_dense_1b --seq 8192 --peer fla --out dense_8k.json
    python benchmarks/train_step.py --model kimi_3b_a1b --seq 8192 --peer hf_kimi_linear --profile
    python benchmarks/train_step.py --model kimi_k3_tiny --batch 2 --seq 64 --steps 2 --profile   # CPU

The timed step is `kimik3.trainer.train_step`, the function kimik3-train's loop calls (schedule,
forward + backward under the recipe's autocast, grad clip, finiteness check, optimizer, QK-Clip,
MoE bias update, zero_grad), on a model and optimizer built as train.py builds them
(`seed_everything`, `runs.session.build_training_model`: under the device, with train.compile's
regional compile; `build_optimizer`) from the recipe `model=<preset> <overrides>` composes to. Only
the batches differ: random tokens instead of the data loader.

Reported (JSON, one object; also --out): tokens/s and step ms over --steps steps after --warmup,
peak GPU memory over the whole run (optimizer state included), seconds from process start to the
first finished optimizer step, model FLOPs per token (kimik3.models.flops: the formula is in its
docstring), MFU against 989 TFLOP/s (H200 dense bf16) and against a bf16 matmul rate measured in
this process, and with --profile a per-component breakdown of device time from torch.profiler and
(CUDA) the GPU's idle time on a timeline of two more steps, with the kernels it waited to be launched
(kimik3.runs.gpu_idle); with --host-profile N, N more steps under cProfile: the host's collector
pauses, heaviest functions and Triton launches by call site (kimik3.runs.host_profile).

The breakdown attributes each kernel to the innermost module that launched it: forward kernels by
module-scope ranges opened by forward hooks, backward kernels through the autograd sequence number
of the forward op that recorded their node. The same classifier runs on the peers (by class
names), so their breakdowns compare component by component.

--peer fla|llama|hf_kimi_linear builds the peer of the same shape (fla's KDAForCausalLM,
transformers' LlamaForCausalLM with SDPA, transformers' KimiLinearForCausalLM) after our model is
freed, times the step ../shared/bench/peer_model_train.py times (fused AdamW, under our step's
autocast: bf16 on CUDA by default, as there) and adds ratios (ours / peer).
"""

from __future__ import annotations

import os
import time


def _process_start() -> float:
    """Unix time this process started (/proc), else now (the module's first line)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return time.time()


PROCESS_START = _process_start()

import argparse  # noqa: E402 (timed from before the heavy imports)
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch import nn  # noqa: E402

from kimik3.config.paths import CONF_DIR, model_presets  # noqa: E402
from kimik3.config.schema import ModelConfig, RootConfig  # noqa: E402
from kimik3.config.store import register_configs  # noqa: E402
from kimik3.config.validate import resolve_device, resolve_precision, validate  # noqa: E402
from kimik3.distributed import setup_distributed  # noqa: E402
from kimik3.models.flops import flops_per_token, parameter_counts  # noqa: E402
from kimik3.optim import build_optimizer  # noqa: E402
from kimik3.runs import gpu_idle as idle, host_profile as host  # noqa: E402
from kimik3.runs.session import build_training_model, seed_everything  # noqa: E402
from kimik3.trainer import autocast_for, peak_memory_gib, prepare_for_training, train_step  # noqa: E402

H200_BF16_FLOPS = 989e12
"""Dense bf16 peak of an H200 (SXM), the MFU reference of the issue and the peer anchors."""
PEERS = ("fla", "llama", "hf_kimi_linear")


def load_config(model: str, batch: int, seq: int, overrides: list[str]) -> RootConfig:
    """The validated RootConfig `kimik3-train model=<model> train.batch_size=.. train.seq_len=.. <overrides>` runs."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        dcfg = compose(config_name="train", overrides=[
            f"model={model}", f"train.batch_size={batch}", f"train.seq_len={seq}", *overrides])
    cfg = OmegaConf.to_object(dcfg)
    validate(cfg)
    return cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device) -> float:
    """Measured bf16 (CUDA) / fp32 (CPU) matmul FLOP/s on square operands: the card's practical peak."""
    n, reps = (8192, 10) if device.type == "cuda" else (256, 5)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------
# Component breakdown
# ----------------------------------------------------------------------------------------------
COMPONENTS = ("kda kernel", "short conv", "kda pointwise", "projections", "attention (MLA/SDPA)", "qk-clip max logit",
              "moe router", "moe dispatch", "moe experts", "dense ffn", "norms/gates", "loss (head + CE)", "embedding",
              "residual/other (block)", "optimizer", "grad norm/clip", "qk-clip + step end", "other")
_STEP_RANGES = {"kimik3::grad_norm_clip": "grad norm/clip", "kimik3::qk_clip": "qk-clip + step end",
                "kimik3::step_end": "qk-clip + step end", "kimik3::max_logit": "qk-clip max logit"}
"""Profiler ranges trainer.train_step opens around its non-model parts, and MLA around QK-Clip's
exact max-logit pass (the statistic's cost, reported apart from the attention it shadows). "grad
norm/clip" is the norm and the clip factor; the optimizer step applies the factor, so the scaling
counts as "optimizer"."""
_CLASS_RULES: tuple[tuple[str, str], ...] = (
    # (regex on the module class name, component), first match wins; Linear layers are resolved by context.
    (r"Embedding", "embedding"),
    (r"Experts$", "moe experts"),
    (r"Router|TopkRouter|MoEGate|Gate$", "moe router"),
    (r"MoE|SparseMoe", "moe dispatch"),
    (r"Norm", "norms/gates"),
    (r"ShortConv|Conv1d", "short conv"),
    (r"KDA|DeltaAttention|KimiDelta", "kda pointwise"),
    (r"Attention|MLA", "attention (MLA/SDPA)"),
    (r"SwiGLU|MLP", "dense ffn"),
    (r"Block|DecoderLayer|Layer$", "residual/other (block)"),
    (r"ForCausalLM|KimiK3|Model$", "loss (head + CE)"),
)


def _module_labels(model: nn.Module) -> dict[nn.Module, str]:
    """Component of every module of `model` (see _CLASS_RULES; nn.Linear by its enclosing module)."""
    labels: dict[nn.Module, str] = {}

    def visit(module: nn.Module, name: str, enclosing: str) -> None:
        cls = type(module).__name__
        if isinstance(module, nn.Linear):
            if name.endswith("lm_head"):
                label = "loss (head + CE)"
            elif enclosing in ("moe dispatch", "moe experts"):
                label = "moe experts"  # shared experts
            elif enclosing in ("dense ffn", "moe router"):
                label = enclosing
            else:
                label = "projections"
        else:
            label = next((comp for pattern, comp in _CLASS_RULES if re.search(pattern, cls)), enclosing)
        labels[module] = label
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}", label)

    visit(model, "", "other")
    return labels


_SCOPE = "k3bench::"


def _install_scopes(model: nn.Module) -> list:
    """Forward hooks that open a profiler range '<_SCOPE><component>' around every module's forward."""
    handles = []
    for module, label in _module_labels(model).items():
        def pre(mod, args, label=label):  # noqa: ANN001
            rf = torch.autograd.profiler.record_function(_SCOPE + label)
            rf.__enter__()
            mod.__dict__.setdefault("_k3bench_rf", []).append(rf)

        def post(mod, args, out):  # noqa: ANN001
            mod.__dict__["_k3bench_rf"].pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


_GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|aten::mm|aten::addmm|aten::bmm", re.I)
_KDA_KERNEL = re.compile(r"chunk_|kda|delta|recompute_w_u|solve_tril|wy_", re.I)
"""Kernel names of the KDA ops (ours and fla's); inside a KDA scope any Triton launch counts too."""


def _classify(event, seq_scope: dict[int, str]) -> tuple[str, bool, bool]:
    """(component of the innermost scope, a convolution op on the way, launched by Triton) for one CPU
    event that launched kernels; backward events take the scope of their forward op."""
    scope, backward_seq, conv, triton = None, None, False, event.name.startswith("cuLaunchKernel")
    node = event
    while node is not None:
        name = node.name
        if name.startswith(_SCOPE):
            scope = scope or name[len(_SCOPE):]
        else:
            conv = conv or "conv" in name.lower()
            if name.startswith("Optimizer.step") or name.startswith("Optimizer.zero_grad"):
                return "optimizer", False, triton
            if name in _STEP_RANGES:
                return _STEP_RANGES[name], False, triton
            if backward_seq is None and name.startswith("autograd::engine::evaluate_function"):
                backward_seq = node.sequence_nr
        node = node.cpu_parent
    if scope is None and backward_seq is not None:
        scope = seq_scope.get(backward_seq)
    return scope or "", conv, triton


def _component(scope: str, conv: bool, triton: bool, kernel: str) -> str:
    """Refine a scope by the kernel: inside a KDA mixer, convolutions and the KDA op itself."""
    if scope.startswith("kda") or scope == "short conv":
        if conv or scope == "short conv":
            return "short conv"
        if triton or _KDA_KERNEL.search(kernel):
            return "kda kernel"
        if _GEMM_KERNEL.search(kernel):
            return "projections"  # the mixer's fused input projection (one F.linear on stacked weights)
    return scope or "other"


def breakdown(prof, steps: int) -> dict:
    """Per-step device ms by component, the top kernels overall and the top five of each component, from a
    finished torch.profiler run."""
    events = prof.events()
    seq_scope: dict[int, str] = {}
    for ev in events:  # forward ops: sequence number -> the scope they ran in
        if ev.sequence_nr >= 0 and not ev.name.startswith("autograd::engine"):
            node = ev
            while node is not None and not node.name.startswith(_SCOPE):
                node = node.cpu_parent
            if node is not None:
                seq_scope.setdefault(ev.sequence_nr, node.name[len(_SCOPE):])
    by_comp: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    calls: dict[str, int] = defaultdict(int)
    cuda = any(ev.kernels for ev in events)
    for ev in events:
        if cuda:
            items = [(k.name, k.duration) for k in ev.kernels]
        elif ev.device_type == torch.autograd.DeviceType.CPU and not ev.cpu_children and ev.name.startswith("aten::"):
            items = [(ev.name, ev.self_cpu_time_total)]  # CPU: leaf aten ops stand in for kernels
        else:
            items = []
        if not items:
            continue
        scope, conv, triton = _classify(ev, seq_scope)
        for name, us in items:
            comp = _component(scope, conv, triton, name)
            by_comp[comp] += us / 1e3 / steps
            by_kernel[name[:120]][comp] += us / 1e3 / steps
            calls[name[:120]] += 1
    total = sum(by_comp.values())
    top = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1].values()))[:15]
    return {
        "device_ms_per_step": round(total, 2),
        "components_ms": {c: round(by_comp[c], 2) for c in COMPONENTS if by_comp.get(c)},
        "components_share": {c: round(by_comp[c] / total, 3) for c in COMPONENTS if by_comp.get(c)} if total else {},
        "top_kernels": [{"name": n, "ms_per_step": round(sum(v.values()), 2), "calls_per_step": calls[n] // steps,
                         "component": max(v, key=v.get)} for n, v in top],
        "top_kernels_by_component": {
            comp: [{"name": n, "ms_per_step": round(v[comp], 2)}
                   for n, v in sorted(by_kernel.items(), key=lambda kv: -kv[1].get(comp, 0.0))[:5] if v.get(comp)]
            for comp in COMPONENTS if by_comp.get(comp)},
    }


def profile_steps(step: Callable[[int], None], model: nn.Module, device: torch.device, first: int,
                  steps: int = 2) -> dict:
    """Run `steps` more steps under torch.profiler with module scopes installed: their breakdown. On CUDA
    then `steps` more under a CUDA-only profiler: where on the timeline the GPU waited for the host
    (kimik3.runs.gpu_idle; the scoped run's own host overhead would inflate that; None on the CPU)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    handles = _install_scopes(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            for i in range(steps):
                step(first + i)
            _sync(device)
    finally:
        for h in handles:
            h.remove()
    result = breakdown(prof, steps)
    result["gpu_idle"] = None
    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CUDA]) as timeline:
            for i in range(steps):
                step(first + steps + i)
            _sync(device)
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            timeline.export_chrome_trace(str(trace))
            result["gpu_idle"] = idle.gpu_idle(json.loads(trace.read_text()), per=steps)
    return result


# ----------------------------------------------------------------------------------------------
# Timing loop shared by ours and the peers
# ----------------------------------------------------------------------------------------------
def time_steps(step: Callable[[int], None], device: torch.device, warmup: int, steps: int, tokens: int,
               started: float) -> dict:
    """Warm-up steps (the first one timed from `started`), then `steps` timed steps."""
    step(0)
    _sync(device)
    first_step_s = time.time() - started
    for i in range(1, warmup):
        step(i)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    _sync(device)
    seconds = (time.perf_counter() - t0) / steps
    return {"step_ms": round(seconds * 1e3, 2), "tokens_per_s": round(tokens / seconds, 1),
            "first_step_s": round(first_step_s, 2)}


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_ours(cfg: RootConfig, vocab: int, device: torch.device, args: argparse.Namespace) -> dict:
    """Build as train.py does and time `trainer.train_step` (see the module docstring)."""
    t = cfg.train
    precision = resolve_precision(t.precision, device)
    seed_everything(t.seed, t.deterministic)  # as runs/session.py: the seed and train.deterministic's switches
    build_t0 = time.time()
    # runs/session.py's own build: under the device, model.init_from, train.compile, parallelize (a no-op here)
    model = build_training_model(cfg, vocab, setup_distributed("none", device), precision)
    optimizer, _ = build_optimizer(model, t)
    build_s = time.time() - build_t0
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = autocast_for(device, precision)
    gen = torch.Generator().manual_seed(t.seed)
    tokens = torch.randint(0, vocab, (t.grad_accum_steps, t.batch_size, t.seq_len + 1), generator=gen)
    micro = [(tok[:, :-1], tok[:, 1:]) for tok in tokens]
    prepare_for_training(model, t)
    last: dict = {}

    def step(i: int) -> None:
        result = train_step(model, optimizer, micro, t, i, params=params, device=device, autocast=autocast)
        if "result" in last:  # the trainer reads each step's outcome once the next step is queued
            last["result"].outcome.read()
        last["result"] = result

    _reset_memory(device)
    out = time_steps(step, device, args.warmup, args.steps, t.batch_size * t.seq_len * t.grad_accum_steps,
                     PROCESS_START)
    values = last["result"].outcome.read()
    out.update(peak_gib=peak_memory_gib(device), build_s=round(build_s, 2), precision=precision,
               loss=round(values.loss, 4) if math.isfinite(values.loss) else None, applied=not values.skipped)
    # A skipped update (non-finite loss or grad norm) leaves the optimizer out of the timed step.
    out["valid"] = out["applied"] and out["loss"] is not None
    if args.profile:
        out["profile"] = profile_steps(step, model, device, args.warmup + args.steps)
    if args.host_profile:
        out["host_profile"] = host.host_profile(step, args.warmup + args.steps + 4, args.host_profile)
        _sync(device)
    del model, optimizer, params, last
    gc.unfreeze()  # prepare_for_training froze our model out of the cyclic collector: let it go before the peer
    _reset_memory(device)
    return out


def build_peer(kind: str, m: ModelConfig, vocab: int, seq: int) -> nn.Module:
    """The peer of the same shape as `m` (see the module docstring and ../shared/bench/peer_model_train.py)."""
    if kind == "fla":
        from fla.models import KDAConfig, KDAForCausalLM

        return KDAForCausalLM(KDAConfig(
            hidden_size=m.hidden_size, num_hidden_layers=m.num_layers, num_heads=m.num_heads, head_dim=m.head_dim,
            vocab_size=vocab, intermediate_size=m.intermediate_size, hidden_ratio=None, fuse_cross_entropy=True))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                             num_attention_heads=m.num_heads, num_key_value_heads=m.num_heads,
                             head_dim=m.head_dim, vocab_size=vocab, intermediate_size=m.intermediate_size,
                             max_position_embeddings=max(65536, seq))
        config._attn_implementation = "sdpa"
        return LlamaForCausalLM(config)
    if kind == "hf_kimi_linear":
        from transformers import KimiLinearConfig, KimiLinearForCausalLM

        if m.num_experts == 0:
            raise ValueError(f"--peer hf_kimi_linear needs a MoE preset; model {m.name} has num_experts=0")
        config = KimiLinearConfig(
            hidden_size=m.hidden_size, num_hidden_layers=m.num_layers, num_attention_heads=m.mla_num_heads or m.num_heads,
            num_key_value_heads=m.mla_num_heads or m.num_heads, vocab_size=vocab,
            intermediate_size=m.intermediate_size, moe_intermediate_size=m.moe_intermediate_size,
            num_local_experts=m.num_experts, num_experts_per_tok=m.top_k, n_shared_experts=m.num_shared_experts,
            kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim, linear_head_dim=m.head_dim, linear_num_heads=m.num_heads,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
        config._attn_implementation = "sdpa"
        return KimiLinearForCausalLM(config)
    raise ValueError(f"--peer {kind!r} is not one of {list(PEERS)}")


def bench_peer(kind: str, cfg: RootConfig, vocab: int, device: torch.device, args: argparse.Namespace) -> dict:
    """The peer anchors' step: forward with labels under our step's autocast (bf16 by default on CUDA, as
    the anchors ran), backward, fused AdamW, zero_grad. The autocast follows train.precision so that a
    ratio never sets an fp32 step beside a bf16 one."""
    t = cfg.train
    precision = resolve_precision(t.precision, device)
    seed_everything(0, False)  # the peer anchors' defaults, whatever train.deterministic set for ours
    model = build_peer(kind, cfg.model, vocab, t.seq_len).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randint(0, vocab, (t.batch_size, t.seq_len), device=device)
    autocast = autocast_for(device, precision)

    def step(i: int) -> None:
        with autocast:
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _reset_memory(device)
    started = time.time()
    out = time_steps(step, device, args.warmup, args.steps, t.batch_size * t.seq_len, started)
    out["first_step_s_after_build"] = out.pop("first_step_s")
    out.update(peak_gib=peak_memory_gib(device), params_total=sum(p.numel() for p in model.parameters()),
               precision=precision)
    if args.profile:
        out["profile"] = profile_steps(step, model, device, args.warmup + args.steps)
    del model, optimizer
    _reset_memory(device)
    return out


def run(args: argparse.Namespace) -> dict:
    cfg = load_config(args.model, args.batch, args.seq, args.overrides)
    device = resolve_device(cfg.train.device)
    vocab = cfg.model.vocab_size or args.vocab
    fpt = flops_per_token(cfg.model, vocab, cfg.train.seq_len)
    counts = parameter_counts(cfg.model, vocab)
    result: dict = {
        "model": args.model, "overrides": args.overrides, "batch": cfg.train.batch_size, "seq": cfg.train.seq_len,
        "grad_accum_steps": cfg.train.grad_accum_steps, "vocab": vocab, "optimizer": cfg.train.optimizer,
        "compile": cfg.train.compile, "activation_checkpointing": cfg.train.activation_checkpointing,
        "kda_implementation": cfg.model.kda_implementation, "device": _device_name(device),
        "torch": torch.__version__, "params_total": counts["total"], "params_activated": counts["activated"],
        "flops_per_token": fpt, "warmup": args.warmup, "steps": args.steps,
    }
    ours = bench_ours(cfg, vocab, device, args)
    rate = matmul_rate(device)
    ours["mfu_989"] = round(fpt * ours["tokens_per_s"] / H200_BF16_FLOPS, 4)
    ours["mfu_measured_matmul"] = round(fpt * ours["tokens_per_s"] / rate, 4)
    result.update(matmul_tflops=round(rate / 1e12, 1), ours=ours)
    if args.peer:  # ours first, so a peer that autotunes for minutes (fla) or fails leaves our figure seen
        print(f"ours: {ours['tokens_per_s']:,.0f} tokens/s, {ours['step_ms']} ms/step, peak {ours['peak_gib']} GiB; "
              f"timing peer {args.peer} next", file=sys.stderr, flush=True)
        peer = bench_peer(args.peer, cfg, vocab, device, args)
        result["peer"] = {"kind": args.peer, **peer}
        result["ratios"] = {
            "tokens_per_s": round(ours["tokens_per_s"] / peer["tokens_per_s"], 3),
            "peak_memory": round(ours["peak_gib"] / peer["peak_gib"], 3) if peer["peak_gib"] else None,
        }
    return result


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def _summary(r: dict) -> str:
    o = r["ours"]
    line = (f"{r['model']} B={r['batch']} T={r['seq']} on {r['device']}: {o['tokens_per_s']:,.0f} tokens/s, "
            f"{o['step_ms']} ms/step, peak {o['peak_gib']} GiB, first step {o['first_step_s']} s after start, "
            f"MFU {o['mfu_989']:.1%} of 989 TFLOP/s ({o['mfu_measured_matmul']:.1%} of the measured "
            f"{r['matmul_tflops']} TFLOP/s)")
    if not o["valid"]:
        line += "\n  INVALID: the last timed step skipped its update (non-finite loss or grad norm)"
    if "peer" in r:
        p = r["peer"]
        line += (f"\n  peer {p['kind']}: {p['tokens_per_s']:,.0f} tokens/s, peak {p['peak_gib']} GiB; "
                 f"ours/peer tokens/s x{r['ratios']['tokens_per_s']}, memory x{r['ratios']['peak_memory']}")
    if "host_profile" in o:
        line += "\n  ours " + host.format_report(o["host_profile"]).replace("\n", "\n  ")
    for who, part in (("ours", o), ("peer", r.get("peer", {}))):
        prof = part.get("profile")
        if prof:
            comps = ", ".join(f"{k} {v}" for k, v in prof["components_ms"].items())
            line += f"\n  {who} device ms/step {prof['device_ms_per_step']}: {comps}"
            if prof["gpu_idle"] is not None:
                line += f"\n  {who} per step: " + idle.format_report(prof["gpu_idle"]).replace("\n", "\n    ")
    return line


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="kimi_k3_tiny", choices=model_presets(), help="conf/model preset")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=256, help="vocab when the preset leaves it to the data")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (>= 1; the first is the start-up figure)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--peer", choices=PEERS, default=None)
    parser.add_argument("--profile", action="store_true", help="2 more steps under torch.profiler: the breakdown")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="N more steps under cProfile: the host's collections, functions and Triton launches")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. train.compile=true train.optimizer=muon")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error(f"--warmup={args.warmup} and --steps={args.steps} must both be >= 1")
    if args.host_profile < 0:
        parser.error(f"--host-profile={args.host_profile} must be >= 0 (steps under cProfile; 0: none)")
    result = run(args)
    print(_summary(result), file=sys.stderr)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if not result["ours"]["valid"]:
        sys.exit(2)
    return result


if __name__ == "__main__":
    main()
