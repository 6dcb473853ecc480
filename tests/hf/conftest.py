"""The saved transformers checkpoints of hf_models.HF_CONFIGS, made once per session.

Nothing here imports transformers at load time: pytest loads this file before collecting (even
`pytest tests/hf` without the [hf] extra), where a skip would abort the whole session. Each test
module skips itself instead (hf_models does it for the modules that use transformers).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """name -> saved transformers checkpoint dir (save_pretrained), made once per session."""
    from hf_models import HF_CONFIGS, make_hf_model

    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name in HF_CONFIGS:
        dirs[name] = root / name
        make_hf_model(name).save_pretrained(dirs[name])
    return dirs
