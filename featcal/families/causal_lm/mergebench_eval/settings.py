"""A run's MergeBench protocol settings, as ``run_config.json`` records them (``evaluation.protocol``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.errors import InvalidParameterError
from featcal.families.causal_lm.mergebench_eval.judged_safety import JUDGED
from featcal.families.causal_lm.mergebench_eval.protocol import PROTOCOL

if TYPE_CHECKING:
    from featcal.spec import RunSpec


def protocol_settings(spec: RunSpec) -> dict[str, Any] | None:
    """The protocol's settings of ``spec``, checked before any work; None for the held-out evaluation alone.

    Args:
        spec: The run's options (their combination checked by
            :meth:`~featcal.families.causal_lm.options.LMEvaluationOptions.check`).

    Returns:
        ``{"name": "mergebench", "benchmark_data": folder or None, "allow_code_execution": True}``, with
        ``"safety": "wildguard"`` and ``"judge"`` (its Hub id or resolved folder) for MergeBench's judged safety
        (the default); FusionBench's variant (``mergebench_safety fusionbench``) adds nothing: a record without
        ``safety`` names FusionBench's variant.

    Raises:
        InvalidParameterError: for a ``benchmark_data`` that is not a folder.
        DatasetInputError: for a folder lacking a file the protocol reads.
        CodeExecutionNotAllowedError: without the opt-in to running generated code.
        ModelInputError: for a safety judge that cannot be loaded or run here (on a CPU, WildGuard's 7B);
            DatasetInputError: for a judged benchmark that cannot be read (gated, or no local copy).
        FeatcalError: when lm-eval is not installed.
    """
    from featcal.families.causal_lm.options import LMEvaluationOptions

    options = spec.options(LMEvaluationOptions)
    if options.eval_protocol != PROTOCOL:
        return None
    from featcal.families.causal_lm.mergebench_eval.runner import check_protocol

    data = None
    if options.benchmark_data is not None:
        folder = Path(options.benchmark_data).expanduser()
        if not folder.is_dir():
            raise InvalidParameterError(
                "benchmark_data", options.benchmark_data, "a folder of local copies of the benchmarks' data"
            )
        data = str(folder.resolve())
    judge = options.judge
    if Path(judge).expanduser().exists():
        judge = str(Path(judge).expanduser().resolve())
    from featcal.devices import resolve_device

    device = str(resolve_device(spec.device))
    check_protocol(data, options.allow_code_execution, options.safety, judge, device)
    record = {"name": PROTOCOL, "benchmark_data": data, "allow_code_execution": options.allow_code_execution}
    if options.safety == JUDGED:  # FusionBench's variant: no safety key, which reads as it
        record |= {"safety": JUDGED, "judge": judge}
    return record
