"""When one configuration's step counts as shorter than another's: the rule that every benchmark summary naming a
winner applies (``bench advise``'s verdict, ``bench train``'s and ``bench network``'s line on the fastest
configuration); docs/choosing.md, "When a difference counts", states it for users.

The samples of a configuration are its step times (``advise``: one per round; ``train`` and ``network``: one per
step). A candidate is faster than the baseline when its upper quartile lies below the baseline's lower quartile:
the middle halves of the two do not overlap, so the advantage exceeds the spread of both. It is slower in the
mirror case, and anything else is within the noise. With fewer than :data:`MIN_SAMPLES` samples on either side
nothing counts as a difference: the quartiles of a few samples vary so much that two sets of the same distribution
would often seem apart (of two sets of 4 normal samples, the one "faster" than the other 12% of the time; of 8, 3%;
of 12, 0.7%). A configuration measured faster in this sense than the floor (the same step without communication),
which no exchange can be, says the machine's noise decides: no winner then.

Where the configurations took turns (``advise``: a round runs each in turn), the samples pair up round by round and
the comparison is *paired*: a sign test on the per-round speedups (the baseline's time over the candidate's in the
same round). The candidate is faster when the 99% confidence interval of their median (:func:`median_interval`,
from the order statistics: no assumption on the distribution) lies above 1, slower when it lies below, else within
the noise. The machine's drifts (another job, a frequency step) slow both sides of a round alike and cancel in the
ratio, and a dense step's occasional slow round (a missed cycle of Horovod's background thread) moves the quartiles
of the speedups but not their median: of two configurations that take turns with no difference at all, one is
called faster or slower in at most 1% of runs, at any number of rounds; with fewer than :data:`MIN_PAIRS` nothing
counts.
"""

from __future__ import annotations

import math
import statistics

#: the outcomes of :func:`compare`
FASTER, SLOWER, NOISE = "faster", "slower", "noise"
#: fewer samples than this on either side are never apart
MIN_SAMPLES = 10
#: fewer pairs than this are never apart (paired comparisons)
MIN_PAIRS = 20
#: the confidence of the paired comparison's interval
CONFIDENCE = 0.99
#: the rule in a report's words
RULE = ("(Faster counts where the upper quartile of one's step times lies below the lower quartile of the other's: "
        "docs/choosing.md, \"When a difference counts\".)")


