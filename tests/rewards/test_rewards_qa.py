"""QA rewards: EM / F1 / accuracy under both normalisations, and the QA format term."""

from __future__ import annotations

import pytest

from copes.rewards import format_reward, qa_scores


@pytest.mark.parametrize(
    ("prediction", "golds", "em", "f1", "acc"),
    [
        ("The Eiffel Tower!", ["Eiffel tower"], 1.0, 1.0, 1.0),  # case, punctuation, article
        ("  an   apple ", ["Apple"], 1.0, 1.0, 1.0),  # article and whitespace
        ("Barack Obama Jr", ["Barack Obama"], 0.0, 0.8, 1.0),  # P = 2/3, R = 1
        ("It was Paris, France", ["Paris"], 0.0, 0.4, 1.0),  # contained: accuracy only
        ("London", ["Paris"], 0.0, 0.0, 0.0),
        ("new york city", ["NYC", "New York City"], 1.0, 1.0, 1.0),  # best of several golds
        ("1,000", ["1000"], 1.0, 1.0, 1.0),  # official drops punctuation inside numbers too
    ],
)
def test_official_normalisation(prediction: str, golds: list[str], em: float, f1: float, acc: float) -> None:
    scores = qa_scores(prediction, golds, normalization="official")
    assert scores == pytest.approx({"em": em, "f1": f1, "acc": acc})


@pytest.mark.parametrize("normalization", ["official", "paper"])
def test_yes_no_answers_get_no_partial_f1(normalization: str) -> None:
    # Token overlap would give F1 = 0.5 ("yes" vs "yes in 1990"); the HotpotQA rule makes it 0.
    assert qa_scores("yes", ["yes in 1990"], normalization)["f1"] == 0.0
    assert qa_scores("yes in 1990", ["yes"], normalization)["f1"] == 0.0
    assert qa_scores("no", ["yes"], normalization) == {"em": 0.0, "f1": 0.0, "acc": 0.0}
    assert qa_scores("No.", ["no"], "official") == {"em": 1.0, "f1": 1.0, "acc": 1.0}
    assert qa_scores("noanswer", ["unknown"], normalization)["f1"] == 0.0


@pytest.mark.parametrize(
    ("prediction", "gold", "official_em", "paper_em"),
    [
        ("Zürich", "Zurich", 0.0, 1.0),  # diacritics: removed by "paper" only
        ("Ångström", "angstrom", 0.0, 1.0),
        ("１９９０", "1990", 0.0, 1.0),  # full-width digits: NFKC
        ("ﬁve", "five", 0.0, 1.0),  # the "fi" ligature: NFKC
        ("STRASSE", "straße", 0.0, 1.0),  # casefold maps ß to ss, lower() does not
        ("3.5", "35", 1.0, 0.0),  # "paper" keeps punctuation
        ("The Beatles", "Beatles", 1.0, 1.0),  # both remove articles
        ("Guns N' Roses", "Guns N Roses", 1.0, 0.0),
    ],
)
def test_paper_versus_official(prediction: str, gold: str, official_em: float, paper_em: float) -> None:
    assert qa_scores(prediction, [gold], "official")["em"] == official_em
    assert qa_scores(prediction, [gold], "paper")["em"] == paper_em


def test_paper_f1_counts_punctuated_tokens_separately() -> None:
    # "paper" keeps the comma, so "Paris," and "Paris" are different tokens.
    assert qa_scores("Paris, France", ["Paris"], "paper")["f1"] == 0.0
    assert qa_scores("Paris, France", ["Paris"], "official")["f1"] == pytest.approx(2 / 3)
    assert qa_scores("Paris, France", ["Paris"], "paper")["acc"] == 1.0


def test_gold_that_normalises_to_nothing_is_not_contained_everywhere() -> None:
    assert qa_scores("Paris", ["The"], "official")["acc"] == 0.0
    assert qa_scores("a", ["The"], "official")["acc"] == 1.0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="normalization"):
        qa_scores("Paris", ["Paris"], normalization="squad")
    with pytest.raises(ValueError, match="golds"):
        qa_scores("Paris", [])
    with pytest.raises(ValueError, match="golds"):
        qa_scores("Paris", "Paris")  # a bare string would be read as a list of characters


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reasoning... <answer>Paris</answer>", 0.0),
        ("<answer>\\boxed{Paris}</answer>", 0.0),  # a box is neither needed nor penalised
        ("the answer is Paris", -1.0),
        ("<answer>Paris", -1.0),  # unclosed
    ],
)
def test_qa_format_reward(text: str, expected: float) -> None:
    assert format_reward(text, "qa") == expected
