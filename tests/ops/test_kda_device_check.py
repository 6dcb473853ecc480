"""The on-device check of the Triton KDA kernels (ops/kda/device_check.py), run here on the CPU
interpreter: correct kernels pass it, a kernel with one wrong gradient is stopped with that gradient
named, a passed configuration is not checked twice, and the trainer checks each KDA layer shape of a
CUDA model in the dtype of its precision."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from omegaconf import OmegaConf

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.config.schema import ModelConfig, TrainConfig  # noqa: E402
from kimik3.models import build_model  # noqa: E402
from kimik3.ops.kda import device_check, function  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU interpreter test")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(device_check, "_passed", set())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_correct_kernels_pass_well_inside_the_bounds(dtype):
    errors = device_check.check_triton_kda(2, 32, dtype, CPU)
    assert set(errors) == set(device_check.BOUNDS)
    # the bounds catch a miscompile (errors 0.1 to 4) with room above correct kernels
    assert all(errors[n] < device_check.BOUNDS[n] / 4 for n in errors), errors


def test_a_wrong_gradient_stops_the_run_naming_it(monkeypatch):
    backward = function.TritonKDAFunction.backward

    def dk_off_by_a_third(ctx, do, dht):
        grads = list(backward(ctx, do, dht))
        grads[1] = grads[1] * 1.3
        return tuple(grads)

    monkeypatch.setattr(function.TritonKDAFunction, "backward", staticmethod(dk_off_by_a_third))
    with pytest.raises(device_check.KernelCheckError) as err:
        device_check.check_triton_kda(2, 32, torch.float32, CPU, gate_form="bounded")
    message = str(err.value)
    assert "dk" in message and "dq" not in message and "H=2, K=32, float32, gate bounded" in message
    assert "model.kda_implementation=chunk" in message
    assert device_check._passed == set()  # a failed configuration is checked again next time


def test_a_passed_configuration_is_not_checked_again(monkeypatch):
    calls = []
    run = device_check._run
    monkeypatch.setattr(device_check, "_run", lambda *a, **k: calls.append(a[0]) or run(*a, **k))
    assert device_check.check_triton_kda(2, 32, torch.float32, CPU)
    assert device_check.check_triton_kda(2, 32, torch.float32, CPU) == {}
    assert calls == ["triton", "chunk"]
    device_check.check_triton_kda(2, 16, torch.float32, CPU)  # another head dim is another kernel
    assert len(calls) == 4
    device_check.check_triton_kda(2, 16, torch.float32, CPU, keep_states=True)  # and another state variant
    assert len(calls) == 6


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_trainer_checks_each_triton_kda_layer_of_a_cuda_model(monkeypatch, precision, dtype):
    from kimik3 import trainer

    tiny = pathlib.Path(__file__).parents[2] / "conf" / "model" / "kimi_k3_tiny.yaml"
    values = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(tiny)).items() if k != "defaults"}
    model = build_model(ModelConfig(**{**values, "kda_implementation": "triton"}), 64)
    seen = []
    monkeypatch.setattr(trainer, "check_triton_kda", lambda *a, **k: seen.append((*a, *k.values())))
    monkeypatch.setattr(trainer, "resolve_precision", lambda p, d: p)
    cuda = torch.device("cuda")
    trainer.check_kda_kernels(model, TrainConfig(precision=precision), cuda)
    kda_layers = [m for m in model.modules() if isinstance(m, trainer.KDAMixer)]
    assert kda_layers
    H, K = values["num_heads"], values["head_dim"]
    layer_case = (H, K, dtype, cuda, values.get("gate_form", "softplus"), kda_layers[0].gate_lower_bound)
    # kept chunk states compile another recurrence variant: the check runs the one the step will, and
    # both under the default (null: the micro-batch's size decides per forward)
    assert len(seen) == 2 * len(kda_layers) and set(seen) == {(*layer_case, False), (*layer_case, True)}
    for recompute, keeps in ((True, False), (False, True)):
        seen.clear()
        trainer.check_kda_kernels(model, TrainConfig(precision=precision, recompute_kda_states=recompute), cuda)
        assert len(seen) == len(kda_layers) and set(seen) == {(*layer_case, keeps)}
    seen.clear()
    trainer.check_kda_kernels(model, TrainConfig(precision=precision), CPU)  # a CPU model runs `chunk`
    assert seen == []
