"""Every figure README quotes is in the data file it names: each is recomputed here from that file, and a decimal
figure in README's prose that this list does not know fails the test (add it here with its file, or drop it)."""

import json
import math
import re
import statistics
from pathlib import Path

import pytest

from hvd_sparse.core import budget

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def results(name):
    return {r["config"]: r for r in json.loads((ROOT / "docs" / name).read_text())["results"]}


def seeds(result, key):
    return [s[key] for s in result["per_seed"]]


def digits_row(config):
    """README's digits table row: step (median), seconds to 95% (median of the seeds), final accuracy (mean)."""
    r = results("train_digits_p4_recipe.json")[config]
    return (f"{r['step_seconds_median']:.3f} s", f"{statistics.median(seeds(r, 'time_to_0.95')):.1f} s",
            f"{100 * statistics.mean(seeds(r, 'final_accuracy')):.2f}%")


def below_dense(name, configs):
    """The points by which ``configs`` end below dense, paired by seed: (least, most)."""
    runs = results(name)
    dense = seeds(runs["horovod"], "final_accuracy")
    gaps = [100 * (d - a) for c in configs for d, a in zip(dense, seeds(runs[c], "final_accuracy"))]
    return min(gaps), max(gaps)


def mnist1d_gap():
    low, high = below_dense("train_mnist1d_p4_1gbit.json", ["topka+d0.01", "oktopk+d0.02373", "exdyna+d0.02445"])
    return f"{low:.1f}-{high:.1f} points below dense"


def nine_epochs_gap():
    runs = results("train_mnist1d_p4_1gbit_9epochs.json")
    gap = 100 * (statistics.mean(seeds(runs["horovod"], "final_accuracy"))
                 - statistics.mean(seeds(runs["topka+d0.01"], "final_accuracy")))
    return f"TopkA\n  is {gap:.2f} points below"


def steps_to(result, target):
    """Each seed's steps until its test accuracy first reaches ``target`` (evaluations every ``eval_every``)."""
    every = json.loads((ROOT / "docs" / "train_digits_p4_byte_budget.json").read_text())["eval_every"]
    return [every * next(i + 1 for i, (_, a) in enumerate(s["accuracy_curve"]) if a >= target)
            for s in result["per_seed"]]


def byte_budget_line():
    """The paired final-accuracy gaps to dense and the median steps to 95% over dense's, at byte_budget=0.05."""
    runs = results("train_digits_p4_byte_budget.json")
    dense = runs["horovod"]
    gap = {p: 100 * statistics.mean(d - a for d, a in zip(seeds(dense, "final_accuracy"),
                                                          seeds(runs[f"{p}+b0.05"], "final_accuracy")))
           for p in ("topka", "exdyna", "oktopk")}
    ratio = {p: statistics.median(steps_to(runs[f"{p}+b0.05"], 0.95)) / statistics.median(steps_to(dense, 0.95))
             for p in gap}
    bound = math.ceil(10 * max(gap.values())) / 10
    return (f"ends within {bound:.1f} points of dense (TopkA {gap['topka']:.2f} below, ExDyna {gap['exdyna']:.2f}, "
            f"Ok-Topk {gap['oktopk']:.2f}), and reaches 95% in {ratio['topka']:.2f}x dense's steps (TopkA), "
            f"{ratio['exdyna']:.2f}x (ExDyna), {ratio['oktopk']:.2f}x (Ok-Topk)")


def oktopk_global():
    """Ok-Topk's median steps to 95% with its global selection on every step, and before (the recipe run, the same
    seeds), dense's there, its mean final accuracy and its bytes over the run over those of before."""
    now, before = results("train_digits_p4_oktopk_global.json")["oktopk"], results("train_digits_p4_recipe.json")
    return (statistics.median(steps_to(now, 0.95)), statistics.median(steps_to(before["oktopk"], 0.95)),
            statistics.median(steps_to(before["horovod"], 0.95)),
            100 * statistics.mean(seeds(now, "final_accuracy")),
            statistics.mean(seeds(now, "sent_bytes_per_step")) / statistics.mean(seeds(before["oktopk"],
                                                                                    "sent_bytes_per_step")))


