"""train.logger without the tensorboard package: an explicit choice fails in validation, `auto` turns off.

The package is hidden by `sys.modules["tensorboard"] = None`, which makes both `import tensorboard`
and `importlib.util.find_spec("tensorboard")` see it as missing, as on an install without [viz].
"""

from __future__ import annotations

import re
import sys

import pytest

from kimik3.config.validate import ConfigError, validate
from kimik3.train import main

HINT = r"train.logger=tensorboard needs the tensorboard package: pip install 'kimik3\[viz\]' \(or set train.logger=none\)"


@pytest.fixture
def no_tensorboard(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)


def test_validation_names_the_field_and_both_ways_out(compose, tiny_train, no_tensorboard):
    with pytest.raises(ConfigError, match=f"^{HINT}$"):
        validate(compose(["model=smoke", *tiny_train, "train.logger=tensorboard"]))
    for logger in ("auto", "none"):
        validate(compose(["model=smoke", *tiny_train, f"train.logger={logger}"]))


def test_kimik3_train_stops_before_making_anything(monkeypatch, capsys, tmp_path, tiny_train, embedded_data,
                                                   no_tensorboard):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["kimik3-train", "model=smoke", *tiny_train, "train.logger=tensorboard",
                                      f"hydra.run.dir={run_dir}"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(f"kimik3-train: error: {HINT}", line), line
    assert not run_dir.exists()
