"""``python -m hvd_sparse.bench train``: argument errors, the configuration names, the equal-bytes calibration on the
simulator, the MNIST-1D data and model, the report's statistics on hand-made records (one seed and two), and real
tiny runs (2 workers in network namespaces on a tc-shaped bridge: Horovod, a preset, DDP and PowerSGD side by side
on the digits; a preset on MNIST-1D over two seeds; presets at equal bytes on MNIST-1D, each stopped at its target)
that check the report and that nothing of the network is left behind."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from hvd_sparse.bench import _train_worker, equal_bytes, presets, train_report
from hvd_sparse.bench._train_worker import parse_config
from hvd_sparse.bench.__main__ import main

from horovod_helpers import ROOT, requires_horovod
from test_bench_network import PNG_MAGIC, leftovers, requires_netns


#: a stand-in for the train worker: fails on configuration "topka", else rank 0 writes one step's records
FAILING_WORKER = r"""
import json, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
if args["--configs"] == "topka":
    sys.exit("topka broke on purpose")
if os.environ["HOROVOD_RANK"] == "0":
    run = {"config": args["--configs"], "kind": "compute" if args["--configs"] == "compute" else "horovod",
        "numel": 10, "evals": [[1, 0.5]], "sent_bytes": [[1.0]] * 2,
           **{p: [[0.1]] * 2 for p in ("forward", "backward", "exchange", "update")}}
    json.dump({"torch_threads": 1, "train_images": 1, "test_images": 1, "runs": [run]}, open(args["--out"], "w"))
