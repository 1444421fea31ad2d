"""Answer scores (SQuAD normalisation) and the 95 % intervals the report gives them.

`contains`, `f1` and `exact_match` compare one answer with one reference; `best` takes the
best over several gold answers. Proportions (agreement, contains, fallbacks) get Wilson score
intervals; means and percentiles (F1, TTFT, computed share) a seeded percentile bootstrap.
"""

from __future__ import annotations

import collections
import math
import random
import re
import statistics
import string
from collections.abc import Callable, Sequence

Z95 = 1.959963984540054
"""The standard normal quantile of a two-sided 95 % interval."""


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles (a, an, the), single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = collections.Counter(pred) & collections.Counter(ref)
    same = sum(common.values())
    if not pred or not ref:
        return float(pred == ref)
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def contains(prediction: str, gold: str) -> float:
    """1 if the normalised gold answer occurs in the normalised prediction (as whole words)."""
    pred, ref = f" {normalize_answer(prediction)} ", f" {normalize_answer(gold)} "
    return float(ref.strip() != "" and ref in pred)


def best(metric, prediction: str, golds: list[str]) -> float:
    return max((metric(prediction, g) for g in golds), default=0.0)


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion `successes / n` ((0, 1) when n is 0)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, linearly interpolated."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def bootstrap(
    values: Sequence[float],
    stat: Callable[[Sequence[float]], float] = statistics.fmean,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of `stat(values)` (seeded: the same every run)."""
    if not values:
        raise ValueError("no values")
    rng = random.Random(seed)
    n = len(values)
    stats = [stat([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples)]
    return (percentile(stats, 0.025), percentile(stats, 0.975))
