"""Shared fixtures, and the devices the tests run on.

A test that runs a model (a forward pass, a merge, a calibration, an evaluation, the export of a run)
on a device it names takes the ``device`` argument, itself or through a fixture, and so runs on the
CPU and, where torch sees a GPU, on CUDA too; a comparison that is bit for bit on the CPU allows the
GPU's rounding on CUDA where its two sides need not round alike there (computed on different devices,
or batched otherwise). (A command run without
``--device`` uses ``auto``, CUDA where torch sees a GPU; a library call without ``device`` the CPU.)
These name the CPU on purpose: the golden run (``test_pipeline.py``: its recorded weights and losses are
the CPU's); the multi-process runs (``test_distributed.py``: gloo, and CUDA would need a GPU per
process); the Hub rehearsals over HTTP (``test_hub_rehearsal.py``, ``test_suite_rehearsal.py``,
``test_mergebench_rehearsal.py``, ``test_glue8_rehearsal.py``, ``faults/test_hub_faults.py``), which run
the command the rehearsal prescribes, ``featcal run --device cpu …`` (``tests/support/hub_world.SMALL``,
or the module's own ``SMALL``), and serve its release with ``featcal space --device cpu``; what is the
CPU's by definition (``test_devices.py``'s reference run and its memory record, ``test_sweep.py``'s
bit-identity on the CPU, ``test_memory.py``'s meter of host memory, the refusal of a GPU by a method
that computes on the CPU only); the faults refused before any model runs (in ``faults/``,
``test_cli_pipeline_commands.py``, ``test_diagnostics.py`` and ``test_sweep.py``); and the closed-form
solves and merging kernels checked against analytic answers on small synthetic tensors
(``test_calibration_solves.py``, the solve checks of ``test_calibration_statistics.py``, the method
properties of ``test_merging.py``), whose device paths the calibration and merging tests cover. Inputs a
test only prepares (a merge feeding a calibration test) are made on the CPU.
"""

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


@pytest.fixture(scope="session")
def mergebench_world(tmp_path_factory):
    """Tiny stand-ins of MergeBench's Llama-3.2-3B base, five experts and five datasets (built once)."""
    from tests.support.tiny_lm_world import build_lm_world

    return build_lm_world(tmp_path_factory.mktemp("mergebench"))


@pytest.fixture(scope="session")
def glue8_world(tmp_path_factory):
    """Tiny stand-ins of FLAN-T5-base, the eight GLUE experts and GLUE's twelve configurations (built once)."""
    from tests.support.tiny_glue_world import build_glue_world

    return build_glue_world(tmp_path_factory.mktemp("glue8"))


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
