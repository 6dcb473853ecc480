"""The training step's memory-bound ops against the card's copy bandwidth, at a model preset's shapes.

    python benchmarks/memory_bound_ops.py --model kda_dense_1b --seq 8192 --out ops.json   # CUDA
    python benchmarks/memory_bound_ops.py --model kimi_k3_tiny --seq 64 --iters 2             # CPU smoke run
    python benchmarks/memory_bound_ops.py --conv-dz-tile 16x64x4 32x64x8 32x32x4             # + conv dz tiles

Why: in the kda_dense_1b step at T=8192 the short conv, the residual add + RMSNorm, the KDA output's
gated norm and SwiGLU take ~35 ms of ~220 ms of device time (README, "Where the step goes"), and the
profile alone cannot say whether a kernel is at its floor. Here each op runs forward and backward on
the layer's real shapes and dtypes (bf16 activations, the fp32 residual stream), its kernels' device
time is read with torch.profiler (on CUDA; wall time elsewhere), and that time is set
against the least traffic any implementation needs (every input read once, every output written
once: `OpCase.fwd_bytes` / `bwd_bytes`) at the bandwidth a plain device copy reaches in the same
process. `fwd_floor_ratio` / `bwd_floor_ratio` = measured / that ideal: 1.0 is a kernel at the copy rate; the excess is what fusion or better
tiling could win. `per_step_ms` multiplies by the op's calls per training step (per layer, times
layers), to compare with the profile's components.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_fwd_bwd import load_model_config

from kimik3.config.paths import model_presets
from kimik3.models.blocks import RMSNorm, resolve_layer_types
from kimik3.models.kda import GatedRMSNorm, short_conv_silu
from kimik3.ops.swiglu import swiglu


@dataclass
class OpCase:
    """One op at one shape: `inputs` builds fresh leaves (untimed), `forward` maps them to the outputs."""

    name: str
    inputs: Callable[[], tuple[Tensor, ...]]
    forward: Callable[..., tuple[Tensor, ...]]
    fwd_bytes: int
    bwd_bytes: int
    calls_per_step: int
    weights: tuple[Tensor, ...] = ()
    """The op's trained weights: their gradients are part of its backward, as in the step."""