"""


@pytest.mark.parametrize("argv, where, what", [
    (["--configs", "horovod,topk"], "--configs", "'topk'"),
    (["--configs", "oktopk+x"], "--configs", "unknown option 'x'"),
    (["--configs", "ddp_powersgd_r0"], "--configs", "ddp_powersgd_r<rank>"),
    (["--configs", "spardl+mc"], "--configs", "does not apply to spardl"),
    (["--configs", "oktopk+d1.5"], "--configs", "unknown option 'd1.5'"),
    (["--targets", "0.9,1.5"], "--targets", "(0, 1]"),
    (["--bandwidth", "fast"], "--bandwidth", "1gbit"),
    (["--workers", "1"], "--workers", "between 2 and 64"),
    (["--task", "cifar10"], "--task", "invalid choice: 'cifar10'"),
    (["--seeds", "0"], "--seeds", "must be >= 1"),
    (["--seeds", "two"], "--seeds", "invalid"),
    (["--train-samples", "0"], "--train-samples", "must be >= 1"),
    (["--configs", "oktopk+b0"], "--configs", "unknown option 'b0'"),
    (["--configs", "oktopk+d0.01+b0.02"], "--configs", "not both"),
    (["--equal-bytes", "topk@0.01"], "--equal-bytes", "unknown preset 'topk'"),
    (["--equal-bytes", "dense@0.01"], "--equal-bytes", "unknown preset 'dense'"),
    (["--equal-bytes", "topka@1.5"], "--equal-bytes", "must be in (0, 1]"),
    (["--equal-bytes", "topka@0"], "--equal-bytes", "must be in (0, 1]"),
    (["--equal-bytes", "topka@x"], "--equal-bytes", "must be a number in (0, 1]"),
    (["--equal-bytes", "topka0.01"], "--equal-bytes", "must be PRESET@DENSITY"),
])
def test_bad_arguments_are_argparse_errors_naming_the_argument(argv, where, what, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert where in err and what in err and "Traceback" not in err


def test_without_root_the_command_says_what_is_missing_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["train", "--workers", "2", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "root privileges" in err and "network namespaces" in err


def test_adamw_is_each_ranks_optimizer_and_refuses_momentum_correction(capsys):
    import torch

    model = torch.nn.Linear(3, 2)
    adamw = _train_worker.local_optimizer(model, "adamw", 0.001, 0.9)
    sgd = _train_worker.local_optimizer(model, "sgd", 0.05, 0.9)
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["lr"] == 0.001
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9
    assert main(["train", "--optimizer", "adamw", "--configs", "horovod,topka+w2+mc"]) == 2
    assert "+mc" in capsys.readouterr().err


def test_configuration_names():
    assert parse_config("horovod_fp16") == {"kind": "horovod", "name": "horovod_fp16", "fp16": True}
    assert parse_config("ddp_powersgd_r4") == {"kind": "ddp", "name": "ddp_powersgd_r4", "powersgd_rank": 4}
    assert parse_config("oktopk+w20+mc") == {"kind": "sparse", "name": "oktopk+w20+mc", "preset": "oktopk",
                                             "warmup_dense_steps": 20, "momentum_correction": True}
    assert parse_config("oktopk+d0.03")["density"] == 0.03 and "density" not in parse_config("oktopk")
    with pytest.raises(ValueError, match="unknown configuration 'dense'"):
        parse_config("dense")                  # the engine's dense reducer is not a baseline users have


def test_the_recipes_options_reach_the_preset():
    """+s<d0>x<steps> (the density warm-up), +c<norm> (local clipping), +h (two levels) and +t<share> (small
    tensors dense) build the preset with them; a warm-up density above 1 and a share of 0.5 are refused."""
    from hvd_sparse.bench._train_worker import sparse_compression

    comp = sparse_compression(parse_config("exdyna+s0.1x20+c2.5+h"), 0.01, 0.9)
    assert (comp.warmup_density, comp.warmup_stage_steps, comp.local_clip_norm, comp.hierarchical) == \
        (0.1, 20, 2.5, True)
    assert comp.density_at(0, 4) == 0.1 and comp.density_at(20, 4) == pytest.approx(0.025)
    assert sparse_compression(parse_config("topka+t0.02"), 0.01, 0.9).dense_share == 0.02
    for bad in ("topka+s2x4", "topka+t0.5"):
        with pytest.raises(ValueError):
            parse_config(bad)


def test_a_budget_option_gives_the_preset_a_byte_budget_instead_of_a_density():
    assert parse_config("oktopk+b0.02") == {"kind": "sparse", "name": "oktopk+b0.02", "preset": "oktopk",
                                            "warmup_dense_steps": 0, "momentum_correction": False,
                                            "byte_budget": 0.02}
    assert parse_config("topka+w3+b1")["byte_budget"] == 1.0
    for name in equal_bytes.sparse_presets():             # what the worker builds for +b<budget>
        comp = presets.make(name, None, byte_budget=0.02, warmup_dense_steps=3,
                            momentum_correction=0.0 if name == "spardl" else 0.9)
        assert comp.byte_budget == 0.02 and 0 < comp.density_for(4) <= 1


@pytest.mark.parametrize("density", [1e-6, 0.000123456, 0.01, 0.024318, 0.5, 1.0])
def test_a_calibrated_density_travels_exactly_in_a_configuration_name(density):
    d = equal_bytes.round_density(density)
    assert d == pytest.approx(density, rel=5e-4)
    assert parse_config(f"oktopk+d{equal_bytes.density_text(d)}")["density"] == d


def test_calibration_finds_densities_whose_simulated_bytes_match_the_reference():
    layout = equal_bytes.scaled_layout(equal_bytes.model_layout("digits", 16, 1024), 20_000)
    assert sum(layout) == pytest.approx(20_000, abs=10) and min(layout) >= 1 and len(layout) == 8
    cal = equal_bytes.calibrate(("topka", 0.01), 4, layout, ["oktopk", "topka", "exdyna"], steps=20)
    ref = cal["reference"]
    assert (ref["preset"], ref["density"], cal["numel"], cal["simulated_numel"]) == ("topka", 0.01, sum(layout),
                                                                                     sum(layout))
    assert ref["sent_bytes"] == (sum(layout) // 100) * 2 * 4 * 3          # k pairs to P - 1 = 3 ranks
    assert cal["presets"]["topka"] == {"density": 0.01, "sent_bytes": ref["sent_bytes"], "ratio": 1.0,
                                       "within_tolerance": True, "simulations": 0}
    source = equal_bytes.LayoutGradients(layout, 4, 0)
    for name in ("oktopk", "exdyna"):
        row = cal["presets"][name]
        assert row["within_tolerance"] and row["density"] > 0.01            # they send less at one density
        measured = equal_bytes.measure(name, row["density"], source, steps=20)   # measured again, afresh
        assert measured == row["sent_bytes"] and abs(measured / ref["sent_bytes"] - 1) <= 0.03
    again = equal_bytes.calibrate(("topka", 0.01), 4, layout, ["exdyna"], steps=20)
    assert again["presets"]["exdyna"] == cal["presets"]["exdyna"]            # deterministic


def test_calibration_of_a_large_model_simulates_fewer_values_and_scales_the_bytes():
    layout = [300, 60_000, 10]
    cal = equal_bytes.calibrate(("topka", 0.01), 2, layout, ["topka"], steps=6, skip=1, numel=6_031)
    assert cal["simulated_numel"] == 30 + 6_000 + 1 and cal["numel"] == 60_310
    assert cal["reference"]["sent_bytes"] == pytest.approx(60 * 2 * 4 * 10)   # k = 60 of 6,031, times 10


def test_equalize_renames_only_the_sparse_configurations_without_their_own_density_or_budget():
    layout = [100, 19_900]
    names, cal = equal_bytes.equalize(["compute", "topka", "oktopk+mc", "oktopk+d0.03", "exdyna+b0.02", "ddp"],
                                      ("topka", 0.05), 2, layout, steps=12)
    d = equal_bytes.density_text(cal["presets"]["oktopk"]["density"])
    assert names == ["compute", "topka+d0.05", f"oktopk+mc+d{d}", "oktopk+d0.03", "exdyna+b0.02", "ddp"]
    assert cal["configs"] == {"topka": "topka+d0.05", "oktopk+mc": f"oktopk+mc+d{d}"}
    assert list(cal["presets"]) == ["topka", "oktopk"]
    assert all(parse_config(n) for n in names)


def test_a_filled_oktopk_is_its_own_configuration_calibrated_apart():
    """``+fill`` (Ok-Topk only) sets ``global_fill``, which reuses the global threshold for τ' steps; at equal bytes
    it gets its own density, above plain Ok-Topk's: plain Ok-Topk selects globally on every step, its owners sending
    their c largest sums each, where the ladder's owners send those at Γ, fewer."""
    assert parse_config("oktopk+fill+w2")["global_fill"] is True and "global_fill" not in parse_config("oktopk")
    with pytest.raises(ValueError, match="unknown option 'fill'"):
        parse_config("topka+fill")
    assert equal_bytes.make_spec("oktopk+fill", 0.02).reducer.global_fill
    layout = [100, 39_900]
    names, cal = equal_bytes.equalize(["oktopk", "oktopk+fill"], ("topka", 0.01), 4, layout, steps=30)
    plain, filled = (cal["presets"][s]["density"] for s in ("oktopk", "oktopk+fill"))
    assert names == [f"oktopk+d{equal_bytes.density_text(plain)}", f"oktopk+fill+d{equal_bytes.density_text(filled)}"]
    assert filled > plain
    assert all(cal["presets"][s]["within_tolerance"] for s in ("oktopk", "oktopk+fill"))


