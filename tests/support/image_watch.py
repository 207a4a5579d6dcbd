"""A ``load_images`` that watches which of the pixel tensors it handed out the calibration still holds."""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

from featcal.calibration.driver import FeatCalibrator


class ImagesAtSolves:
    """Hands out a copy of ``pixels[task]`` per call and, at every FeatCal solve (of the driver or a
    sweep), notes how many of the copies are still alive (``alive_at_solves``)."""

    def __init__(self, pixels: Mapping[str, torch.Tensor], monkeypatch) -> None:
        self.pixels = pixels
        self.handed_out: list[weakref.ref] = []
        self.alive_at_solves: list[int] = []
        solve_into = FeatCalibrator._solve_into

        def solve_and_look(calibrator, *args, **kwargs):
            self.alive_at_solves.append(sum(ref() is not None for ref in self.handed_out))
            return solve_into(calibrator, *args, **kwargs)

        monkeypatch.setattr(FeatCalibrator, "_solve_into", solve_and_look)

    def __call__(self, task: str) -> torch.Tensor:
        images = self.pixels[task].clone()
        self.handed_out.append(weakref.ref(images))
        return images
