"""The words the base's pretraining captions name the classes with.

CLIP learned the text-image alignment on web captions, not on the TA8 tasks' class names and
prompts. The zoo's base can be pretrained the same way: its captions name each class of a task with
a word of a *pretraining vocabulary* that the benchmark's class names (the zero-shot heads, the
experts' heads) never use. The pretraining still teaches features that tell every class apart, but
the benchmark's own class names reach the text tower untrained, so zero-shot is weak until an expert
learns the mapping. ``"benchmark"`` keeps the benchmark's names; benchmarks/mini8.md measures both.
"""

from __future__ import annotations

# German words and the NATO alphabet (lower case, as the tokenizer sees them), chosen so that no word
# is a class name of any benchmark task or of another task's pretraining vocabulary
HELD_OUT: dict[str, tuple[str, ...]] = {
    "digits": ("null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun"),
    "letters": ("alfa", "charlie", "echo", "foxtrot", "hotel", "kilo", "mike", "romeo", "tango", "xray"),
    "shapes": ("kreis", "quadrat", "dreieck", "stern", "kreuz", "raute", "sechseck", "reif"),
    "colors": ("rot", "orangefarben", "gelb", "grün", "türkis", "blau", "lila", "rosa"),
    "textures": ("gestreift", "kariert", "gepunktet", "gitter", "gesprenkelt", "zickzack", "wellig", "ziegel"),
    "arrows": ("nord", "nordost", "ost", "südost", "süd", "südwest", "west", "nordwest"),
    "scenes": ("strand", "wald", "wüste", "meer", "schneefeld", "nachthimmel", "stadt", "wiese"),
    "counting": ("einer", "zweier", "dreier", "vierer", "fünfer", "sechser"),
}

PRETRAIN_VOCABULARIES = ("benchmark", "held-out")


def pretraining_classnames(task: str, classnames: tuple[str, ...], vocabulary: str) -> tuple[str, ...]:
    """The names the pretraining captions give ``task``'s classes under ``vocabulary``.

    Args:
        task: A mini8 task name.
        classnames: The benchmark's class names of the task, in label order.
        vocabulary: One of :data:`PRETRAIN_VOCABULARIES`.

    Returns:
        One name per class, in label order.

    Raises:
        KeyError: ``vocabulary`` is unknown, or ``"held-out"`` has no words for ``task``.
    """
    if vocabulary == "benchmark":
        return classnames
    if vocabulary != "held-out":
        raise KeyError(vocabulary)
    names = HELD_OUT[task]
    if len(names) != len(classnames):
        raise KeyError(f"{task}: {len(names)} held-out names for {len(classnames)} classes")
    return names