def _raw(config, kind, phases_per_rank, evals, sent=100.0):
    """Raw records as the worker writes them: per phase, per rank, per step."""
    ranks, steps = len(phases_per_rank), len(phases_per_rank[0])
    run = {"config": config, "kind": kind, "numel": 10, "evals": evals,
        "sent_bytes": [[sent] * steps for _ in range(ranks)]}
    for i, p in enumerate(train_report.PHASES):
        run[p] = [[phases_per_rank[r][t][i] for t in range(steps)] for r in range(ranks)]
    return run


def test_summary_takes_the_slowest_rank_per_step_and_times_the_targets_on_the_wall_clock():
    floor = _raw("compute", "compute", [[(1, 2, 0, 1)] * 4, [(1, 2, 0, 1)] * 4], [])
    # rank 1 is slower on steps 0 and 2, rank 0 on steps 1 and 3
    hvd = _raw("horovod", "horovod", [[(1, 2, 3, 1), (1, 2, 5, 1), (1, 2, 1, 1), (1, 2, 6, 1)],
                                      [(1, 2, 4, 1), (1, 2, 1, 1), (1, 2, 2, 1), (1, 2, 1, 1)]],
               [[2, 0.5], [3, 0.92], [4, 0.96]])
    ddp = _raw("ddp", "ddp", [[(1, 5, 0, 1)] * 4, [(1, 4, 0, 1)] * 4], [[4, 0.91]])
    rows = {r["config"]: r for r in train_report.summarize([floor, hvd, ddp], [0.9, 0.95])}
    h = rows["horovod"]
    assert h["steps"] == 4 and h["wall_seconds"] == 8 + 9 + 6 + 10            # slowest rank, every step
    assert h["step_seconds_median"] == 9 and h["step_seconds_mean"] == pytest.approx(25 / 3)  # after the first
    assert h["exchange"] == pytest.approx((5 + 2 + 6) / 3) and h["exchange_median"] == 5
    assert h["accuracy_curve"] == [[17, 0.5], [23, 0.92], [33, 0.96]]
    assert (h["time_to_0.9"], h["time_to_0.95"], h["final_accuracy"]) == (23, 33, 0.96)
    assert h["x_floor"] == pytest.approx(9 / 4) and h["after_backward_seconds"] == 5
    d = rows["ddp"]
    assert d["after_backward_seconds"] == 5 - 2 and d["time_to_0.95"] is None   # waits inside backward
    assert rows["compute"]["final_accuracy"] is None and rows["compute"]["x_floor"] == 1.0
    text = train_report.markdown({"workers": 2, "bandwidth": "1gbit", "numel": 10, "image_size": 8, "epochs": 1,
                                  "batch_size": 32, "lr": 0.05, "density": 0.01, "targets": [0.9, 0.95],
                                  "load_average_before": [0.1, 0, 0],
                                  "results": list(rows.values())})
    header, sep, *body = text.split("\n")[2:6]
    assert header.count("|") == sep.count("|") == body[0].count("|")             # a well-formed table
    assert "| horovod | 9.000 |" in text and "| 23.0 | 33.0 | 96.00% |" in text


