"""The seq2seq evaluator: exact match and Spearman's ρ of greedy generations, as FusionBench measures FLAN-T5 on GLUE.

The scoring functions against hand-computed cases (ties, constant sides, and generations that do not read as
numbers, which count 0.0 as in FusionBench's ``glue_evaluation.py``); the evaluator on a tiny T5 against
generations made by hand with ``model.generate``, and its report.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from featcal.families.seq2seq.evaluation import GenerationEvaluator, exact_match, ranks, read_number, spearman
from featcal.tasks import DatasetSpec, Task, TextPairFormat
from tests.support.tiny_t5 import pairs, save_model


def test_exact_match_counts_equal_strings_only() -> None:
    assert exact_match(["yes", "no", "", "Yes"], ["yes", "yes", "", "yes"]) == 2
    with pytest.raises(ValueError):
        exact_match(["yes"], ["yes", "no"])


@pytest.mark.parametrize(
    ("text", "value"),
    [("3.8", 3.8), (" 4 ", 4.0), ("-1e1", -10.0), ("", 0.0), ("similar", 0.0), ("3.8.1", 0.0), ("nan", 0.0),
     ("inf", 0.0)],
)  # fmt: skip
def test_a_generation_that_does_not_read_as_a_number_counts_zero(text: str, value: float) -> None:
    assert read_number(text) == value


def test_ranks_share_their_mean_among_ties() -> None:
    assert ranks(torch.tensor([10.0, 20.0, 10.0, 5.0])).tolist() == [2.5, 4.0, 2.5, 1.0]


def test_spearman_against_hand_computed_cases() -> None:
    """ρ = 1 − 6 Σ d² / (n (n² − 1)) without ties: predictions 1, 2, 3, 4, 5 against targets 2, 1, 4, 3, 5 give
    d² = 1 + 1 + 1 + 1 + 0 = 4 and ρ = 1 − 24/120 = 0.8. With ties, the Pearson correlation of mean ranks: ranks
    (1.5, 1.5, 3) against (1, 2, 3) give ρ = 0.5/√(0.5·2) = 0.866…. Generations that do not read as numbers count
    0.0: [\"\", \"x\", \"4\"] against [1, 2, 3] is (0, 0, 4): ρ = 0.866… again. Constant predictions leave ρ
    undefined: 0.0."""
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8, abs=1e-12)
    assert spearman([0.0, 0.0, 4.0], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2, abs=1e-12)
    numbers = [read_number(text) for text in ("", "x", "4")]
    assert spearman(numbers, [1.0, 2.0, 3.0]) == pytest.approx(math.sqrt(3) / 2, abs=1e-12)
    assert spearman([5, 4, 3], [1, 2, 3]) == pytest.approx(-1.0, abs=1e-12)
    assert spearman([2.0, 2.0, 2.0], [1, 2, 3]) == 0.0
    assert spearman([1.0], [2.0]) == 0.0
    scipy_stats = pytest.importorskip("scipy.stats")
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(0, 6, (40,), generator=generator).double().tolist()  # many ties
    b = torch.rand(40, generator=generator).double().tolist()
    assert spearman(a, b) == pytest.approx(float(scipy_stats.spearmanr(a, b)[0]), abs=1e-12)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A tiny T5 base, a test split of 10 pairs (targets: two label words; for STS-B, numbers), and the evaluator."""
    root = tmp_path_factory.mktemp("eval")
    model = save_model(root / "base", seed=0)
    rows = [{"sentence": text, "label": i % 2, "score": float(i % 5)} for i, (text, _) in enumerate(pairs(3, 10))]
    (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = DatasetSpec(str(root / "rows.jsonl"), test_split="train")
    tasks = {
        "cls": Task("cls", dataset, family="seq2seq", text=TextPairFormat("{sentence}", "{label}", ("w1", "w2"))),
        "reg": Task(
            "reg", dataset, family="seq2seq", text=TextPairFormat("{sentence}", "{score:.1f}", metric="spearman")
        ),  # fmt: skip
    }
    return root, model, rows, tasks, GenerationEvaluator(root / "base", "cpu")


def test_the_evaluator_scores_greedy_generations_of_at_most_ten_tokens(evaluated) -> None:
    """Each task's score equals the one computed by hand from ``model.generate(max_length=10)`` (greedy) on the
    inputs, decoded without special tokens, against the targets' words; the report averages the scores."""
    root, model, rows, tasks, evaluator = evaluated
    data = evaluator.test_data(list(tasks.values()), batch_size=4, num_workers=0, max_samples=None)
    report = evaluator.evaluate(model, list(tasks.values()), data=data, progress=False)
    tok = evaluator.tokenizer
    encoded = tok([r["sentence"] for r in rows], padding=True, return_tensors="pt")
    with torch.no_grad():
        generated = tok.batch_decode(
            model.generate(**encoded, max_length=10, do_sample=False), skip_special_tokens=True
        )
    assert all(len(tok(text)["input_ids"]) <= 10 for text in generated)
    words = [("w1", "w2")[r["label"]] for r in rows]
    assert report.tasks["cls"].accuracy == sum(g == w for g, w in zip(generated, words)) / len(rows)
    assert report.tasks["cls"].extra["metric"] == "exact_match" and report.tasks["cls"].num_samples == 10
    expected = spearman([read_number(g) for g in generated], [r["score"] for r in rows])
    assert report.tasks["reg"].accuracy == pytest.approx(expected, abs=1e-12)
    assert report.tasks["reg"].extra["metric"] == "spearman"
    assert report.average["accuracy"] == pytest.approx(
        (report.tasks["cls"].accuracy + report.tasks["reg"].accuracy) / 2
    )
    assert math.isfinite(report.tasks["cls"].loss) and report.tasks["cls"].loss > 0
    assert report.to_json()["reg"]["metric"] == "spearman"


def test_a_model_that_always_generates_one_word_scores_its_share(evaluated) -> None:
    """A model that always generates ``w2`` is right on the rows of class 1: exact match 0.5 on 10 rows with
    alternating labels; read as numbers its generations are all 0.0, so Spearman's ρ is 0.0."""
    root, model, rows, tasks, evaluator = evaluated

    class Constant(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def generate(self, input_ids, attention_mask, **kwargs):
            word = evaluator.tokenizer.convert_tokens_to_ids("w2")
            return torch.tensor([[0, word, 1]] * input_ids.shape[0])

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    data = evaluator.test_data(list(tasks.values()), batch_size=3, num_workers=0, max_samples=None)
    report = evaluator.evaluate(Constant(), list(tasks.values()), data=data, progress=False)
    assert report.tasks["cls"].accuracy == 0.5
    assert report.tasks["reg"].accuracy == 0.0