def oktopk_global_budget():
    """Ok-Topk at byte_budget=0.05 with its global selection on every step, against the dense run of the byte-budget
    file (the same seeds): median steps to 95% over dense's, the paired final-accuracy gap, and its mean sent bytes
    per step over the budget's."""
    run = json.loads((ROOT / "docs" / "train_digits_p4_oktopk_global_budget.json").read_text())
    r = {x["config"]: x for x in run["results"]}["oktopk+b0.05"]
    dense = results("train_digits_p4_byte_budget.json")["horovod"]
    gap = 100 * statistics.mean(d - a for d, a in zip(seeds(dense, "final_accuracy"), seeds(r, "final_accuracy")))
    sent = statistics.mean(seeds(r, "sent_bytes_per_step")) / (0.05 * budget.dense_bytes(run["numel"], run["workers"]))
    return statistics.median(steps_to(r, 0.95)) / statistics.median(steps_to(dense, 0.95)), gap, sent


#: (the file README names beside the figures, what README says, computed from that file)
FIGURES = [
    ("train_digits_p4_recipe.json", "| Horovod dense | {} | {} | {} |", lambda: digits_row("horovod")),
    ("train_digits_p4_recipe.json", "| DDP + PowerSGD rank 4, 2 warm-up steps | {} | {} | {} |",
     lambda: digits_row("ddp_powersgd_r4")),
    ("train_digits_p4_recipe.json", "| `topka(0.01)` | {} | {} | {} |", lambda: digits_row("topka")),
    ("train_digits_p4_recipe.json", "| `exdyna(0.01)` | {} | {} | {} |", lambda: digits_row("exdyna")),
    ("train_digits_p4_recipe.json", "| `oktopk(0.01, global_threshold_period=32)` | {} | {} | {} |",
     lambda: digits_row("oktopk")),
    ("train_digits_p4_oktopk_global.json", "reaches 95% in {} steps instead of {} (dense: {}) and ends at {:.2f}%, "
     "for {:.1f}x the bytes", oktopk_global),
    ("train_digits_p4_recipe.json", "the digits CNN ({:.1f}M parameters",
     lambda: (json.loads((ROOT / "docs" / "train_digits_p4_recipe.json").read_text())["numel"] / 1e6,)),
    ("train_digits_p4_byte_budget.json", "{}", lambda: (byte_budget_line(),)),
    ("train_digits_p4_oktopk_global_budget.json", "in {:.2f}x dense's steps, {:.2f} points below dense, sending "
     "{:.2f} of the budget", oktopk_global_budget),
    ("train_mnist1d_p4_1gbit.json", "{}", lambda: (mnist1d_gap(),)),
    ("train_mnist1d_p4_1gbit_9epochs.json", "{}", lambda: (nine_epochs_gap(),)),
]


@pytest.mark.parametrize("name, template, compute", FIGURES)
def test_each_figure_is_what_its_data_file_says(name, template, compute):
    assert f"docs/{name}" in README
    assert " ".join(template.format(*compute()).split()) in " ".join(README.split())     # wherever lines wrap


def prose(text):
    """README without its code blocks and inline code."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`]*`", "", text)


def test_readme_quotes_no_figure_without_its_data_file():
    known = set()
    for _, template, compute in FIGURES:
        known.update(re.findall(r"\d+\.\d+", template.format(*compute())))
    versions = {"0.28.1", "2.13", "2.21", "0.1.0", "0.05"}     # versions, and the byte budget the text recommends
    found = set(re.findall(r"\d+\.\d+(?:\.\d+)?", prose(README))) - versions
    assert found <= known, f"figures without a data file: {sorted(found - known)}"
