import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """Tiny base, two experts and two datasets in local Hub-format folders (built once)."""
    from tests.support.builders import build_world

    return build_world(tmp_path_factory.mktemp("world"))
