"""KimiK3 forward+backward throughput: one model preset, random tokens, tokens/s and TFLOP/s.

    python benchmarks/model_fwd_bwd.py                                        # kimi_k3_tiny on CPU, 8 x 256
    python benchmarks/model_fwd_bwd.py --model kimi_k3_small --batch 4 --seq 4096 --out small.json
    python benchmarks/model_fwd_bwd.py --model kimi_k3_tiny model.kda_implementation=naive   # Hydra overrides

Each measured step is forward (with targets: the chunked loss) + backward, no optimizer, under bf16
autocast on CUDA (fp32 on CPU unless --dtype bf16). TFLOP/s uses `models.flops.flops_per_token`,
so it is comparable with the trainer's MFU. Prints a table line and one JSON line (also --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kimik3.config.paths import CONF_DIR, model_presets
from kimik3.config.schema import ModelConfig
from kimik3.config.store import register_configs
from kimik3.models import build_model
from kimik3.models.flops import flops_per_token, parameter_counts


def load_model_config(name: str, overrides: list[str]) -> ModelConfig:
    """The ModelConfig that `model=<name> <overrides>` composes to."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"model={name}", *overrides])
    return OmegaConf.to_object(cfg.model)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = load_model_config(args.model, args.overrides)
    vocab = args.vocab or cfg.vocab_size or 256
    torch.manual_seed(0)
    with device:
        model = build_model(cfg, vocab).train()
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> torch.Tensor:
        """One forward + backward, queued: the loss stays on the device (a per-step .item() would drain the
        GPU's queue each step, as the trainer never does, and charge the next forward's launches to it)."""
        with autocast:
            loss = model(x, y).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        model.on_step_end(applied=False)  # reset trackers without moving the router bias
        return loss.detach()

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    _sync(device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    _sync(device)
    step_s = (time.perf_counter() - t0) / args.steps
    tokens_per_s = args.batch * args.seq / step_s
    counts = parameter_counts(cfg, vocab)
    return {
        "model": args.model,
        "overrides": args.overrides,
        "kda_implementation": cfg.kda_implementation,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": dtype,
        "batch": args.batch,
        "seq": args.seq,
        "vocab": vocab,
        "params_total": counts["total"],
        "params_activated": counts["activated"],
        "step_ms": round(step_s * 1e3, 2),
        "tokens_per_s": round(tokens_per_s, 1),
        "tflops": round(flops_per_token(cfg, vocab, args.seq) * tokens_per_s / 1e12, 4),
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "warmup_s": round(warmup_s, 2),
        "loss": round(loss.item(), 4),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="kimi_k3_tiny", choices=model_presets(), help="conf/model preset")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=None, help="default: the preset's, else 256")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.kda_implementation=naive")
    args = parser.parse_args(argv)
    result = run(args)
    print(f"{result['model']} {result['kda_implementation']} {result['device']} B={result['batch']} "
          f"T={result['seq']}: {result['step_ms']} ms/step, {result['tokens_per_s']} tokens/s, "
          f"{result['tflops']} TFLOP/s", file=sys.stderr)
    line = json.dumps(result)
    print(line)
    if args.out is not None:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