def test_the_summary_names_the_fastest_configuration_only_beyond_the_spread_of_the_steps():
    """noise.decide on every seed's steps (after the first): horovod the baseline, compute the floor."""
    from hvd_sparse.bench import noise

    rng = np.random.default_rng(5)

    def run(config, kind, exchange, seed=1):
        steps = [[(1, 1, exchange * float(rng.lognormal(0, 0.25)), 0)] for _ in range(21)]
        return dict(_raw(config, kind, [[s[0] for s in steps]], [[21, 0.9]]), seed=seed)

    report = {"workers": 2, "bandwidth": "1gbit", "numel": 10, "image_size": 8, "epochs": 1, "batch_size": 32,
              "lr": 0.05, "density": 0.01, "targets": [0.9], "load_average_before": [0.1, 0, 0]}
    raw = [run("compute", "compute", 0.01), run("horovod", "horovod", 4), run("topka", "sparse", 1),
           run("exdyna", "sparse", 3.9)]
    report["results"] = train_report.summarize(raw + [run("topka", "sparse", 1, seed=2)], [0.9])
    facts = train_report.decision(report["results"])
    assert (facts["best"], facts["wins"], facts["below_floor"]) == ("topka", True, [])
    assert noise.sentence(facts, "horovod") in train_report.markdown(report)
    report["results"] = train_report.summarize(raw[:2] + raw[3:], [0.9])          # 2.5% apart: noise
    facts = train_report.decision(report["results"])
    assert (facts["best"], facts["wins"]) == ("exdyna", False) and facts["reason"]
    assert train_report.decision(train_report.summarize(raw[2:], [0.9])) is None      # no horovod to compare with


def test_the_markdown_names_the_equal_bytes_reference_and_densities():
    run = _raw("oktopk+d0.02383", "sparse", [[(1, 1, 1, 1)] * 3], [[3, 0.9]], sent=1.0e6)
    report = {"workers": 4, "bandwidth": "1gbit", "numel": 10, "image_size": 16, "epochs": 1, "batch_size": 32,
              "lr": 0.05, "density": 0.01, "targets": [0.9], "load_average_before": [0.1, 0, 0],
              "results": train_report.summarize([run], [0.9]),
              "equal_bytes": {"reference": {"preset": "topka", "density": 0.01, "sent_bytes": 1013754.2},
                              "presets": {"oktopk": {"density": 0.02383}, "topka": {"density": 0.01}}}}
    text = train_report.markdown(report)
    assert ("sparse presets at equal bytes with topka at 0.01 (1.01 MB per rank and step on the simulator): "
            "oktopk 0.02383, topka 0.01; otherwise density 0.01;") in text
    assert "| oktopk+d0.02383 | 4.000 |" in text and "| 1.00 MB |" in text


