"""``python -m hvd_sparse.bench convergence`` at a tiny size (1 epoch, 2-3 algorithms), each through one real
``horovodrun -np 2`` job -- PyTorch, Keras 3 and tf_keras -- so that the command cannot rot (the full run is 12
epochs of every preset)."""

import json
import subprocess
import sys

import pytest

from hvd_sparse.bench.__main__ import main

from horovod_helpers import ROOT, requires_horovod

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KEYS = {"algorithm", "test_accuracy", "epoch_seconds_median", "loss_curve", "accuracy_curve", "density_mean",
        "sent_bytes_per_step"}


@pytest.mark.horovod
@requires_horovod
def test_convergence_cli_trains_each_algorithm_in_one_horovod_job(tmp_path, capsys):
    out, png = tmp_path / "conv.json", tmp_path / "conv.png"
    # batch 16: 44 steps in the one epoch, so that dense is clearly above chance (~0.4; 0.19 at batch 32)
    assert main(["convergence", "--framework", "torch", "--workers", "2", "--epochs", "1", "--density", "0.01",
                 "--algorithms", "dense,topka,oktopk", "--batch-size", "16", "--json", str(out),
                 "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert {"framework", "workers", "epochs", "density", "results"} <= set(report)
    assert (report["framework"], report["workers"], report["epochs"], report["density"]) == ("torch", 2, 1, 0.01)
    assert [r["algorithm"] for r in report["results"]] == ["dense", "topka", "oktopk"]
    rows = {r["algorithm"]: r for r in report["results"]}
    for r in rows.values():
        assert KEYS <= set(r)
        assert len(r["loss_curve"]) == len(r["accuracy_curve"]) == 1
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["accuracy_curve"][-1] == r["test_accuracy"]
        assert r["loss_curve"][0] > 0 and r["epoch_seconds_median"] > 0 and r["sent_bytes_per_step"] > 0
    assert rows["dense"]["test_accuracy"] > 0.1                           # chance is 0.1 (10 classes)
    assert rows["dense"]["density_mean"] == 1.0
    n = 38282                                                             # the digits CNN
    assert rows["dense"]["sent_bytes_per_step"] == 2 * n * (2 - 1) / 2 * 4   # ring allreduce, float32
    for alg in ("topka", "oktopk"):
        assert 0 < rows[alg]["density_mean"] < 0.05
        assert rows[alg]["sent_bytes_per_step"] < rows["dense"]["sent_bytes_per_step"] / 10
    # the table on stdout, progress from rank 0 on stderr
    assert "| dense |" in captured.out and "| oktopk |" in captured.out
    assert "Δ vs dense (points)" in captured.out
    assert "[topka] epoch 1/1" in captured.err
    data = png.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)


@pytest.mark.horovod
@requires_horovod
@pytest.mark.parametrize("flavour, sparse, decay, epochs", [("keras", "oktopk", "none", 1),
                                                            ("tf_keras", "exdyna", "cosine", 2)])
def test_convergence_cli_keras_model_fit_in_one_horovod_job(tmp_path, capsys, flavour, sparse, decay, epochs):
    out, png = tmp_path / "conv.json", tmp_path / "conv.png"
    argv = ["convergence", "--framework", "keras", "--workers", "2", "--epochs", str(epochs), "--density", "0.01",
            "--algorithms", f"dense,{sparse}", "--warmup-epochs", "1", "--json", str(out), "--plot", str(png)]
    if flavour == "tf_keras":
        argv += ["--keras-flavour", "tf_keras"]
    if decay == "cosine":
        argv += ["--lr-decay", "cosine"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert (report["framework"], report["keras_flavour"], report["workers"], report["epochs"]) == \
        ("keras", flavour, 2, epochs)
    assert report["keras_version"] and report["numel"] == 38282       # the digits CNN, as in PyTorch
    assert [r["algorithm"] for r in report["results"]] == ["dense", sparse]
    rows = {r["algorithm"]: r for r in report["results"]}
    for r in rows.values():
        assert KEYS <= set(r)
        assert len(r["loss_curve"]) == len(r["accuracy_curve"]) == len(r["lr_curve"]) == epochs
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["accuracy_curve"][-1] == r["test_accuracy"]
        assert r["loss_curve"][0] > 0 and r["epoch_seconds_median"] > 0
        # warmup (1 epoch) ends at lr; cosine then reaches ~0 at the last step, "none" keeps lr
        assert r["lr_curve"][0] == pytest.approx(0.05)
        assert r["lr_curve"][-1] < 0.001 if decay == "cosine" else r["lr_curve"][-1] == pytest.approx(0.05)
    assert rows["dense"]["test_accuracy"] > 0.3                           # chance is 0.1 (10 classes)
    assert rows["dense"]["density_mean"] == 1.0
    assert rows["dense"]["sent_bytes_per_step"] == 2 * 38282 * (2 - 1) / 2 * 4   # ring allreduce, float32
    # ExDyna partitions one global selection between the ranks: its density is their sum, close to 0.01
    assert 0.002 < rows[sparse]["density_mean"] < 0.05
    assert 0 < rows[sparse]["sent_bytes_per_step"] < rows["dense"]["sent_bytes_per_step"] / 10
    name = "Keras 3." if flavour == "keras" else "tf_keras 2."
    assert f"{name}" in captured.out and "model.fit" in captured.out and f"| {sparse} |" in captured.out
    assert ("cosine to 0" in captured.out) == (decay == "cosine")
    assert f"[{sparse}] epoch {epochs}/{epochs}" in captured.err
    assert png.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("option", [["--keras-flavour", "tf_keras"], ["--lr-decay", "cosine"]])
def test_convergence_keras_options_need_the_keras_framework(capsys, option):
    assert main(["convergence", "--framework", "torch", *option]) == 2
    err = capsys.readouterr().err
    assert f"{option[0]} applies to --framework keras" in err


def test_convergence_unknown_framework_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["convergence", "--framework", "jax", "--workers", "2", "--epochs", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--framework" in err and "'jax'" in err and "torch, keras" in err
    assert "Traceback" not in err
    # the same from the command line: exit code 2, a message, no traceback
    proc = subprocess.run([sys.executable, "-m", "hvd_sparse.bench", "convergence", "--framework", "jax"],
                          capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2
    assert "invalid choice 'jax'" in proc.stderr and "Traceback" not in proc.stderr
