"""`featcal sweep`: the joint calibration of several settings against separate runs, and the command."""

import dataclasses

import pytest
import torch
from transformers import CLIPImageProcessor, CLIPVisionModel

from featcal.calibration import FeatCalParams, featcal_calibrate
from featcal.calibration.sweep import featcal_calibrate_many, setting_groups
from featcal.checkpoint import Checkpoint
from featcal.data import calibration_pixels
from featcal.errors import FeatcalError
from featcal.merging import get_method
from featcal.tasks import load_task_file
from tests.support.builders import FIXTURE

# Settings are compared with separate runs tensor by tensor, relative to the calibration's update
# (‖sweep − separate‖ / ‖separate − merged‖). A setting whose n is a multiple of the batch size sees
# the very same batches as its separate run; one with a partial last batch reads expert rows computed
# in a full batch, whose float32 results may differ in the last bits (a few 1e-7 relative) and are
# carried through the later layers' solves. 1e-5 is far below what a real change of setting moves
# (α, ρ or λ by 0.05: above 0.1 on this measure, the fixture README) and above float32 reassociation.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def fixture_run():
    table = load_task_file(FIXTURE / "tasks.json")
    base = Checkpoint(FIXTURE / "base")
    experts = {t: Checkpoint(FIXTURE / "experts" / t) for t in table.tasks}
    merged_state = get_method("task_arithmetic")(base, list(experts.values()), scaling_factor=0.3)
    merged = CLIPVisionModel.from_pretrained(str(FIXTURE / "experts" / "t0"))
    merged.load_state_dict(merged_state)
    processor = CLIPImageProcessor.from_pretrained(str(FIXTURE / "base"))
    pixels = {t: calibration_pixels(table.tasks[t], processor, 12, 42) for t in table.tasks}
    return base, experts, merged.eval(), pixels, table, processor


def cpu_state(model) -> dict:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def separate_run(fixture_run, params, device):
    base, experts, merged, _, table, processor = fixture_run
    n = params.num_calibration_examples
    pixels = {t: calibration_pixels(table.tasks[t], processor, n, 42) for t in table.tasks}
    model = featcal_calibrate(merged, base, experts, pixels.__getitem__, params, device=device, progress=False)
    return cpu_state(model)


def swept(fixture_run, settings, device, together=None):
    base, experts, merged, pixels, _, _ = fixture_run
    runs = featcal_calibrate_many(
        merged, base, experts, pixels.__getitem__, settings, together=together, device=device, progress=False
    )
    return {i: cpu_state(model) for i, model in runs}


def worst_difference(state, expected, merged_state):
    """The largest ‖state − expected‖ / ‖expected − merged‖ over the calibrated tensors."""
    worst = 0.0
    for key, value in expected.items():
        if key.startswith("encoder.layers."):
            change = (expected[key] - merged_state[key]).norm()
            assert change > 0, key  # the calibration moved it: the comparison means something
            worst = max(worst, float((state[key] - value).norm() / change))
        else:
            assert torch.equal(state[key], value), key
    return worst


def test_nested_sizes_give_the_weights_of_separate_runs(fixture_run, device):
    merged_state = cpu_state(fixture_run[2])
    sizes = [3, 4, 8, 12]  # batch 4: a partial batch, one batch, two, three
    settings = [FeatCalParams(num_calibration_examples=n, calibration_batch_size=4) for n in sizes]
    results = swept(fixture_run, settings, device)
    assert sorted(results) == [0, 1, 2, 3]
    for i, params in enumerate(settings):
        expected = separate_run(fixture_run, params, device)
        assert worst_difference(results[i], expected, merged_state) <= TOLERANCE, params
    # the settings differ from one another by far more than the tolerance
    assert worst_difference(results[0], results[3], merged_state) > 1e-2


def test_multiples_of_the_batch_are_bit_identical_on_cpu(fixture_run):
    settings = [FeatCalParams(num_calibration_examples=n, calibration_batch_size=4) for n in (4, 12)]
    results = swept(fixture_run, settings, "cpu")
    for i, params in enumerate(settings):
        expected = separate_run(fixture_run, params, "cpu")
        for key, value in expected.items():
            assert torch.equal(results[i][key], value), (params.num_calibration_examples, key)


@pytest.mark.parametrize(
    "name,values",
    [("lambda_ratio", [0.01, 0.05, 0.2]), ("anchor_blend_rho", [1.0, 2.2]), ("teacher_interp_alpha", [0.0, 0.5])],
)
def test_parameter_values_give_the_weights_of_separate_runs(fixture_run, name, values, device):
    merged_state = cpu_state(fixture_run[2])
    common = FeatCalParams(num_calibration_examples=8, calibration_batch_size=4)
    settings = [dataclasses.replace(common, **{name: v}) for v in values]
    results = swept(fixture_run, settings, device)
    for i, params in enumerate(settings):
        expected = separate_run(fixture_run, params, device)
        assert worst_difference(results[i], expected, merged_state) <= TOLERANCE, params


def test_groups_give_the_same_weights_as_all_together(fixture_run):
    settings = [FeatCalParams(num_calibration_examples=n, calibration_batch_size=4) for n in (4, 8, 12)]
    together, one_by_one = swept(fixture_run, settings, "cpu"), swept(fixture_run, settings, "cpu", together=1)
    for i in range(len(settings)):
        for key, value in together[i].items():
            assert torch.equal(one_by_one[i][key], value), key


def test_setting_groups_are_bounded_and_sorted_by_size():
    settings = [FeatCalParams(num_calibration_examples=n) for n in (64, 8, 32, 16)]
    assert list(setting_groups(settings, 2)) == [[1, 3], [2, 0]]
    assert list(setting_groups(settings, None)) == [[1, 3, 2, 0]]


def test_settings_must_share_the_batch_size(fixture_run):
    settings = [FeatCalParams(calibration_batch_size=4), FeatCalParams(calibration_batch_size=8)]
    with pytest.raises(FeatcalError, match="calibration_batch_size"):
        swept(fixture_run, settings, "cpu")