def test_mnist1d_data_is_one_function_of_the_seed_with_the_requested_sizes():
    from hvd_sparse.bench.mnist1d import load_arrays

    state = np.random.get_state()
    a = load_arrays(1, train_samples=403, test_samples=197)       # 600 generated: 60 per class
    assert all(np.array_equal(u, v) for u, v in zip(a, load_arrays(1, 403, 197)))
    assert np.array_equal(np.random.get_state()[1], state[1])      # the global generator is left alone
    x_tr, y_tr, x_te, y_te = a
    assert (x_tr.shape, y_tr.shape, x_te.shape, y_te.shape) == ((403, 40), (403,), (197, 40), (197,))
    assert (x_tr.dtype, y_tr.dtype, x_te.dtype, y_te.dtype) == (np.float32, np.int64, np.float32, np.int64)
    assert set(y_tr.tolist()) == set(range(10)) and set(y_te.tolist()) <= set(range(10))
    assert abs(float(x_tr.mean())) < 1e-5 and float(x_tr.std()) == pytest.approx(1, abs=1e-5)
    other = load_arrays(2, 403, 197)
    assert not np.array_equal(other[0], x_tr) and not np.array_equal(other[2], x_te)
    with pytest.raises(ValueError, match="must be >= 1"):
        load_arrays(1, 0, 10)


def test_mnist1d_model_has_the_parameters_its_docstring_says():
    import torch

    from hvd_sparse.bench.mnist1d_torch import WideNet1D, load_data

    assert "2,667,914" in WideNet1D.__doc__
    assert sum(p.numel() for p in WideNet1D().parameters()) == 2_667_914
    assert sum(p.numel() for p in WideNet1D(32).parameters()) == 35_210 + 2_571 * 32
    (x_tr, y_tr), (x_te, _) = load_data(3, 40, 20)
    assert x_tr.shape == (40, 1, 40) and x_te.shape == (20, 1, 40) and y_tr.dtype == torch.long
    assert WideNet1D(32)(x_tr[:5]).shape == (5, 10)


def test_summary_over_two_seeds_gives_the_mean_and_spread_of_each_configuration(tmp_path):
    def runs(seed, exchange, evals):
        return [dict(_raw("compute", "compute", [[(1, 1, 0, 0)] * 3] * 2, []), seed=seed),
                dict(_raw("horovod", "horovod", [[(1, 1, exchange, 0)] * 3] * 2, evals), seed=seed)]

    # seed 1: steps of 4 s (x floor 2), accuracy 0.5, 0.92, 0.96 at 4, 8, 12 s
    # seed 2: steps of 6 s (x floor 3), accuracy 0.6, 0.8, 0.94 at 6, 12, 18 s: never 95%
    raw = runs(1, 2, [[1, 0.5], [2, 0.92], [3, 0.96]]) + runs(2, 4, [[1, 0.6], [2, 0.8], [3, 0.94]])
    compute, h = train_report.summarize(raw, [0.9, 0.95])
    assert (compute["config"], h["config"], h["seeds"]) == ("compute", "horovod", [1, 2])
    assert [r["seed"] for r in h["per_seed"]] == [1, 2] and h["per_seed"][1]["step_seconds_median"] == 6
    assert h["spread"]["step_seconds_median"] == {"mean": 5, "min": 4, "max": 6, "std": pytest.approx(2 ** 0.5)}
    assert h["spread"]["x_floor"] == {"mean": 2.5, "min": 2, "max": 3, "std": pytest.approx(0.5 ** 0.5)}
    assert h["spread"]["final_accuracy"] == {"mean": pytest.approx(0.95), "min": 0.94, "max": 0.96,
                                             "std": pytest.approx(0.02 / 2 ** 0.5)}
    assert h["spread"]["time_to_0.9"] == {"mean": 13, "min": 8, "max": 18, "std": pytest.approx(50 ** 0.5),
                                          "reached": 2}
    assert h["spread"]["time_to_0.95"] == {"mean": None, "min": 12, "max": 12, "std": None, "reached": 1}
    assert (h["step_seconds_median"], h["x_floor"], h["time_to_0.9"], h["time_to_0.95"]) == (5, 2.5, 13, None)
    assert h["wall_seconds"] == 15 and h["final_accuracy"] == pytest.approx(0.95)
    assert h["accuracy_curve"] == [[5, pytest.approx(0.55)], [10, pytest.approx(0.86)], [15, pytest.approx(0.95)]]
    assert h["accuracy_band"] == [[0.5, 0.6], [0.8, 0.92], [0.94, 0.96]]
    assert compute["spread"]["x_floor"] == {"mean": 1, "min": 1, "max": 1, "std": 0}
    report = {"workers": 2, "bandwidth": "1gbit", "numel": 10, "task": "mnist1d", "train_images": 400,
              "test_images": 200, "epochs": 1, "batch_size": 32, "lr": 0.05, "density": 0.01, "seeds": [1, 2],
              "targets": [0.9, 0.95], "load_average_before": [0.1, 0, 0], "results": [compute, h],
              "failed": [{"config": "topka", "seed": 2, "error": "broke\nhere"}]}
    text = train_report.markdown(report)
    assert "WideNet1D (10 parameters) on MNIST-1D (400 training, 200 test sequences)" in text
    assert "2 seeds (1..2)" in text and "| topka | failed (seed 2): broke |" in text
    assert "| horovod | 5.000 ± 1.414 |" in text and "| 2.50x ± 0.71 |" in text
    assert "| 13.0 ± 7.1 | — (1/2 reached) | 95.00% ± 1.41 |" in text
    header, sep, *body = text.split("\n")[2:6]
    assert header.count("|") == sep.count("|") == body[0].count("|") == body[1].count("|")
    train_report.plot(report, tmp_path / "two.png")
    assert (tmp_path / "two.png").read_bytes().startswith(PNG_MAGIC)
    assert not math.isnan(h["spread"]["time_to_0.9"]["std"])


