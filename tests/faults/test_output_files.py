"""Output hygiene: what a run writes gets the user's umask, like any file the user creates."""

import os
import stat

import pytest

from featcal.cli import main
from tests.support.runs import fast_run

FAST = fast_run(max_eval_samples=3)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_and_folders_follow_the_umask(world, tmp_path, umask: int, device) -> None:
    out = tmp_path / "run"
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, "--device", device]
    previous = os.umask(umask)
    try:
        assert main(argv) == 0
    finally:
        os.umask(previous)
    paths = [out, *out.rglob("*")]
    assert any(p.name == "release" for p in paths) and any(p.name == "model.safetensors" for p in paths)
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert mode == expected, f"{path.relative_to(tmp_path)}: {oct(mode)} != {oct(expected)}"
