"""The saved transformers checkpoints of hf_models.HF_CONFIGS, made once per session.

Importing hf_models skips this whole directory when transformers (the [hf] extra) is missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_models import HF_CONFIGS, make_hf_model


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """name -> saved transformers checkpoint dir (save_pretrained), made once per session."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name in HF_CONFIGS:
        dirs[name] = root / name
        make_hf_model(name).save_pretrained(dirs[name])
    return dirs