def test_targets_chosen_after_the_run_come_from_the_curves_of_its_report(tmp_path, capsys):
    """``train_report.retarget`` (and its command line) gives the times to other targets from the per-seed curves a
    report holds: the same statistics as a summary made with those targets in the first place."""
    def runs(seed, exchange, evals):
        return [dict(_raw("compute", "compute", [[(1, 1, 0, 0)] * 3] * 2, []), seed=seed),
                dict(_raw("horovod", "horovod", [[(1, 1, exchange, 0)] * 3] * 2, evals), seed=seed)]

    raw = runs(1, 2, [[1, 0.5], [2, 0.92], [3, 0.96]]) + runs(2, 4, [[1, 0.6], [2, 0.8], [3, 0.94]])
    report = {"workers": 2, "bandwidth": "1gbit", "numel": 10, "task": "mnist1d", "train_images": 400,
              "test_images": 200, "epochs": 1, "batch_size": 32, "lr": 0.05, "density": 0.01, "seeds": [1, 2],
              "targets": [0.9], "load_average_before": [0.1, 0, 0],
              "results": train_report.summarize(raw, [0.9])}
    again = train_report.retarget(report, [0.55, 0.95])
    assert again["results"] == train_report.summarize(raw, [0.55, 0.95]) and again["targets"] == [0.55, 0.95]
    spread = again["results"][1]["spread"]["time_to_0.55"]
    assert spread == {"mean": 7, "min": 6, "max": 8, "std": pytest.approx(2 ** 0.5), "reached": 2}
    assert "time_to_0.9" not in again["results"][1] and report["targets"] == [0.9]      # the report is not changed
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert train_report.main([str(tmp_path / "r.json"), "--targets", "0.55,0.95", "--json", str(tmp_path / "o.json"),
                              "--plot", str(tmp_path / "o.png")]) == 0
    assert "s to 55%" in capsys.readouterr().out
    assert json.loads((tmp_path / "o.json").read_text())["results"][1]["time_to_0.55"] == 7
    assert (tmp_path / "o.png").read_bytes().startswith(PNG_MAGIC)
    one, two = (dict(report, seeds=[s], results=train_report.summarize(raw[2 * i:2 * i + 2], [0.9]))
                for i, s in enumerate((1, 2)))                  # the same runs, one report per seed
    merged = train_report.retarget(one, [0.55, 0.95], [two])
    assert merged["results"] == again["results"] and merged["seeds"] == [1, 2]
    with pytest.raises(ValueError, match="the reports differ in workers"):
        train_report.retarget(one, [0.9], [dict(two, workers=4)])


