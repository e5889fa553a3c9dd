"""QA answer scores: exact match, token F1 and accuracy, each the max over the accepted gold answers, and the one
QA reward a training run uses.

Two normalisations:

- "official": the SQuAD / HotpotQA evaluation script. Lowercase, drop ASCII punctuation, drop the articles
  a/an/the, collapse whitespace.
- "paper": punctuation is kept (so "3.5" and "35" stay different); Unicode NFKC, casefold, diacritics
  removed ("Zürich" == "zurich"), articles dropped, whitespace collapsed.

Reporting (`qa_scores`): the standard metrics, comparable with published numbers. F1 keeps the HotpotQA rule in
both normalisations: when either side normalises to "yes", "no" or "noanswer" and the two differ, F1 is 0 (a
"yes" must not earn partial credit against "yes, in 1990"). Accuracy is 1 when a normalised gold answer occurs as
a substring of the normalised prediction; a yes/no/noanswer gold must be matched exactly (else "yes no" would be
right on every yes/no question). Even so accuracy pays an answer that lists candidates ("Paris London" contains
"Paris"), and so does plain F1 ("Paris London" earns 2/3 against "Paris", more than a guess between the two
earns on average): they are for reports.

Training (`qa_reward`): "em" by default. "f1" as a reward is length-gated: a prediction with more tokens than the
gold earns 0 against it, so listing candidates earns nothing against any gold among them (the list is longer
than each), while a committed partial answer ("Obama" for "Barack Obama") keeps its F1. "acc" is the reporting
metric and pays hedges, so it is refused as a reward (`ACC_IS_NOT_A_REWARD`).
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence

from copes.errors import ConfigError

NORMALIZATIONS = ("official", "paper")
QA_METRICS = ("em", "f1", "acc")
QA_REWARDS = ("em", "f1")
DEFAULT_QA_REWARD = "em"
ACC_IS_NOT_A_REWARD = ("qa_metric 'acc' is a reporting metric that pays an answer listing the candidates, so it "
                       "cannot be a training reward: use 'em' (the default) or 'f1' (length-gated token F1)")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_BINARY_ANSWERS = frozenset({"yes", "no", "noanswer"})


def _collapse_whitespace(text: str) -> str:
    return " ".join(text.split())


def normalize_official(text: str) -> str:
    """The SQuAD / HotpotQA `normalize_answer`."""
    text = text.lower().translate(_PUNCTUATION)
    return _collapse_whitespace(_ARTICLES.sub(" ", text))


def normalize_paper(text: str) -> str:
    """Unicode-aware normalisation that keeps punctuation."""
    text = unicodedata.normalize("NFKC", text).casefold()
    # NFKD splits "ü" into "u" + a combining diaeresis; dropping the combining marks removes the diacritic.
    decomposed = unicodedata.normalize("NFKD", text)
    text = unicodedata.normalize("NFC", "".join(c for c in decomposed if not unicodedata.combining(c)))
    return _collapse_whitespace(_ARTICLES.sub(" ", text))


_NORMALIZERS: dict[str, Callable[[str], str]] = {"official": normalize_official, "paper": normalize_paper}


def _token_f1(prediction: str, gold: str, *, length_gated: bool = False) -> float:
    """Token-bag F1 between two normalised strings, with the HotpotQA yes/no/noanswer rule; `length_gated`: 0 for
    a prediction with more tokens than the gold (the training form, see the module docstring)."""
    if (prediction in _BINARY_ANSWERS or gold in _BINARY_ANSWERS) and prediction != gold:
        return 0.0
    prediction_tokens, gold_tokens = prediction.split(), gold.split()
    if length_gated and len(prediction_tokens) > len(gold_tokens):
        return 0.0
    common = sum((Counter(prediction_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(prediction_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _substring_match(prediction: str, gold: str) -> bool:
    # A gold that normalises to nothing (e.g. "The") would otherwise be "contained" in every prediction, and a
    # yes/no gold in every prediction that says both.
    return gold in prediction if gold and gold not in _BINARY_ANSWERS else prediction == gold


def _normalized(prediction: str, golds: Sequence[str], normalization: str) -> tuple[str, list[str]]:
    if normalization not in _NORMALIZERS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if isinstance(golds, str) or not golds:
        raise ValueError(f"golds must be a non-empty sequence of strings, got {golds!r}")
    normalize = _NORMALIZERS[normalization]
    return normalize(prediction), [normalize(gold) for gold in golds]


def qa_scores(prediction: str, golds: Sequence[str], normalization: str = "official") -> dict[str, float]:
    """{"em", "f1", "acc"} of `prediction` against the best-matching of `golds` (each metric maxed separately):
    the reporting metrics."""
    normalized_prediction, normalized_golds = _normalized(prediction, golds, normalization)
    return {
        "em": float(any(normalized_prediction == gold for gold in normalized_golds)),
        "f1": max(_token_f1(normalized_prediction, gold) for gold in normalized_golds),
        "acc": float(any(_substring_match(normalized_prediction, gold) for gold in normalized_golds)),
    }


def check_qa_reward(metric: str) -> None:
    """Raise ConfigError (one line naming the alternatives) unless `metric` may be a training reward."""
    if metric == "acc":
        raise ConfigError(ACC_IS_NOT_A_REWARD)
    if metric not in QA_REWARDS:
        raise ConfigError(f"qa_metric must be one of {', '.join(QA_REWARDS)}, got {metric!r}")


def qa_reward(
    prediction: str, golds: Sequence[str], metric: str = DEFAULT_QA_REWARD, normalization: str = "official"
) -> float:
    """The training reward of `prediction` under `metric`: EM or length-gated F1, maxed over `golds`."""
    check_qa_reward(metric)
    if metric == "em":
        return qa_scores(prediction, golds, normalization)[metric]
    normalized_prediction, normalized_golds = _normalized(prediction, golds, normalization)
    return max(_token_f1(normalized_prediction, gold, length_gated=True) for gold in normalized_golds)
