"""The benchmark CLI at tiny sizes, so that it cannot rot (the real runs are in docs/benchmarks.md)."""

import json
import random
import statistics

import numpy as np
import pytest

from hvd_sparse.bench.__main__ import main
from hvd_sparse.bench.data import RecordedGradients, SyntheticGradients
from hvd_sparse.bench.presets import names
from hvd_sparse.bench.volume import markdown


def test_volume_cli_writes_the_documented_json(tmp_path, capsys):
    out = tmp_path / "v.json"
    assert main(["volume", "--workers", "3", "--numel", "3000", "--steps", "4", "--json", str(out),
                 "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert {"workers", "numel", "k", "results"} <= set(report)
    assert report["workers"] == 3 and report["numel"] == 3000 and report["k"] == 30
    rows = {r["algorithm"]: r for r in report["results"]}
    assert set(rows) == set(names())
    for r in rows.values():
        assert {"recv_words_max", "recv_words_mean", "recv_words_max_steady", "density_mean"} <= set(r)
        assert r["recv_words_max_steady"] <= r["recv_words_max"]
    assert rows["topka"]["recv_words_max"] == 2 * 30 * 2          # 2k(P-1)
    assert rows["dense"]["density_mean"] == 1.0
    assert "| topka |" in capsys.readouterr().out


def test_volume_counts_two_levels_between_and_inside_the_hosts(tmp_path):
    """--local-size 2 at P = 8 (4 hosts of 2), n = 80,000, k = 800: TopkA receives 2(k/L)(N-1) words from the other
    hosts, Ok-Topk at most 6(k/L)(N-1)/N, and inside the host 2n(L-1)/L values plus the L - 1 headers of 9 words;
    the density is the shard's; an L that does not divide P is refused."""
    out = tmp_path / "v.json"
    assert main(["volume", "--workers", "8", "--local-size", "2", "--numel", "80000", "--steps", "4", "--algorithms",
                 "dense,topka,oktopk", "--json", str(out), "--quiet"]) == 0
    report = json.loads(out.read_text())
    rows = {r["algorithm"]: r for r in report["results"]}
    k, L, N, n = 800, 2, 4, 80000
    table = {line.split(" | ")[0][2:]: line.split(" | ")[5] for line in markdown(report).splitlines()
             if line.startswith("| topka |")}
    assert rows["dense"]["local_size"] == 1 and table["topka"] == f"{2 * (k // L) * (N - 1):,}"  # its own Table 1
    assert rows["topka"]["recv_words_max"] == 2 * (k // L) * (N - 1)
    assert rows["oktopk"]["recv_words_max_steady"] <= 6 * (k / L) * (N - 1) / N
    assert rows["topka"]["inside_recv_words_mean"] == 2 * n * (L - 1) / L + 9 * (L - 1)
    assert rows["topka"]["density_mean"] == 0.01 and rows["topka"]["local_size"] == L
    with pytest.raises(SystemExit):
        main(["volume", "--workers", "8", "--local-size", "3", "--numel", "8000", "--quiet"])


def test_volume_cli_rejects_unknown_algorithms():
    with pytest.raises(SystemExit):
        main(["volume", "--workers", "2", "--algorithms", "topka,nope"])


@pytest.mark.parametrize("argv", [["latency", "--idle", "0"], ["latency", "--idle", "-1"],
                                  ["advise", "--probe-mb", "0"], ["advise", "--seconds", "0"],
                                  ["advise", "--rounds", "0"], ["advise", "--threads", "0"]])
def test_durations_and_sizes_must_be_positive(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert argv[1] in capsys.readouterr().err                 # the error names the argument


def test_recorded_gradients_come_from_the_digits_cnn():
    data = RecordedGradients(workers=2, steps=2)
    assert data.n == sum(data.layout) == 38282
    g = data.grad(1, 0)
    assert g.shape == (38282,) and np.isfinite(g).all() and np.abs(g).max() > 0
    assert not np.array_equal(data.grad(1, 0), data.grad(1, 1))      # workers see different batches


def test_synthetic_gradients_are_deterministic_heavy_tailed_and_drift_slowly():
    a, b = SyntheticGradients(50000, 4, seed=1), SyntheticGradients(50000, 4, seed=1)
    assert np.array_equal(a.grad(3, 2), b.grad(3, 2))
    g0, g1, g50 = a.common(0), a.common(1), a.common(50)
    corr = lambda x, y: float(np.corrcoef(x, y)[0, 1])                # noqa: E731
    assert corr(g0, g1) > 0.95 and corr(g0, g50) < corr(g0, g1)        # slow drift
    x = a.grad(0, 0) / a.scale
    kurt = float(((x - x.mean()) ** 4).mean() / x.var() ** 2)
    assert kurt > 3.5                                                  # heavier tails than a Gaussian (3)
    assert len(set(np.round(a.scale, 6))) == len(a.layout) > 1         # per-layer scales


def test_every_threshold_preset_holds_its_density_while_a_real_model_trains():
    """``bench density``: 100 steps of the digits CNN on P = 4 simulated ranks. Each preset whose count follows a
    threshold selects, on average after its first 10 steps, 0.5-2x the density it was asked for (ExDyna: its ranks
    together), and receives at most 2x the words the presets' table gives for it. (DCT's thresholds, recomputed only
    every 1000 steps as in its paper, passed 50x its density here.) The entries a step applies: TopkA the union of
    the ranks' top-k (at least k), Ok-Topk at most k of their sum, ExDyna no more than its ranks selected."""
    from hvd_sparse.bench import density

    rows = {r["preset"]: r for r in density.run(["gaussiank", "oktopk", "exdyna", "dct", "topka"], workers=4,
                                                steps=100, density=0.01, skip=10, hidden=32)}
    for name, row in rows.items():
        assert name == "topka" or 0.5 <= row["density_ratio"] <= 2.0, row
        assert row["recv_words_per_k"] <= 2 * row["readme_words_per_k"], row
        assert row["final_loss"] < 1.0, row                  # it trained
    assert 1.0 < rows["topka"]["applied_per_k"] <= 4.0
    assert rows["oktopk"]["applied_per_k"] <= 1.0
    assert rows["exdyna"]["applied_per_k"] <= rows["exdyna"]["density_ratio"]


def test_density_cli_writes_a_row_per_preset(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["density", "--workers", "2", "--steps", "3", "--skip", "1", "--hidden", "8",
                 "--algorithms", "topka,dense", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["preset"] for r in report["presets"]] == ["topka"]         # dense has no density to hold
    row = report["presets"][0]
    assert row["density_ratio"] == 1.0 and row["recv_words_per_k"] == row["readme_words_per_k"] == 2.0
    assert 1.0 <= row["applied_per_k"] <= 2.0              # the union of the two ranks' top-k
    assert "| topka |" in capsys.readouterr().out


def _noisy(rng, ms, n=30, sigma=0.25):
    """``n`` step times of ``ms`` under multiplicative noise (log-normal, ``sigma``): the middle half spans about
    -16% to +18% of ``ms``."""
    return [ms * rng.lognormvariate(0, sigma) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_a_real_twofold_difference_is_found_and_a_tenth_either_way_is_within_the_noise(seed):
    from hvd_sparse.bench import noise

    rng = random.Random(seed)
    dense = _noisy(rng, 100)
    found = noise.compare(dense, _noisy(rng, 50))
    assert found["outcome"] == noise.FASTER and 1.6 < found["speedup"] < 2.5
    assert found["low"] < found["speedup"] < found["high"]
    for ratio in (0.9, 1.0, 1.1):
        assert noise.compare(dense, _noisy(rng, 100 / ratio))["outcome"] == noise.NOISE, ratio
    assert noise.compare(dense, _noisy(rng, 200))["outcome"] == noise.SLOWER
    few = noise.compare(dense[:noise.MIN_SAMPLES - 1], _noisy(rng, 50, n=noise.MIN_SAMPLES - 1))
    assert few["outcome"] == noise.NOISE and few["speedup"] > 1.5           # too few samples to tell


@pytest.mark.parametrize("seed", range(5))
def test_paired_rounds_tell_a_third_apart_through_a_drift_that_hides_it_from_the_quartiles(seed):
    """Rounds that share a drift (a load that comes and goes, here a factor of 0.5 to 2 per round): the unpaired
    quartiles overlap, the confidence interval of the median per-round speedup lies below 1; the same distribution on
    both sides stays within the noise, and fewer than MIN_PAIRS pairs never count."""
    from hvd_sparse.bench import noise

    rng = random.Random(seed)
    drift = [2 ** rng.uniform(-1, 1) for _ in range(60)]
    dense = [d * x for d, x in zip(drift, _noisy(rng, 100, n=60, sigma=0.1))]
    slower = [d * x for d, x in zip(drift, _noisy(rng, 135, n=60, sigma=0.1))]
    same = [d * x for d, x in zip(drift, _noisy(rng, 100, n=60, sigma=0.1))]
    assert noise.compare(dense, slower)["outcome"] == noise.NOISE
    found = noise.compare(dense, slower, paired=True)
    assert found["outcome"] == noise.SLOWER and found["low"] < found["speedup"] < found["high"] < 1
    assert noise.compare(slower, dense, paired=True)["outcome"] == noise.FASTER
    assert noise.compare(dense, same, paired=True)["outcome"] == noise.NOISE
    few = noise.MIN_PAIRS - 1
    assert noise.compare(dense[:few], slower[:few], paired=True)["outcome"] == noise.NOISE
    with pytest.raises(ValueError, match="unequal"):
        noise.compare(dense, slower[:-1], paired=True)
    facts = noise.decide({"dense": dense, "a": slower}, "dense", ["a"], paired=True)
    assert (facts["outcome"], facts["wins"], facts["enough"]) == (noise.SLOWER, False, True)


def test_the_median_interval_is_the_sign_tests():
    """The 99% interval of the median of n samples: from the j-th smallest to the j-th largest, j the largest with
    2·P(Binomial(n, 1/2) < j) <= 1% (n = 20: j = 4; n = 100: j = 37, the textbook's order statistics)."""
    from hvd_sparse.bench.noise import median_interval

    assert median_interval(range(20)) == (3, 9.5, 16) and median_interval(range(100)) == (36, 49.5, 63)
    assert median_interval([5]) == (5, 5, 5)
    with pytest.raises(ValueError):
        median_interval([])


def test_quartiles_are_those_of_the_samples():
    from hvd_sparse.bench.noise import quartiles

    assert quartiles([5, 1, 4, 2, 3]) == (2, 3, 4) and quartiles([7]) == (7, 7, 7)
    with pytest.raises(ValueError):
        quartiles([])


def test_the_fastest_candidate_wins_only_beyond_the_spread_and_never_below_the_floor():
    from hvd_sparse.bench import noise

    rng = random.Random(7)
    samples = {"compute": _noisy(rng, 40), "dense": _noisy(rng, 100), "a": _noisy(rng, 50), "b": _noisy(rng, 95)}
    facts = noise.decide(samples, "dense", ["a", "b"], floor="compute")
    assert (facts["best"], facts["wins"], facts["reason"], facts["below_floor"]) == ("a", True, None, [])
    few = noise.decide({k: v[:noise.MIN_SAMPLES - 1] for k, v in samples.items()}, "dense", ["a", "b"])
    assert (few["best"], few["enough"], few["wins"]) == ("a", False, False) and few["reason"]
    facts = noise.decide(samples, "dense", ["b"], floor="compute")
    assert (facts["best"], facts["outcome"], facts["wins"]) == ("b", noise.NOISE, False) and facts["reason"]
    samples["a"] = _noisy(rng, 20)                                # shorter than compute alone: noise, not a win
    facts = noise.decide(samples, "dense", ["a", "b"], floor="compute")
    assert (facts["best"], facts["outcome"], facts["below_floor"], facts["wins"]) == \
        ("a", noise.FASTER, ["a"], False) and facts["reason"]
    assert noise.decide(samples, "dense", ["a", "b"])["wins"]     # without a floor nothing is below it
    facts = noise.decide(samples, "dense", [], floor="compute")
    assert facts["best"] is None and not facts["wins"] and noise.sentence(facts, "dense") == ""


def _advise_ranks(rng, ms, sent=None, rounds=30, steps=3):
    """What two ranks' :func:`advise.measure` gives for one configuration: seconds per round and step (rank 1 one
    millisecond slower on every step) and bytes."""
    mine = [[ms * rng.lognormvariate(0, 0.1) / 1e3 for _ in range(steps)] for _ in range(rounds)]
    return [(mine, sent), ([[t + 1e-3 for t in r] for r in mine], sent)]


def test_advise_decides_on_the_rounds_of_the_slowest_rank_and_the_break_even_link_speed():
    """A round's step is the median of the slowest rank's steps, a configuration's the median of the rounds; the
    preset wins only beyond the spread; the cost model of docs/choosing.md: each fixed cost is the time beyond
    compute less bytes / bandwidth, and the preset and dense cost the same at (B_dense - B_preset) / (F_preset -
    F_dense)."""
    from hvd_sparse.bench.advise import break_even, decide, rows_of, verdict

    rng = random.Random(3)
    measured = [("compute", _advise_ranks(rng, 50)), ("dense", _advise_ranks(rng, 100)),
                ("fp16", _advise_ranks(rng, 90)), ("topka@b0.05", _advise_ranks(rng, 60, 4e5))]
    rows = {r["name"]: r for r in rows_of(measured, 2_000_000, 2)}
    dense = rows["dense"]
    slow = [[t * 1e3 + 1 for t in r] for r in measured[1][1][0][0]]                # rank 1's, every step
    assert [t for r in dense["steps_ms"] for t in r] == pytest.approx([t for r in slow for t in r])
    assert dense["rounds_ms"] == pytest.approx([sorted(r)[1] for r in slow])
    assert dense["step_ms"] == statistics.median(dense["rounds_ms"]) and dense["q1_ms"] < dense["step_ms"] < \
        dense["q3_ms"]
    assert dense["sent_bytes"] == 8e6 and rows["topka@b0.05"]["sent_bytes"] == 4e5
    assert rows["topka@b0.05"]["against_dense"] == "faster" and not any(r["below_compute"] for r in rows.values())
    facts = decide(list(rows.values()), 1.25e8)
    assert facts["best"] == "topka@b0.05" and facts["wins"] and 1.4 < facts["speedup"] < 1.9
    at = break_even(rows["topka@b0.05"], dense, 1.25e8)
    assert facts["break_even_gbit"] == pytest.approx(at * 8 / 1e9)
    measured[3] = ("topka@b0.05", _advise_ranks(rng, 98, 4e5))             # 2% faster: within the noise
    noisy = rows_of(measured, 2_000_000, 2)
    assert not decide(noisy, 1.25e8)["wins"] and decide(noisy, 1.25e8)["outcome"] == "noise"
    assert verdict(noisy, 1.25e8, 2) != verdict(list(rows.values()), 1.25e8, 2)
    measured[3] = ("topka@b0.05", _advise_ranks(rng, 30, 4e5))             # faster than compute alone: noise
    below = rows_of(measured, 2_000_000, 2)
    assert below[3]["below_compute"] and decide(below, 1.25e8)["below_floor"] == ["topka@b0.05"]
    assert not decide(below, 1.25e8)["wins"]
    assert decide(rows_of(measured[:3], 2_000_000, 2), 1.25e8)["best"] is None     # fp16 is no preset


def test_advise_says_whether_two_levels_pay_on_these_hosts():
    """Where a preset ran flat and on two levels (``@h``), the verdict says which to use, by the same rule: two
    levels 2x faster are named, 2% apart is noise, slower is said; without the pair, nothing."""
    from hvd_sparse.bench.advise import configurations, rows_of, two_levels_sentence

    labels = [label for label, _ in configurations(["topka"], [0.05], [], two_levels=True)]
    assert labels == ["compute", "dense", "fp16", "topka@b0.05", "topka@b0.05@h"]
    rng = random.Random(5)
    base = [("compute", _advise_ranks(rng, 50)), ("dense", _advise_ranks(rng, 100)),
            ("topka@b0.05", _advise_ranks(rng, 80, 4e5))]
    said = {}
    for case, ms in (("faster", 40), ("noise", 79), ("slower", 160)):
        rows = {r["name"]: r for r in rows_of(base + [("topka@b0.05@h", _advise_ranks(rng, ms, 1e5))],
                                               2_000_000, 2)}
        said[case] = two_levels_sentence(rows, "topka@b0.05@h" if ms < 80 else "topka@b0.05")
    assert len(set(said.values())) == 3 and all(said.values())
    assert two_levels_sentence({r["name"]: r for r in rows_of(base, 2_000_000, 2)}, "topka@b0.05") == ""


def test_advise_break_even_link_speed():
    from hvd_sparse.bench.advise import break_even

    def row(beyond, sent):
        return {"beyond_compute_ms": beyond, "sent_bytes": sent}

    dense, preset = row(50, 8e6), row(10, 4e5)        # at 1 Gbit/s: F_d 0, F_s 6.8 ms
    assert break_even(preset, dense, 1.25e8) == pytest.approx(7.6e6 / 6.8e-3)
    assert break_even(row(1, 4e5), dense, 1.25e8) is None              # no fixed cost above dense's


def test_advise_takes_turns_in_rounds_until_the_time_is_spent(monkeypatch):
    from hvd_sparse.bench import advise, noise

    ran, clock = [], [0.0]
    monkeypatch.setattr(advise, "slowest", lambda seconds: seconds)
    monkeypatch.setattr(advise.time, "perf_counter", lambda: clock[0])

    def stepper(name):
        def step():
            ran.append(name)
            clock[0] += 0.1
            return 0.1, (None if name == "a" else 8.0)
        return step

    times, sent, elapsed = advise.measure([stepper("a"), stepper("b"), stepper("c")], steps=2, warmup=1,
                                          seconds=3.0, rounds=100)
    assert ran[:3] == ["a", "b", "c"]                                         # the warm-up
    assert ran[3:3 + 24] == ["a"] * 2 + ["b"] * 2 + ["c"] * 2 + ["c"] * 2 + ["b"] * 2 + ["a"] * 2 + \
        ["a"] * 2 + ["b"] * 2 + ["c"] * 2 + ["c"] * 2 + ["b"] * 2 + ["a"] * 2
    assert len(times[0]) == noise.MIN_PAIRS and elapsed >= 3.0        # 3 s after 5 rounds, but 20 pairs at least
    assert all(len(r) == 2 for t in times for r in t) and sent == [None, 8.0, 8.0]
    times, _, _ = advise.measure([stepper("a"), stepper("b")], steps=1, warmup=1, seconds=0.5, rounds=3)
    assert len(times[0]) == 3                                               # --rounds below the minimum: as asked
    times, _, _ = advise.measure([stepper("a")], steps=1, warmup=1, seconds=100.0, rounds=40)
    assert len(times[0]) == 40


@pytest.mark.parametrize("cores, affinity, ranks, option, expected", [
    (2, 2, 2, None, 1), (16, 16, 2, None, 8), (16, 4, 2, None, 4), (2, 2, 4, None, 1), (2, 2, 2, 3, 3)])
def test_advise_threads_do_not_oversubscribe_the_host(monkeypatch, cores, affinity, ranks, option, expected):
    from hvd_sparse.bench import advise

    monkeypatch.setattr(advise.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(advise.os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    assert advise.threads(option, ranks) == expected
