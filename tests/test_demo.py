"""README command 1 (`sensai demo`) end to end, shrunk: real data, real training, real
decomposition through Ray, a real gateway on 127.0.0.1 and the benchmark."""

from __future__ import annotations

import json
import re

import pytest

from sensai.cli import main
from sensai.cli.demo import DEMO_EPOCHS

pytestmark = pytest.mark.slow


def test_demo_runs_every_step_and_resumes(tmp_path, capsys):
    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--model", "fmnist_cnn", "--set", "train_limit=3000",
            "--samples-per-subnet", "2000", "--images", "4", "--set", "bench_images=12"]
    assert main(args) == 0
    text = capsys.readouterr().out
    for step in ("1/5 train", "2/5 decompose", "3/5 serve", "4/5 predict", "5/5 single-image"):
        assert step in text
    # The original's whole default schedule, with its accuracy after every epoch.
    history = json.loads((out / "fmnist_cnn" / "model.json").read_text())["train"]["history"]
    assert len(history) == DEMO_EPOCHS == 2
    assert ("2 epochs, warm-up 15% then one cosine decay; test top-1 by epoch: "
            + " -> ".join(f"{h['test_top1']:.4f}" for h in history)) in text
    assert re.search(r"last epoch [+-]\d+\.\d\d points: (not converged|levelling off)", text)
    assert re.search(r"original 0\.\d{4} \(2 epochs\), decomposed", text)
    assert len(re.findall(r"test image +\d+: predicted", text)) == 4 and "/4 right" in text
    manifest = json.loads((out / "fmnist_cnn_g2" / "manifest.json").read_text())
    assert len(manifest["subnets"]) == 2
    assert manifest["retrain"]["samples"] == 2000
    bench = json.loads((out / "bench_fmnist_cnn_g2" / "bench.json").read_text())
    assert set(bench["strategies"]) >= {"single", "model-parallel", "class-parallel"}
    assert bench["settings"]["transports"] == ["inprocess", "http"]
    # Speed and accuracy side by side; no target of another model (the demo model's) printed.
    assert bench["accuracy"]["decomposed_top1"] == manifest["evaluation"]["decomposed_top1"]
    # fmnist_cnn has no target set of its own: no verdict printed, none of the demo model's
    # (vgg11_bn) in bench.json; the targets every model shares are in bench.md.
    assert "target " not in text and "accuracy_loss" not in json.dumps(bench["targets"])
    assert "slowest subnet's compute" in (out / "bench_fmnist_cnn_g2" / "bench.md").read_text()
    assert (out / "bench_fmnist_cnn_g2" / "bench.png").stat().st_size > 0

    # A second run finds the model and the artifact and does not redo them.
    assert main(args + ["--no-bench"]) == 0
    text = capsys.readouterr().out
    assert "already trained" in text and "trains again" not in text
    assert "decomposes again" not in text

    # New decomposition settings replace the demo's own artifact instead of failing.
    changed = [a if a != "2000" else "500" for a in args]
    assert main(changed + ["--no-bench"]) == 0
    text = capsys.readouterr().out
    assert "made with other settings" in text and "decomposes again" in text
    manifest = json.loads((out / "fmnist_cnn_g2" / "manifest.json").read_text())
    assert manifest["retrain"]["samples"] == 500


def test_demo_rejects_bad_arguments_in_one_line(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "d"), "--groups", "11"]) == 2
    err = capsys.readouterr().err
    assert "--groups must be between 1 and 10" in err and "Traceback" not in err
    assert main(["demo", "--out", str(tmp_path / "d"), "--set", "train_limit=3"]) == 2
    assert "train_limit must be at least 10" in capsys.readouterr().err
    assert main(["demo", "--out", str(tmp_path / "d"), "--set", "lr_warmup=1.5"]) == 2
    assert "lr_warmup must be in [0, 1), got 1.5" in capsys.readouterr().err
    assert main(["demo", "--out", str(tmp_path / "d"), "--set", "bench_images=0"]) == 2
    assert "bench_images must be at least 1" in capsys.readouterr().err
    assert main(["demo", "--out", str(tmp_path / "d"), "--model", "alexnet"]) == 2
    assert "'alexnet' is not a registry model" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    afile = tmp_path / "afile"  # an ordinary file where the working directory would go
    afile.touch()
    for out in (afile, afile / "d"):
        assert main(["demo", "--out", str(out), "--no-bench"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"cannot write to working directory {out}: " in err[0], err
        assert f"{'it' if out == afile else afile} is a file, not a directory" in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_demo_says_how_far_from_converged_a_model_is(trained_model_dir):
    from sensai.cli.demo import training_progress
    from sensai.manifest import load_model_record

    record = load_model_record(trained_model_dir)  # one real epoch
    assert "one epoch shows no trend" in training_progress(record)
    rising = record.train.model_copy(update={"completed_epochs": 2, "epochs": 2, "history": [
        {"epoch": 1, "loss": 0.5, "test_top1": 0.88}, {"epoch": 2, "loss": 0.3, "test_top1": 0.91}]})
    line = training_progress(record.model_copy(update={"train": rising}))
    assert "by epoch: 0.8800 -> 0.9100 (last epoch +3.00 points: not converged; --epochs 4" in line
    flat = rising.model_copy(update={"history": [
        {"epoch": 1, "loss": 0.3, "test_top1": 0.91}, {"epoch": 2, "loss": 0.3, "test_top1": 0.911}]})
    assert "+0.10 points: levelling off" in training_progress(record.model_copy(update={"train": flat}))
    # Trained by `sensai train` (the test split measured after the last epoch only): no trend.
    once = rising.model_copy(update={"history": [
        {"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.3, "test_top1": 0.91}]})
    line = training_progress(record.model_copy(update={"train": once}))
    assert "by epoch: 0.9100 (measured after the last epoch only" in line
    assert "--set eval_every=1" in line and "not converged" not in line
