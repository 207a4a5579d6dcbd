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
    """Parametrise every test that asks for ``device``, itself or through a fixture, over :func:`available_devices`.

    The parameter has module scope, so a module-scoped fixture (a run folder several tests read) can
    take ``device`` too and is built once per device.
    """
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", available_devices(), scope="module")
