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


def available_devices() -> list[str]:
    """The devices the model tests run on: the CPU always, CUDA when torch sees a GPU."""
    import torch

    return ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def pytest_generate_tests(metafunc):
    """Parametrise every test that asks for ``device`` over :func:`available_devices`."""
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", available_devices())
