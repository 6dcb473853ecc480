"""conf/ composes into the schemas; the override grammar and its errors; the launch planning."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose as hydra_compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from kimik3.config.schema import RootConfig
from kimik3.config.store import register_configs
from kimik3.config.validate import ConfigError, check_known_keys, validate
from kimik3.runs.launch import merge_overrides, plan_launch
from kimik3.runs.run_dir import RunDirError
from kimik3.train import CONF_DIR, CONFIG_NAME

CONF = Path(CONF_DIR)


def compose_dict(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        return hydra_compose(CONFIG_NAME, overrides=overrides)


@pytest.mark.parametrize("model", sorted(p.stem for p in (CONF / "model").glob("*.yaml")))
def test_every_model_preset_composes_and_validates(compose, model):
    cfg = compose([f"model={model}"])
    assert isinstance(cfg, RootConfig) and cfg.model.name == model
    validate(cfg)


@pytest.mark.parametrize("train", sorted(p.stem for p in (CONF / "train").glob("*.yaml")))
def test_every_train_preset_composes_and_validates(compose, train):
    validate(compose([f"train={train}"]))


def test_default_is_kimi_k3_tiny_on_the_embedded_corpus(compose):
    cfg = compose([])
    assert (cfg.model.name, cfg.model.arch, cfg.data.source, cfg.data.tokenizer) == ("kimi_k3_tiny", "kimi_k3", None, "byte")


def test_override_grammar(compose):
    cfg = compose(["model=smoke", "train.lr=1e-2", "train.grad_clip=null", "model.layer_types=[kda,mla]",
                   "train.profile.enabled=true", "++train.seed=7"])
    assert cfg.train.lr == 1e-2 and cfg.train.grad_clip is None and cfg.model.layer_types == ["kda", "mla"]
    assert cfg.train.profile.enabled and cfg.train.seed == 7


@pytest.mark.parametrize("override, cause", [
    ("train.lrr=1", "Key 'lrr' not in 'TrainConfig'"),
    ("train.batch_size=eight", "Value 'eight' of type 'str' could not be converted to Integer"),
])
def test_unknown_keys_and_wrong_types_fail_at_compose(compose, override, cause):
    with pytest.raises(ConfigCompositionException) as e:
        compose([override])
    assert cause in str(e.value.__cause__)


def test_keys_added_with_plus_are_refused_not_dropped(compose):
    """`+train.lrr=1` (Hydra's own hint for an unknown key) would vanish in OmegaConf.to_object."""
    with pytest.raises(ConfigError, match=r"^train.lrr is not a field of TrainConfig \(added with '\+'\?\)"):
        check_known_keys(compose_dict(["+train.lrr=1"]))
    with pytest.raises(ConfigError, match="train.profile.x is not a field of ProfileConfig"):
        plan_launch(["+train.profile.x=1"], CONF_DIR, CONFIG_NAME)
    check_known_keys(compose_dict(["model=smoke"]))


def test_merge_overrides_lets_the_later_list_win_per_key():
    merged = merge_overrides(["model=smoke", "train.lr=1e-3", "train.seed=1"], ["train.lr=3e-3", "+x.y=1"])
    assert merged == ["model=smoke", "train.seed=1", "train.lr=3e-3", "+x.y=1"]


def test_plan_turns_errors_into_one_line_before_any_dir(tmp_path):
    with pytest.raises(RunDirError, match=r"^Could not override 'train.lrr'.*Key 'lrr' not in 'TrainConfig'$"):
        plan_launch(["train.lrr=1", f"hydra.run.dir={tmp_path / 'r'}"], CONF_DIR, CONFIG_NAME)
    assert not (tmp_path / "r").exists()


def test_plan_passes_help_and_multirun_through(tmp_path):
    assert plan_launch(["--help"], CONF_DIR, CONFIG_NAME).argv == ["--help"]
    plan = plan_launch(["-m", "train.lr=1e-3,3e-3"], CONF_DIR, CONFIG_NAME)
    assert plan.multirun and plan.argv[0] == "--multirun" and plan.argv[-1] == "train.lr=1e-3,3e-3"


def test_plan_refuses_a_sweep_dir_that_holds_runs(tmp_path):
    (tmp_path / "sweep" / "0").mkdir(parents=True)
    (tmp_path / "sweep" / "0" / "run.json").write_text("{}")
    with pytest.raises(RunDirError, match="already holds runs"):
        plan_launch(["-m", "train.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}"], CONF_DIR, CONFIG_NAME)