def quartiles(samples):
    """``(lower quartile, median, upper quartile)`` of ``samples`` (``statistics.quantiles``, inclusive method: the
    quartiles of the samples themselves); one sample is all three."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("quartiles of no samples")
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, median, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, median, q3


def median_interval(samples, confidence=CONFIDENCE):
    """``(low, median, high)``: the median of ``samples`` and its ``confidence`` interval by the sign test, the j-th
    smallest and the j-th largest samples for the largest j with 2·P(Binomial(n, 1/2) < j) <= 1 - confidence (the
    whole range where no j qualifies)."""
    xs, n = sorted(samples), len(samples)
    if not xs:
        raise ValueError("the median of no samples")
    tail, j = 0, 0
    while j < n // 2 and 2 * (tail + math.comb(n, j)) <= (1 - confidence) * 2 ** n:
        tail += math.comb(n, j)
        j += 1
    j = max(j, 1)
    return xs[j - 1], statistics.median(xs), xs[n - j]


def compare(baseline, candidate, paired=False):
    """``candidate``'s step times against ``baseline``'s: ``speedup`` (the baseline's median over the candidate's),
    ``low`` and ``high`` (the speedup from quartile to quartile: the baseline's lower over the candidate's upper, the
    baseline's upper over the candidate's lower) and ``outcome``: :data:`FASTER` when the candidate's upper quartile
    is below the baseline's lower one, :data:`SLOWER` in the mirror case, else (or with fewer than
    :data:`MIN_SAMPLES` samples on a side) :data:`NOISE`. ``paired``: the samples pair up by index (one round each);
    then ``speedup`` is the median of the per-pair speedups and ``low``, ``high`` its :func:`median_interval`;
    :data:`FASTER` needs ``low`` above 1, :data:`SLOWER` ``high`` below 1, both :data:`MIN_PAIRS` pairs."""
    if paired:
        if len(baseline) != len(candidate):
            raise ValueError(f"paired samples of unequal lengths: {len(baseline)} and {len(candidate)}")
        low, speedup, high = median_interval([b / c for b, c in zip(baseline, candidate)])
        outcome = (NOISE if len(baseline) < MIN_PAIRS else FASTER if low > 1 else SLOWER if high < 1 else NOISE)
        return {"speedup": speedup, "low": low, "high": high, "outcome": outcome}
    b1, bm, b3 = quartiles(baseline)
    c1, cm, c3 = quartiles(candidate)
    outcome = (NOISE if min(len(baseline), len(candidate)) < MIN_SAMPLES else FASTER if c3 < b1
               else SLOWER if c1 > b3 else NOISE)
    return {"speedup": bm / cm, "low": b1 / c3, "high": b3 / c1, "outcome": outcome}


def decide(samples, baseline, candidates, floor=None, paired=False):
    """The facts of a summary that names a winner, from ``samples`` (``{name: step times}``, aligned by index when
    ``paired``, :func:`compare`): ``best``, the candidate of the lowest median (None without candidates); its
    :func:`compare` against ``baseline`` (``speedup``, ``low``, ``high``, ``outcome``); ``enough``, whether both have
    :data:`MIN_SAMPLES` (:data:`MIN_PAIRS` when paired); ``below_floor``, the configurations
    measured faster than ``floor`` (when given); ``wins``, True when ``best`` is faster than ``baseline`` and nothing
    is below the floor; and, when it is not, ``reason``."""
    below = [n for n in samples if floor is not None and n != floor
             and compare(samples[floor], samples[n], paired)["outcome"] == FASTER]
    if not candidates:
        return {"best": None, "speedup": None, "low": None, "high": None, "outcome": None, "below_floor": below,
                "enough": False, "wins": False, "reason": "no candidate was measured"}
    best = min(candidates, key=lambda n: quartiles(samples[n])[1])
    least = MIN_PAIRS if paired else MIN_SAMPLES
    enough = min(len(samples[best]), len(samples[baseline])) >= least
    facts = {"best": best, **compare(samples[baseline], samples[best], paired), "below_floor": below,
             "enough": enough}
    if below:
        reason = (f"noise: {', '.join(below)} measured faster than {floor} alone, beyond the spread of both, which "
                  "no exchange can be")
    elif not enough:
        reason = f"too few samples to tell: {least} of each needed"
    elif facts["outcome"] == NOISE:
        reason = (f"within the noise: the confidence interval of {best}'s median speedup over {baseline}, round by "
                  "round, holds 1"
                  if paired else f"within the noise: the middle halves of {best}'s and {baseline}'s step times overlap")
    elif facts["outcome"] == SLOWER:
        reason = f"{baseline} is faster than {best}, beyond the spread of both"
    else:
        reason = None
    return {**facts, "wins": reason is None, "reason": reason}


def sentence(facts, baseline):
    """One line on :func:`decide`'s facts for a report (empty without candidates)."""
    best = facts["best"]
    if best is None:
        return ""
    ratio = f"{facts['speedup']:.2f}x"
    if facts["below_floor"] or not facts["enough"]:
        return f"No winner: {facts['reason']}."
    if facts["wins"]:
        return (f"Fastest: {best}, {ratio} as fast as {baseline} ({facts['low']:.2f}x to {facts['high']:.2f}x from "
                "quartile to quartile).")
    if facts["outcome"] == SLOWER:
        return (f"Nothing is faster than {baseline}: the fastest other, {best}, runs at {ratio} its speed, slower "
                "beyond the spread of both.")
    return (f"The fastest, {best}, runs at {ratio} {baseline}'s speed, within the noise of these steps: no "
            "measurable difference.")