def run_bench_train(args, out):
    """``python -m hvd_sparse.bench train <args>`` in a subprocess that must succeed and leave no network namespace
    behind: ``(the JSON report written to out, stdout, stderr)``."""
    cmd = [sys.executable, "-m", "hvd_sparse.bench", "train", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    assert leftovers(proc.pid) == []
    return json.loads(out.read_text()), stdout, stderr


@requires_netns
def test_a_failed_configuration_is_reported_and_the_others_still_run(tmp_path):
    from hvd_sparse.bench import train

    worker = tmp_path / "worker.py"
    worker.write_text(FAILING_WORKER)
    report = train.run(["compute", "topka", "horovod"], 2, train.Rate("1gbit"), link_check_seconds=0,
                       verbose=False, worker_cmd=[sys.executable, str(worker)], timeout=120)
    assert [r["config"] for r in report["results"]] == ["compute", "horovod"]
    (failed,) = report["failed"]
    assert failed["config"] == "topka" and "topka broke on purpose" in failed["error"]
    assert "| topka | failed: " in train_report.markdown(report)


@pytest.mark.horovod
@requires_horovod
@requires_netns
def test_tiny_run_trains_every_kind_of_configuration_and_leaves_no_network_behind(tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    configs = "compute,horovod,horovod_fp16,topka,oktopk+w3+mc,ddp,ddp_powersgd_r1"
    report, stdout, stderr = run_bench_train(["--workers", "2", "--bandwidth", "1gbit", "--epochs",
        "1", "--image-size", "8", "--hidden", "32", "--eval-every", "5", "--floor-epochs", "1",
        "--configs", configs, "--json", str(out), "--plot", str(png)], out)
    assert (report["workers"], report["bandwidth"], report["epochs"], report["torch_threads"]) == (2, "1gbit", 1, 1)
    n = report["numel"]
    assert n == 18816 + 16 * 8 * 8 * 32 + 11 * 32 + 10                           # WideNet(8, 32)
    rows = {r["config"]: r for r in report["results"]}
    assert list(rows) == configs.split(",")
    steps = (1437 // 2) // 32                                                     # rank 1's shard: 718 images
    for name, r in rows.items():
        assert r["steps"] == steps and r["step_seconds_median"] > 0 and r["wall_seconds"] > 0
        assert r["x_floor"] > 0 and r["after_backward_seconds"] is not None
        if name == "compute":
            assert r["accuracy_curve"] == [] and r["sent_bytes_per_step"] == 0
        else:                                 # every 5 steps and after the last, on the wall clock
            walls = [w for w, _ in r["accuracy_curve"]]
            assert len(walls) == steps // 5 + 1 and walls == sorted(walls) and walls[-1] == r["wall_seconds"]
            assert 0 <= r["final_accuracy"] <= 1
    ring = 2 * n * (2 - 1) / 2
    assert rows["horovod"]["sent_bytes_per_step"] == ring * 4 == rows["ddp"]["sent_bytes_per_step"]
    assert rows["horovod_fp16"]["sent_bytes_per_step"] == ring * 2
    assert rows["topka"]["sent_bytes_per_step"] == (n // 100) * 2 * 4                # k (index, value) pairs
    assert 0 < rows["ddp_powersgd_r1"]["sent_bytes_per_step"] < ring * 4             # compressed after warm-up
    # 3 dense warm-up steps (float32 ring allreduce) of 21 measured, then Ok-Topk's O(k) exchange
    assert 2 * ring * 4 / (steps - 1) < rows["oktopk+w3+mc"]["sent_bytes_per_step"] < 3 * ring * 4 / (steps - 1) + 1e4
    for kind in ("horovod", "horovod_fp16", "topka", "oktopk+w3+mc"):
        assert rows[kind]["exchange"] > 0                   # synchronize() is timed apart from the update
    assert rows["ddp"]["exchange"] == 0
    # same initial weights and data order: Horovod's and DDP's dense averages train the same model
    assert rows["horovod"]["final_accuracy"] == pytest.approx(rows["ddp"]["final_accuracy"], abs=0.02)
    assert "| ddp_powersgd_r1 |" in stdout and "s to 95%" in stdout
    assert "[ddp_powersgd_r1] epoch 1/1" in stderr
    assert png.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.horovod
@requires_horovod
@requires_netns
def test_tiny_mnist1d_run_over_two_seeds_reports_every_seed(tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    report, stdout, stderr = run_bench_train(["--workers", "2", "--bandwidth", "1gbit", "--task",
        "mnist1d", "--train-samples", "400", "--test-samples", "200", "--seeds", "2", "--seed", "7", "--epochs",
        "1", "--hidden", "32", "--eval-every", "2", "--configs", "compute,topka", "--no-link-check",
        "--optimizer", "adamw", "--json", str(out), "--plot", str(png)], out)
    assert (report["task"], report["seeds"], report["train_images"], report["test_images"]) == ("mnist1d", [7, 8],
                                                                                              400, 200)
    assert (report["optimizer"], report["lr"]) == ("adamw", 0.001)
    assert report["numel"] == 35_210 + 2_571 * 32 and report["failed"] == []        # WideNet1D(32)
    rows = {r["config"]: r for r in report["results"]}
    assert list(rows) == ["compute", "topka"]
    steps = (400 // 2) // 32
    for r in rows.values():
        assert r["seeds"] == [7, 8] and [s["seed"] for s in r["per_seed"]] == [7, 8]
        assert all(s["steps"] == steps and s["step_seconds_median"] > 0 for s in r["per_seed"])
        assert r["spread"]["step_seconds_median"]["std"] is not None
    t = rows["topka"]
    assert len(t["accuracy_curve"]) == len(t["accuracy_band"]) == steps // 2
    assert all(0 <= lo <= hi <= 1 for lo, hi in t["accuracy_band"])
    assert t["spread"]["final_accuracy"]["min"] <= t["final_accuracy"] <= t["spread"]["final_accuracy"]["max"]
    assert "2 seeds (7..8)" in stdout and "| topka | " in stdout and " ± " in stdout
    assert "seed 8" in stderr and "[topka] epoch 1/1" in stderr
    assert png.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.horovod
@requires_horovod
@requires_netns
def test_tiny_run_at_equal_bytes_records_the_calibrated_densities(tmp_path):
    out = tmp_path / "train.json"
    report, stdout, stderr = run_bench_train(["--workers", "2", "--bandwidth", "1gbit", "--task",
        "mnist1d", "--train-samples", "400", "--test-samples", "200", "--epochs", "1", "--hidden", "32",
        "--eval-every", "2", "--configs", "compute,topka,oktopk,exdyna+d0.02,exdyna+b0.1", "--equal-bytes",
        "topka@0.05", "--targets", "0.01", "--stop-at-target", "--no-link-check", "--json", str(out)], out)
    n = report["numel"]
    eq = report["equal_bytes"]
    assert eq["reference"] == {"preset": "topka", "density": 0.05, "sent_bytes": (n * 5 // 100) * 2 * 4}
    assert (eq["workers"], eq["numel"], eq["simulated_numel"]) == (2, n, n)
    assert list(eq["presets"]) == ["topka", "oktopk"] and eq["presets"]["topka"]["density"] == 0.05
    ok = eq["presets"]["oktopk"]
    assert ok["within_tolerance"] and abs(ok["sent_bytes"] / eq["reference"]["sent_bytes"] - 1) <= 0.03
    d = equal_bytes.density_text(ok["density"])
    assert eq["configs"] == {"topka": "topka+d0.05", "oktopk": f"oktopk+d{d}"}
    rows = {r["config"]: r for r in report["results"]}
    assert list(rows) == ["compute", "topka+d0.05", f"oktopk+d{d}", "exdyna+d0.02", "exdyna+b0.1"]
    assert report["failed"] == [] and report["stop_at_target"]
    # every trained configuration reaches 1% at its first evaluation (step 2 of 6) and stops there; the floor runs on
    for name, r in rows.items():
        stopped = name != "compute"
        assert (r["steps"], r["stopped"]) == ((2, True) if stopped else ((400 // 2) // 32, False))
        assert r["final_accuracy"] is None and len(r["accuracy_curve"]) == stopped
        assert f"| {name} |" in stdout and "| stopped at target |" in stdout
    # the exact top-k sends in training what it sent on the simulator
    assert rows["topka+d0.05"]["sent_bytes_per_step"] == eq["reference"]["sent_bytes"]
    assert rows[f"oktopk+d{d}"]["sent_bytes_per_step"] > 0
    assert 0 < rows["exdyna+b0.1"]["sent_bytes_per_step"] < 4 * 2 * n * (2 - 1) / 2   # below the dense ring
    assert f"at equal bytes with topka at 0.05 ({eq['reference']['sent_bytes'] / 1e3:,.1f} kB per rank and step on " \
        f"the simulator): topka 0.05, oktopk {ok['density']:g}; otherwise density 0.01" in stdout
    assert f"| oktopk+d{d} |" in stdout
    assert "equal bytes" in stderr and f"[oktopk+d{d}] stopped at step 2 of 6: test acc" in stderr
