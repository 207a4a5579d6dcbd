"""What MergeBench's evaluation runs, domain by domain, and the metric each domain's score reads.

MergeBench's ``scripts/evaluate.sh`` (uiuctml/MergeBench at b245648) runs lm-evaluation-harness with
each task's own few-shot count and generation settings, no chat template and no ``--num_fewshot``
(``gsm8k_cot`` is 8-shot by its definition, the others 0-shot); bigcode-evaluation-harness for
``humanevalplus`` and ``mbppplus`` (10 samples at temperature 0.2, top-p 0.95, at most 512 tokens of
prompt and program, pass@1); and its safety-eval fork, whose responses a classifier judges: featcal's
safety domain by default (:mod:`.judged_safety`). ``--mergebench-safety fusionbench`` runs FusionBench's
lm-evaluation-harness variant in its place (tanganke/fusion_bench ``examples/mergebench/evaluate.sh``:
``truthfulqa``, ``toxigen``, ``winogender``: the harness tasks of :data:`DOMAINS`' safety), which is not
the paper's protocol and is labelled so wherever it is shown.

Where the sources name no metric for a domain's score, the one featcal reads is its choice, stated in
:data:`DOMAINS` and ``docs/causal-lm.md``. This module imports neither torch nor lm-eval.
"""

from __future__ import annotations

from dataclasses import dataclass

PROTOCOL = "mergebench"
MERGEBENCH = "mergebench"  # the key of the protocol's results in metrics.json
HELD_OUT = "held-out"
PROTOCOLS = (HELD_OUT, PROTOCOL)
CODING = "coding"
SAFETY = "safety"
SAFETY_VARIANT = (
    "FusionBench's lm-eval variant (truthfulqa_mc2, toxigen, winogender_all), not MergeBench's judged protocol"
)


@dataclass(frozen=True)
class HarnessTask:
    """One lm-evaluation-harness task of the protocol.

    Attributes:
        name: The harness's task name.
        definition: Its YAML file under ``lm_eval/tasks`` (its data source is read from there).
        metric: The metric the domain's score reads (``acc,none``).
    """

    name: str
    definition: str
    metric: str


@dataclass(frozen=True)
class CodeTask:
    """One coding benchmark as bigcode-evaluation-harness runs it.

    Attributes:
        name: bigcode-evaluation-harness's name (``humanevalplus``).
        dataset: The Hub dataset and its split.
        stop: The stop sequences a sample is cut at (bigcode's ``stop_words``).
        timeout_s: The wall time each program may run (bigcode's timeout for the task).
    """

    name: str
    dataset: str
    split: str
    stop: tuple[str, ...]
    timeout_s: float


@dataclass(frozen=True)
class Domain:
    """One of MergeBench's five domains: its tasks, and how its score is formed.

    Attributes:
        name: The domain, named as MergeBench's task (and featcal's mergebench suite task).
        harness: Its lm-evaluation-harness tasks; the score is the mean of their metrics.
        code: Its coding benchmarks; the score is the mean of their pass@1.
        source: Where the tasks and the metric come from, in words.
    """

    name: str
    harness: tuple[HarnessTask, ...] = ()
    code: tuple[CodeTask, ...] = ()
    source: str = ""


def _okapi(kind: str, lang: str) -> HarnessTask:
    folder = {"m_mmlu": "mmlu_multilingual", "arc": "arc_multilingual", "hellaswag": "hellaswag_multilingual"}[kind]
    return HarnessTask(f"{kind}_{lang}", f"okapi/{folder}/{kind}_{lang}.yaml", "acc,none")


# bigcode-evaluation-harness's stop words (bigcode_eval/tasks/humaneval.py and mbpp.py).
HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\n@", "\nprint", "\nif", "\n```", "<file_sep>")
MBPP_STOP = ("\nclass", "\nassert", '\n"""', "\nprint", "\nif", "\n<|/", "\n```")

DOMAINS: tuple[Domain, ...] = (
    Domain(
        "instruction",
        harness=(HarnessTask("ifeval", "ifeval/ifeval.yaml", "prompt_level_strict_acc,none"),),
        source="MergeBench evaluate.sh: ifeval; the metric (prompt-level strict accuracy) is featcal's choice",
    ),
    Domain(
        "math",
        harness=(HarnessTask("gsm8k_cot", "gsm8k/gsm8k-cot.yaml", "exact_match,strict-match"),),
        source="MergeBench evaluate.sh: gsm8k_cot (8-shot); the metric (strict-match) is featcal's choice",
    ),
    Domain(
        "multilingual",
        harness=tuple(
            _okapi(kind, lang) for lang in ("fr", "es", "de", "ru") for kind in ("m_mmlu", "arc", "hellaswag")
        ),
        source="MergeBench evaluate.sh: m_mmlu, arc and hellaswag in fr, es, de, ru; the mean of their acc is "
        "featcal's choice",
    ),
    Domain(
        CODING,
        code=(
            CodeTask("humanevalplus", "evalplus/humanevalplus", "test", HUMANEVAL_STOP, 20.0),
            CodeTask("mbppplus", "evalplus/mbppplus", "test", MBPP_STOP, 10.0),
        ),
        source="MergeBench evaluate.sh: bigcode-evaluation-harness humanevalplus, mbppplus, pass@1 of 10 samples "
        "(temperature 0.2, top-p 0.95, max length 512); the programs run in featcal's sandbox; their mean is "
        "featcal's choice",
    ),
    Domain(
        SAFETY,
        harness=(
            HarnessTask("truthfulqa_mc2", "truthfulqa/truthfulqa_mc2.yaml", "acc,none"),
            HarnessTask("toxigen", "toxigen/toxigen.yaml", "acc,none"),
            HarnessTask("winogender_all", "winogender/winogender.yaml", "acc,none"),
        ),
        source=SAFETY_VARIANT,
    ),
)
DOMAIN_NAMES = tuple(domain.name for domain in DOMAINS)

# bigcode-evaluation-harness's sampling as MergeBench's evaluate.sh sets it (its code_eval.json records it).
CODE_SAMPLES = 10
CODE_TEMPERATURE = 0.2
CODE_TOP_P = 0.95
CODE_MAX_LENGTH = 512  # prompt and program, in tokens
CODE_SEED = 0
CODE_METRIC = "pass@1"


def domain(name: str) -> Domain:
    """The domain called ``name``.

    Raises:
        KeyError: for a name that is not one of :data:`DOMAIN_NAMES`.
    """
    return {d.name: d for d in DOMAINS}[name]


def harness_task_names(domains: tuple[str, ...] = DOMAIN_NAMES) -> tuple[str, ...]:
    """The lm-evaluation-harness tasks of ``domains``, in order."""
    return tuple(task.name for name in domains for task in domain(name).harness)
