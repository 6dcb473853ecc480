import math

import pytest

from kimik3.config.schema import TrainConfig
from kimik3.optim.schedule import lr_multiplier, wsd_decay_start


def cfg(**kw) -> TrainConfig:
    base = dict(max_steps=100, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_warmup_is_linear_from_the_first_step(schedule):
    c = cfg(schedule=schedule)
    assert [lr_multiplier(s, c) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr_multiplier(10, c) == pytest.approx(1.0)


def test_cosine_shape_midpoint_end_and_monotone():
    c = cfg(schedule="cosine")
    values = [lr_multiplier(s, c) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert lr_multiplier(55, c) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(100, c) == pytest.approx(0.1)
    assert lr_multiplier(500, c) == pytest.approx(0.1)
    assert lr_multiplier(99, c) > 0.1


def test_wsd_plateau_then_linear_decay_to_min_ratio_at_the_last_step():
    """Steps are 0-based: the run's last step is max_steps - 1, and it trains at min_lr_ratio."""
    c = cfg(schedule="wsd")
    start = wsd_decay_start(c)
    assert start == 80
    assert all(lr_multiplier(s, c) == 1.0 for s in range(9, start))
    assert lr_multiplier(89, c) == pytest.approx(1.0 - 0.9 * 0.5)
    assert lr_multiplier(99, c) == pytest.approx(0.1) and lr_multiplier(100, c) == pytest.approx(0.1)
    decay = [lr_multiplier(s, c) for s in range(start - 1, 100)]
    steps = [a - b for a, b in zip(decay, decay[1:])]
    assert steps == pytest.approx([0.9 / 20] * 20)


def test_a_one_step_wsd_decay_is_one_step_at_min_ratio():
    c = cfg(schedule="wsd", max_steps=5, warmup_steps=1, decay_fraction=0.2)
    assert [lr_multiplier(s, c) for s in range(5)] == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.1])


def test_constant_ignores_min_ratio():
    c = cfg(schedule="constant", min_lr_ratio=0.0)
    assert lr_multiplier(10, c) == lr_multiplier(10_000, c) == 1.0


def test_zero_warmup_starts_at_peak():
    assert lr_multiplier(0, cfg(schedule="cosine", warmup_steps=0)) == 1.0


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_resume_gives_bitwise_identical_multipliers(schedule):
    """A resumed run asks for steps k.. in a fresh process state: values depend on (step, cfg) only."""
    full = [lr_multiplier(s, cfg(schedule=schedule)) for s in range(120)]
    resumed = [lr_multiplier(s, cfg(schedule=schedule)) for s in range(57, 120)]
    assert resumed == full[57:]
    assert all(math.isfinite(v) and 0.0 < v <= 1.0 for v in full)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
@pytest.mark.parametrize("warmup", [100, 250])
def test_warmup_as_long_as_the_run_rises_every_step_and_never_passes_the_peak(schedule, warmup):
    """W >= max_steps (a short run of a long recipe): accepted; the lr rises for the whole run."""
    c = cfg(schedule=schedule, warmup_steps=warmup)
    values = [lr_multiplier(s, c) for s in range(c.max_steps)]
    assert all(a < b for a, b in zip(values, values[1:]))
    assert values[0] == pytest.approx(1 / warmup) and values[-1] == pytest.approx(c.max_steps / warmup)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(schedule="linear"), "train.schedule='linear'"),
        (dict(schedule="wsd", warmup_steps=90), "overlaps the WSD decay"),
        (dict(min_lr_ratio=1.5), "min_lr_ratio"),
    ],
)
def test_bad_schedule_fields_raise_one_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        lr_multiplier(0, cfg(**kw))
