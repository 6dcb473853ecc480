"""AdamW step over a preset's parameters: kimik3's optimizer beside torch's fused AdamW, one process.

    python benchmarks/optimizer_step.py --model kimi_3b_a1b --out opt.json        # H200: 2.96B parameters
    python benchmarks/optimizer_step.py --model kimi_k3_tiny                       # CPU smoke run

Both variants run `MuonAdamW.step(clip_coef=c)` as the trainer calls it (train.optimizer=adamw, the
benchmark recipe), on the same parameters and fixed random gradients, from the same start:
- `ours`: the large CUDA tensors through kimik3.ops.adamw (the gradient read, never written), the
  rest through torch's fused AdamW;
- `torch_fused`: every tensor through torch's fused AdamW with grad_scale = 1/c (what the optimizer
  did before ops.adamw; torch.optim.AdamW(fused=True) runs the same kernel). It stores the rescaled
  gradient back, so c = 1 here keeps the gradients, and with them both variants' updates, the same.
Reported: ms per step, the bytes each variant must move (p, m, v read and written, g read, plus g
written for torch_fused), the bandwidth that implies, the ratio, and the largest parameter difference
between the two after the timed steps (fp32 rounding). On the CPU both variants are torch's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_fwd_bwd import load_model_config  # noqa: E402

from kimik3.config.paths import model_presets  # noqa: E402
from kimik3.config.schema import TrainConfig  # noqa: E402
from kimik3.models import build_model  # noqa: E402
from kimik3.optim import build_optimizer, muon  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variant(model: torch.nn.Module, start: list[torch.Tensor], device: torch.device, warmup: int, steps: int,
                 takes_triton: Optional[Callable[..., bool]]) -> tuple[float, list[torch.Tensor], int]:
    """(ms per step, final parameters, elements ops.adamw updated): a fresh optimizer from `start`,
    warmup + timed steps, with muon.takes_triton_adamw replaced by `takes_triton` when given."""
    with torch.no_grad():
        for p, s in zip(model.parameters(), start):
            p.copy_(s)
    optimizer, _ = build_optimizer(model, TrainConfig(optimizer="adamw"))
    coef = torch.ones((), device=device)
    with mock.patch.object(muon, "takes_triton_adamw", takes_triton) if takes_triton else nullcontext():
        for _ in range(warmup):
            optimizer.step(clip_coef=coef)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            optimizer.step(clip_coef=coef)
        _sync(device)
        ms = (time.perf_counter() - t0) / steps * 1e3
        final = [p.detach().clone() for p in model.parameters()]
        states = [(p, optimizer.state[p]) for p in model.parameters()]
        triton_numel = sum(p.numel() for p, s in states
                           if muon.takes_triton_adamw(p, p.grad, s["exp_avg"], s["exp_avg_sq"], s["step"]))
    return ms, final, triton_numel


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_model_config(args.model, args.overrides)
    torch.manual_seed(0)
    with device:
        model = build_model(cfg, args.vocab or cfg.vocab_size or 256)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    start = [p.detach().clone() for p in model.parameters()]
    ours_ms, ours_final, triton_numel = time_variant(model, start, device, args.warmup, args.steps, None)
    torch_ms, torch_final, _ = time_variant(model, start, device, args.warmup, args.steps, lambda *row: False)
    numel = sum(p.numel() for p in model.parameters())
    ours_bytes = 4 * (7 * numel + (numel - triton_numel))  # 7 fp32 streams; + g written back by torch's kernel
    torch_bytes = 4 * 8 * numel
    diff = max((a - b).abs().max().item() for a, b in zip(ours_final, torch_final))
    return {
        "model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "params": numel, "params_via_ops_adamw": triton_numel, "steps": args.steps,
        "ours": {"ms": round(ours_ms, 3), "gb": round(ours_bytes / 1e9, 2),
                 "tb_per_s": round(ours_bytes / ours_ms / 1e9, 2)},
        "torch_fused": {"ms": round(torch_ms, 3), "gb": round(torch_bytes / 1e9, 2),
                        "tb_per_s": round(torch_bytes / torch_ms / 1e9, 2)},
        "speedup": round(torch_ms / ours_ms, 3), "max_param_diff": diff,
    }


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="kimi_k3_tiny", choices=model_presets(), help="conf/model preset")
    parser.add_argument("--vocab", type=int, default=None, help="vocab when the preset leaves it to the data")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the model, e.g. model.num_layers=4")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error(f"--warmup={args.warmup} and --steps={args.steps} must both be >= 1")
    result = run(args)
    print(f"{args.model}: ours {result['ours']['ms']} ms ({result['ours']['tb_per_s']} TB/s), torch fused "
          f"{result['torch_fused']['ms']} ms ({result['torch_fused']['tb_per_s']} TB/s): {result['speedup']}x; "
          f"max parameter difference {result['max_param_diff']:.2e}", file=sys.stderr)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
