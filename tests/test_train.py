import json
import re

import pytest
import torch

from sensai.checkpoint import load_trained_model, save_weights
from sensai.cli import main
from sensai.errors import CheckpointError
from sensai.learning import predict_logits, top1
from sensai.manifest import load_model_record
from sensai.training.options import TrainOptions
from sensai.training.trainer import train


def test_trained_model_round_trip(trained_model_dir, fmnist_spec, fmnist_test):
    record = load_model_record(trained_model_dir)
    assert record.model == "fmnist_cnn" and record.num_classes == 10
    assert record.dataset.to_spec() == fmnist_spec
    assert record.train.completed_epochs == 1 and record.train.train_limit == 6000
    # One short epoch on 6,000 real images already beats chance by far.
    assert record.test_top1 > 0.6
    model, _ = load_trained_model(trained_model_dir)
    logits = predict_logits(model, fmnist_test, fmnist_spec, torch.device("cpu"))
    assert abs(top1(logits, fmnist_test.labels) - record.test_top1) < 1e-6
    assert not (trained_model_dir / "train_state.json").exists()


def test_corrupt_and_mismatched_checkpoints(trained_model_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(trained_model_dir, d)
    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match the hash"):
        load_trained_model(d)
    # Weights of another architecture, with a matching hash: a shape mismatch, explained.
    from sensai.models import create_model

    rec = json.loads((d / "model.json").read_text())
    rec["weights_sha256"] = save_weights(w, create_model("resnet20", 10, 1))
    (d / "model.json").write_text(json.dumps(rec))
    with pytest.raises(CheckpointError, match="do not fit the architecture"):
        load_trained_model(d)
    (d / "model.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_trained_model(d)
    rec["schema_version"] = 99
    (d / "model.json").write_text(json.dumps(rec))
    with pytest.raises(CheckpointError, match="schema version 99"):
        load_trained_model(d)


def test_resume_continues_from_last_epoch(tmp_path, fmnist_spec, fmnist_train, fmnist_test):
    out = tmp_path / "run"
    kw = dict(model_name="tests.user_models:tiny_net", spec=fmnist_spec, train_set=fmnist_train,
              test_set=fmnist_test, out_dir=out, epochs=2, options=TrainOptions(train_limit=500),
              device=torch.device("cpu"))
    calls = {"n": 0}
    real = torch.optim.SGD.step

    def crash_in_second_epoch(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 5:  # 500 images / 128 = 4 steps per epoch: the first step of epoch 2
            raise KeyboardInterrupt
        return real(self, *a, **k)

    torch.optim.SGD.step = crash_in_second_epoch
    try:
        with pytest.raises(KeyboardInterrupt):
            train(**kw)
    finally:
        torch.optim.SGD.step = real
    state = json.loads((out / "train_state.json").read_text())
    assert state["epoch"] == 1 and not (out / "model.json").exists()
    record = train(**kw)
    assert record.train.completed_epochs == 2 and len(record.train.history) == 2
    assert record.train.history[0] == state["history"][0]  # epoch 1 was not redone
    # The same settings on other data (classes renamed, another input size): not resumed.
    from dataclasses import replace

    (out / "train_state.json").write_text(json.dumps(state))
    (out / "train_state.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    for other in (replace(fmnist_spec, classes=tuple(reversed(fmnist_spec.classes))),
                  replace(fmnist_spec, input_shape=(1, 32, 32))):
        with pytest.raises(Exception, match="other settings"):
            train(**{**kw, "spec": other})
    with pytest.raises(Exception, match="other settings"):
        (out / "train_state.json").write_text(json.dumps({**state, "settings": {"x": 1}}))
        (out / "train_state.safetensors").write_bytes((out / "model.safetensors").read_bytes())
        train(**kw)


@pytest.mark.parametrize("eval_every,evaluated", [(0, [3]), (2, [2, 3]), (1, [1, 2, 3])])
def test_the_test_split_is_measured_after_the_last_epoch_and_every_nth(
        tmp_path, monkeypatch, fmnist_spec, fmnist_train, fmnist_test, eval_every, evaluated):
    import sensai.training.trainer as trainer

    seen = []
    real = trainer.predict_logits

    def counted(model, dataset, *a, **k):
        seen.append(len(dataset))
        return real(model, dataset, *a, **k)

    monkeypatch.setattr(trainer, "predict_logits", counted)
    record = train(model_name="tests.user_models:tiny_net", spec=fmnist_spec,
                   train_set=fmnist_train, test_set=fmnist_test, out_dir=tmp_path / "m",
                   epochs=3, options=TrainOptions(train_limit=300, eval_every=eval_every),
                   device=torch.device("cpu"))
    history = record.train.history
    assert [h["epoch"] for h in history] == [1, 2, 3] and all(h["loss"] > 0 for h in history)
    assert [h["epoch"] for h in history if "test_top1" in h] == evaluated
    assert seen == [len(fmnist_test)] * len(evaluated)  # the whole test split, each time
    assert record.test_top1 == history[-1]["test_top1"]
    model, _ = load_trained_model(tmp_path / "m", trust_code=True)
    assert abs(top1(real(model, fmnist_test, fmnist_spec, torch.device("cpu")),
                    fmnist_test.labels) - record.test_top1) < 1e-6


def test_cli_train_and_import(tmp_path, capsys, trained_model_dir):
    rc = main(["train", "--model", "tests.user_models:tiny_net", "--epochs", "1",
               "--set", "train_limit=300", "--set", "lr_warmup=0.25", "--device", "cpu",
               "--out", str(tmp_path / "t")])
    assert rc == 0 and "test top-1" in capsys.readouterr().out
    assert load_model_record(tmp_path / "t").train.warmup == 0.25  # the schedule is recorded
    rc = main(["train", "--model", "tests.user_models:tiny_net", "--epochs", "2",
               "--set", "train_limit=300", "--set", "eval_every=1", "--device", "cpu",
               "--out", str(tmp_path / "e")])
    assert rc == 0
    assert all("test_top1" in h for h in load_model_record(tmp_path / "e").train.history)
    # A user's own weights as a plain .pt state dict, loaded with weights_only=True.
    model, _ = load_trained_model(trained_model_dir)
    torch.save(model.state_dict(), tmp_path / "mine.pt")
    rc = main(["import", "--model", "fmnist_cnn", "--weights", str(tmp_path / "mine.pt"),
               "--out", str(tmp_path / "imp")])
    assert rc == 0
    assert abs(load_model_record(tmp_path / "imp").test_top1 -
               load_model_record(trained_model_dir).test_top1) < 1e-6


@pytest.mark.parametrize("argv,needle", [
    (["train", "--model", "vgg17", "--out", "{tmp}/x"], "unknown model 'vgg17'; known models:"),
    (["train", "--data-dir", "{tmp}/nothing", "--out", "{tmp}/x"], "dataset-fashion-mnist"),
    (["train", "--epochs", "0", "--out", "{tmp}/x"], "--epochs must be at least 1"),
    (["train", "--set", "lr_warmup=1", "--out", "{tmp}/x"], "lr_warmup must be in [0, 1), got 1"),
    (["train", "--set", "eval_every=-1", "--out", "{tmp}/x"], "eval_every must be an integer >= 0"),
    (["train", "--device", "cuda:3", "--out", "{tmp}/x"], "cuda:3"),
    (["train", "--seed", "-1", "--out", "{tmp}/x"], "--seed must be an integer from 0 to 4294967295"),
    (["train", "--seed", str(2**70), "--out", "{tmp}/x"], "--seed must be an integer from 0"),
    (["train", "--model", "json:loads", "--out", "{tmp}/x"],
     "model factory 'json:loads' must take num_classes and in_channels"),
    (["train", "--model", ":", "--out", "{tmp}/x"], "cannot import model factory ':'"),
    (["import", "--model", "fmnist_cnn", "--weights", "{tmp}/none.pt", "--out", "{tmp}/x"], "does not exist"),
    (["import", "--model", "resnet20", "--weights", "{weights}", "--out", "{tmp}/x"], "do not fit"),
    (["train", "--out", "{tmp}/afile"],
     "cannot write to output directory {tmp}/afile: it is a file, not a directory"),
    (["train", "--out", "{tmp}/afile/x"], "{tmp}/afile is a file, not a directory"),
    (["import", "--model", "fmnist_cnn", "--weights", "{weights}", "--out", "{tmp}/afile"],
     "cannot write to output directory {tmp}/afile: it is a file, not a directory"),
    (["import", "--model", "fmnist_cnn", "--weights", "{tmp}/empty.pt", "--out", "{tmp}/x"],
     "weights file {tmp}/empty.pt is empty"),
    (["import", "--model", "fmnist_cnn", "--weights", "{tmp}", "--out", "{tmp}/x"],
     "weights file {tmp} is a directory; give the file"),
    # A load error without a message is still named (its type), in one line.
    (["import", "--model", "fmnist_cnn", "--weights", "{tmp}/cut.pt", "--out", "{tmp}/x"],
     "cut.pt as a plain state dict (weights_only=True): EOFError"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch, trained_model_dir, argv, needle):
    if "cuda:3" in argv and torch.cuda.device_count() > 3:
        pytest.skip("this machine has a cuda:3")
    given = {"afile": b"", "empty.pt": b"", "cut.pt": b"\x80\x02"}  # an ordinary file; bad .pt
    for name, data in given.items():
        (tmp_path / name).write_bytes(data)
    # Refused before any data is read: an unusable --out, --epochs or --set.
    if "{tmp}/afile" in argv or {"--epochs", "--set"} & set(argv):
        monkeypatch.setattr("sensai.data.load_split", lambda *a, **k: pytest.fail("data read"))
    argv = [a.format(tmp=tmp_path, weights=trained_model_dir / "model.safetensors") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle.format(tmp=tmp_path) in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(given)  # nothing created


def test_a_model_or_an_artifact_in_out_is_not_replaced(tmp_path, capsys, trained_model_dir):
    """A finished model (model.json) or an artifact (manifest.json) in --out is someone's work,
    which artifacts point at by hash: train and import refuse it, before any data is read."""
    for folder, name in (("done", "model.json"), ("art", "manifest.json")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text("{}")
    weights = str(trained_model_dir / "model.safetensors")
    for argv, needle in (
            (["train", "--out", str(tmp_path / "done")], "holds a trained model (model.json)"),
            (["import", "--model", "fmnist_cnn", "--weights", weights, "--out",
              str(tmp_path / "art")], "holds an artifact (manifest.json)")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert [p.read_text() for p in sorted(tmp_path.rglob("*.json"))] == ["{}", "{}"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["art", "done", "manifest.json",
                                                          "model.json"]


def test_pickled_module_is_refused(tmp_path, capsys):
    from sensai.models import create_model

    torch.save(create_model("fmnist_cnn", 10, 1), tmp_path / "whole_model.pt")
    rc = main(["import", "--model", "fmnist_cnn", "--weights", str(tmp_path / "whole_model.pt"),
               "--no-eval", "--out", str(tmp_path / "x")])
    assert rc == 2 and "weights_only=True" in capsys.readouterr().err


def test_training_that_diverges_stops_in_one_line(tmp_path, capsys):
    """The loss is read every 50 steps, not every step; a run that blows up still stops at the
    next read, with one line saying what to do, and leaves no model behind."""
    rc = main(["train", "--set", "lr=1e12", "--set", "train_limit=1000", "--set", "batch_size=16",
               "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert re.search(r"training \(epoch 1\) diverged \(the loss stopped being finite at step "
                     r"\d+\); lower the learning rate \(--set lr=\.\.\.\)", last), last
    assert not (tmp_path / "x" / "model.json").exists()


def test_an_unknown_option_is_said_by_its_command(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--out", str(tmp_path / "x"), "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "sensai train: error: unrecognized arguments: --bogus", err
    assert not (tmp_path / "x").exists()


def test_flips_can_be_turned_off_and_decompose_follows_the_record(
        tmp_path, monkeypatch, fmnist_spec, fmnist_train, fmnist_test):
    """Data whose classes differ by left and right (digits, arrows) must not be mirrored:
    ``--set flip=false`` draws no flip, is recorded, and retraining follows the record unless
    told otherwise."""
    import sensai.feed as feed
    from sensai.pruning.decompose import DecomposeConfig, open_run

    drawn = []
    real = feed.flips
    monkeypatch.setattr(feed, "flips", lambda n, g: drawn.append(n) or real(n, g))
    kw = dict(model_name="tests.user_models:tiny_net", spec=fmnist_spec, train_set=fmnist_train,
              test_set=fmnist_test, epochs=1, device=torch.device("cpu"))
    mirrored = train(out_dir=tmp_path / "on", options=TrainOptions(train_limit=200), **kw)
    assert drawn and mirrored.train.flip is True
    drawn.clear()
    plain = train(out_dir=tmp_path / "off", options=TrainOptions(train_limit=200, flip=False),
                  **kw)
    assert not drawn and plain.train.flip is False
    assert load_model_record(tmp_path / "off").train.flip is False
    # The command line's key, and decompose's retraining settings from the record.
    with pytest.raises(SystemExit):  # argparse's one line
        main(["train", "--set", "flip=maybe", "--out", str(tmp_path / "x")])
    for config, want in ((DecomposeConfig(), False), (DecomposeConfig(flip=True), True)):
        run = open_run(tmp_path / "off", tmp_path / f"art-{want}", 2, config,
                       device="cpu", dev=torch.device("cpu"), data_dir=None, workers=1,
                       on_ray=False, force=False, trust_code=True, compile_=False,
                       capture=False)
        assert run.retrain_settings.flip is want