def _leaf(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.randn(shape, device=device).to(dtype).requires_grad_()


def _slice_leaf(tokens: int, wide: int, width: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The first `width` channels of a fresh [1, tokens, wide] tensor, itself the leaf: the strides the
    layer's conv reads (a slice of the stacked projection output) without a slice op in the graph. A
    leaf sliced inside the timed forward puts the slice's backward (a zero fill of the whole wide
    gradient and a copy into it, ~1x the conv backward's floor of traffic) into the op's backward time,
    work of the harness: the layer's split backward is one concatenation of every part's gradient,
    there whatever the conv does."""
    return torch.randn(1, tokens, wide, device=device).to(dtype)[..., :width].detach().requires_grad_()


def _conv_widths(model) -> tuple[int, int]:
    """(C, wide): the short conv's channels (q|k|v) and the row width of the projection output they are
    a slice of (q|k|v|f_a|g_a|b, as models/kda.KDAMixer stacks them)."""
    C = 3 * model.num_heads * model.head_dim
    return C, C + 2 * model.head_dim + model.num_heads


def build_cases(model, tokens: int, device: torch.device, act: torch.dtype) -> list[OpCase]:
    """The cases at a preset's shapes. model: a ModelConfig (hidden_size, num_heads, head_dim, ...)."""
    D, H, K = model.hidden_size, model.num_heads, model.head_dim
    layers = model.num_layers
    kda_layers = resolve_layer_types(model).count("kda")
    dense_ffn_layers = layers if model.num_experts == 0 else min(model.first_k_dense, layers)
    cases = []
    # short conv over the stacked q|k|v projection output: a slice of the wider projection output
    C, wide = _conv_widths(model)
    conv_w = (torch.randn(C, 1, model.conv_size, device=device) * 0.3).requires_grad_()

    def conv(x: Tensor) -> tuple[Tensor, ...]:
        return short_conv_silu(x, conv_w, parts=3)

    e = act.itemsize
    n = tokens * C
    cases.append(OpCase("short conv + SiLU", lambda: (_slice_leaf(tokens, wide, C, act, device),), conv,
                        fwd_bytes=2 * n * e, bwd_bytes=3 * n * e, calls_per_step=kda_layers, weights=(conv_w,)))
    # residual add + RMSNorm: branch output in the activation dtype, the residual stream in fp32
    norm = RMSNorm(D, model.norm_eps, feeds_matmul=True).to(device)

    n = tokens * D
    cases.append(OpCase("residual add + RMSNorm",
                        lambda: (_leaf((tokens, D), act, device), _leaf((tokens, D), torch.float32, device)),
                        norm.add_forward, fwd_bytes=n * (e + 4 + 4 + e),
                        bwd_bytes=n * (4 + e + 4 + e + 4), calls_per_step=2 * layers, weights=(norm.weight,)))
    # KDA output gated norm over heads x head_dim
    gated_norm = GatedRMSNorm(K, model.norm_eps).to(device)
    n = tokens * H * K
    cases.append(OpCase("gated RMSNorm (KDA output)",
                        lambda: (_leaf((tokens, H, K), act, device), _leaf((tokens, H, K), act, device)),
                        lambda x, g: (gated_norm(x, g),), fwd_bytes=3 * n * e, bwd_bytes=5 * n * e,
                        calls_per_step=kda_layers, weights=(gated_norm.weight,)))
    if dense_ffn_layers:
        inter = model.intermediate_size
        n = tokens * inter
        cases.append(OpCase("SwiGLU", lambda: (_leaf((tokens, 2 * inter), act, device),), lambda h: (swiglu(h),),
                            fwd_bytes=3 * n * e, bwd_bytes=5 * n * e,
                            calls_per_step=dense_ffn_layers))
    return cases


def _clock(device: torch.device):
    """A (start, stop -> ms) pair: CUDA events on a GPU, perf_counter elsewhere."""
    if device.type == "cuda":
        def start():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def stop(ev) -> float:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return ev.elapsed_time(end)
        return start, stop
    return time.perf_counter, lambda t0: (time.perf_counter() - t0) * 1e3


def time_case(case: OpCase, device: torch.device, warmup: int, iters: int) -> tuple[float, float]:
    """Forward and backward ms of one call. On CUDA: the device time of the kernels each phase
    launches (torch.profiler), summed over `iters` calls queued back to back; wall-clock events would
    also count the host's latency before a backward's first launch (the autograd engine's thread
    hand-off, ~0.2-0.4 ms on the H100 host, more than most of these ops take), which the training
    step hides behind the GPU's queue. Elsewhere: the median wall time of each phase."""
    # the step's bf16 autocast (RMSNorm's feeds_matmul output dtype follows it)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def forward(leaves: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        with autocast:
            return case.forward(*leaves)

    for _ in range(warmup):
        leaves = case.inputs()
        outs = forward(leaves)
        _input_grads(outs, (*leaves, *case.weights), [torch.randn_like(o) for o in outs])
    if device.type == "cuda":
        inputs = [case.inputs() for _ in range(iters)]
        fwd_ms, outs = _kernel_ms(lambda: [forward(leaves) for leaves in inputs], iters)
        grads = [[torch.randn_like(o) for o in out] for out in outs]
        bwd_ms, _ = _kernel_ms(lambda: [_input_grads(o, (*x, *case.weights), g) for o, x, g in zip(outs, inputs, grads)],
                               iters)
        return fwd_ms, bwd_ms
    start, stop = _clock(device)
    fwd, bwd = [], []
    for _ in range(iters):
        leaves = case.inputs()
        t0 = start()
        outs = forward(leaves)
        fwd.append(stop(t0))
        grads = [torch.randn_like(o) for o in outs]
        t0 = start()
        _input_grads(outs, (*leaves, *case.weights), grads)
        bwd.append(stop(t0))
    return sorted(fwd)[len(fwd) // 2], sorted(bwd)[len(bwd) // 2]


def _input_grads(outs: tuple[Tensor, ...], wrt: tuple[Tensor, ...], grads: list[Tensor]) -> tuple[Tensor, ...]:
    """The op's backward: the gradients of its inputs and weights, returned, not accumulated into .grad
    (the accumulation copies a gradient whose layout differs from its leaf's, e.g. the conv's slice
    leaf's, and adds into a weight's .grad from the second call on: kernels of the harness's, not the
    op's)."""
    return torch.autograd.grad(outs, wrt, grads)


def _kernel_ms(run: Callable[[], list], calls: int) -> tuple[float, list]:
    """(device ms of the CUDA kernels `run` launches, per call, and what it returned)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = run()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
    return total_us / 1e3 / calls, result


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """Bytes per ms a plain device-to-device copy moves (read + write), the ceiling the ops are set against."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    start, stop = _clock(device)
    times = []
    for _ in range(iters + 2):
        t0 = start()
        dst.copy_(src)
        times.append(stop(t0))
    return 2 * nbytes / sorted(times[2:])[len(times[2:]) // 2]


def conv_dz_tiles(model, tokens: int, device: torch.device, act: torch.dtype, tiles: list[tuple[int, int, int]],
                  warmup: int, iters: int) -> dict[str, dict]:
    """The Triton short conv's backward per `_conv_dz_kernel` launch config (ops/conv.DZ_BT, DZ_BC,
    DZ_WARPS), each timed as `time_case` times the ops and checked against the eager conv in fp32 on the
    same bf16 inputs (relative Frobenius errors of y, dx, dweight), since a launch config is adopted
    only after it computes the same numbers on the device. Needs CUDA or TRITON_INTERPRET=1."""
    from kimik3.models.kda import causal_short_conv
    from kimik3.ops import conv  # imports Triton

    C, wide = _conv_widths(model)
    weight = torch.randn(C, 1, model.conv_size, device=device) * 0.3
    x = _slice_leaf(tokens, wide, C, act, device)
    dy = torch.randn(1, tokens, C, device=device).to(act)
    x_ref = x.detach().float().requires_grad_()
    w_ref = weight.clone().requires_grad_()
    y_ref = causal_short_conv(x_ref, w_ref)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x_ref, w_ref), dy.float())

    def rel(got: Tensor, want: Tensor) -> float:
        return float((got.detach().float() - want.detach()).norm() / want.detach().norm())

    def run(x: Tensor, w: Tensor) -> tuple[Tensor, ...]:
        return conv.causal_conv_silu(x, w, parts=3)

    timed_weight = weight.clone().requires_grad_()
    case = OpCase("short conv + SiLU", lambda: (_slice_leaf(tokens, wide, C, act, device),),
                  lambda x: run(x, timed_weight), 0, 0, 0, weights=(timed_weight,))
    default = (conv.DZ_BT, conv.DZ_BC, conv.DZ_WARPS)
    rows = {}
    try:
        for tile in tiles:
            conv.DZ_BT, conv.DZ_BC, conv.DZ_WARPS = tile
            w_leaf = weight.clone().requires_grad_()
            y = run(x, w_leaf)
            dx, dw = torch.autograd.grad(y, (x, w_leaf), dy.split(C // 3, dim=-1))
            _, bwd_ms = time_case(case, device, warmup, iters)
            rows["x".join(map(str, tile))] = {"bwd_ms": round(bwd_ms, 4), "rel_y": rel(torch.cat(y, -1), y_ref),
                                              "rel_dx": rel(dx, dx_ref), "rel_dweight": rel(dw, dw_ref),
                                              "default": tile == default}
    finally:
        conv.DZ_BT, conv.DZ_BC, conv.DZ_WARPS = default
    return rows


def _tile(text: str) -> tuple[int, int, int]:
    """`BTxBCxWARPS` (e.g. 16x64x4) -> (16, 64, 4): rows and channels powers of two, warps 1-16."""
    parts = text.split("x")
    ok = len(parts) == 3 and all(p.isdigit() and int(p) > 0 and int(p) & (int(p) - 1) == 0 for p in parts)
    if not ok or int(parts[2]) > 16:
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWSxCHANNELSxWARPS with powers of two and <= 16 warps")
    return int(parts[0]), int(parts[1]), int(parts[2])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kda_dense_1b", choices=model_presets(), help="conf/model preset whose shapes to use")
    p.add_argument("--seq", type=int, default=8192, help="tokens per call (batch 1)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--conv-dz-tile", type=_tile, nargs="+", default=[], metavar="BTxBCxWARPS",
                   help="also time and check the Triton short conv's backward with each of these dz-kernel "
                        "launch configs (CUDA, or TRITON_INTERPRET=1 on the CPU)")
    args = p.parse_args(argv)
    if args.seq < 1 or args.iters < 1:
        p.error(f"--seq and --iters must be >= 1, got {args.seq} and {args.iters}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.conv_dz_tile and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--conv-dz-tile runs the Triton kernel: it needs CUDA or TRITON_INTERPRET=1")
    act = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model_config(args.model, [])
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 24, args.iters)
    rows: dict[str, dict] = {}
    for case in build_cases(model, args.seq, device, act):
        fwd_ms, bwd_ms = time_case(case, device, args.warmup, args.iters)
        ideal_f, ideal_b = case.fwd_bytes / bandwidth, case.bwd_bytes / bandwidth
        rows[case.name] = {"fwd_ms": round(fwd_ms, 4), "bwd_ms": round(bwd_ms, 4),
                           "fwd_floor_ratio": round(fwd_ms / ideal_f, 2), "bwd_floor_ratio": round(bwd_ms / ideal_b, 2),
                           "calls_per_step": case.calls_per_step,
                           "per_step_ms": round((fwd_ms + bwd_ms) * case.calls_per_step, 2),
                           "per_step_floor_ms": round((ideal_f + ideal_b) * case.calls_per_step, 2)}
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "model": args.model,
              "seq": args.seq, "dtype": str(act).removeprefix("torch."), "copy_GB_s": round(bandwidth / 1e6, 1),
              "ops": rows}
    print(f"{result['device']}, {args.model} at {args.seq} tokens, copy {result['copy_GB_s']:,} GB/s")
    print(f"{'op':28s} {'fwd ms':>8s} {'x floor':>7s} {'bwd ms':>8s} {'x floor':>7s} {'ms/step':>8s} {'floor':>7s}")
    for op, r in rows.items():
        print(f"{op:28s} {r['fwd_ms']:8.3f} {r['fwd_floor_ratio']:7.2f} {r['bwd_ms']:8.3f} "
              f"{r['bwd_floor_ratio']:7.2f} {r['per_step_ms']:8.2f} {r['per_step_floor_ms']:7.2f}")
    if args.conv_dz_tile:
        result["conv_dz_tiles"] = conv_dz_tiles(model, args.seq, device, act, args.conv_dz_tile, args.warmup, args.iters)
        print("short conv backward by dz tile (rows x channels x warps): ms, relative error vs fp32 eager y / dx / dweight")
        for tile, r in result["conv_dz_tiles"].items():
            print(f"  {tile:10s} {r['bwd_ms']:8.4f}  {r['rel_y']:.2e} / {r['rel_dx']:.2e} / {r['rel_dweight']:.2e}"
                  + ("  (default)" if r["default"] else ""))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
