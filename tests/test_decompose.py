"""`sensai decompose` / `sensai evaluate` end to end on real Fashion-MNIST images.

The session fixture ``tiny_artifact`` (conftest) is a complete G=5 decomposition of a really trained
fmnist_cnn with tiny settings; tests that change an artifact work on a copy of it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from sensai.cli import main
from tests.helpers import local_ray


def config_of(artifact: Path):
    from sensai.pruning.decompose import DecomposeConfig

    return DecomposeConfig.from_dict(json.loads((artifact / "work" / "settings.json").read_text())["config"])


def copy_artifact(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def subnet_files(art: Path) -> dict[str, tuple[int, str]]:
    from sensai.fsutil import sha256_file

    return {p.name: (p.stat().st_mtime_ns, sha256_file(p))
            for p in sorted((art / "subnets").glob("*.safetensors"))}


# --------------------------------------------------------------------------------------------
# The artifact


def test_artifact_is_complete_and_consistent(tiny_artifact, trained_model_dir, fmnist_spec,
                                             fmnist_test):
    import onnxruntime as ort

    from sensai.artifact import load_artifact
    from sensai.data import normalize
    from sensai.fsutil import sha256_file
    from sensai.manifest import DecompositionManifest, load_manifest, load_model_record
    from sensai.merge import merge_outputs

    m = load_manifest(tiny_artifact)
    # Round trip: what is on disk is exactly what the schema produces.
    assert DecompositionManifest.model_validate(json.loads(m.model_dump_json())) == m
    record = load_model_record(trained_model_dir)
    assert m.model == "fmnist_cnn" and m.num_classes == 10 and m.source.params == record.params
    assert len(m.groups) == 5 and sorted(c for g in m.groups for c in g) == list(range(10))
    assert m.pruning["kind"] == "shrink" and m.pruning["shrink"] == 10
    assert m.pruning["zero_threshold"] == 0.005 and m.retrain["distill"] == 0.7
    assert m.retrain["optimizer"] == "adam" and m.retrain["hard_negatives"] == 0.5
    assert m.retrain["samples"] == 384 and m.retrain["epochs"] == 1
    assert set(m.stages) >= {"grouping", "stats", "prune", "retrain", "export", "evaluate"}
    for s in m.subnets:
        assert s.head == "group" and s.num_outputs == len(s.classes) + 1
        assert sha256_file(tiny_artifact / s.weights) == s.weights_sha256
        assert (tiny_artifact / s.onnx).is_file()
        # The default shrink policy: at least 10x fewer parameters and multiply-accumulates.
        assert m.source.params / s.params >= 10 and m.source.flops / s.flops >= 10
        assert s.widths and max(s.widths.values()) < 128
        assert set(s.accuracy) >= {"decomposed_top1", "original_top1", "subnet_balanced"}

    # Subnets rebuilt from the manifest alone compute what their ONNX files compute.
    art = load_artifact(tiny_artifact)
    manifest, subnets = art.manifest, art.load_subnets()
    x = normalize(fmnist_test.images[:64], fmnist_spec)
    outs = []
    for rec, net in zip(manifest.subnets, subnets):
        with torch.no_grad():
            want = net(x).numpy()
        got = ort.InferenceSession(str(tiny_artifact / rec.onnx),
                                   providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        outs.append(got)
    scores = merge_outputs(outs, manifest.groups, 10)
    np.testing.assert_allclose(scores.sum(1), 1.0, rtol=1e-5)

    ev = m.evaluation
    assert ev["images"] == 500 and 0.0 <= ev["decomposed_top1"] <= 1.0
    # A subnet that learned nothing would put the merged accuracy at chance (10%).
    assert ev["decomposed_top1"] > 0.3
    assert ev["delta_points"] == pytest.approx(100 * (ev["decomposed_top1"] - ev["original_top1"]),
                                               abs=1e-3)
    assert sum(g["images"] for g in ev["per_group"]) == 500

    rep = json.loads((tiny_artifact / "report.json").read_text())
    assert rep["decomposed"]["test_top1"] == ev["decomposed_top1"]
    assert rep["decomposed"]["min_params_reduction"] >= 10
    assert set(rep["stage_seconds"]) == set(m.stages)
    md = (tiny_artifact / "report.md").read_text()
    assert "test top-1" in md and "Subnets" in md
    for png in ("report.png", "grouping.png"):
        assert (tiny_artifact / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    grouping = json.loads((tiny_artifact / "grouping.json").read_text())
    assert grouping["groups"] == m.groups


def test_evaluate_artifact_and_cli(tiny_artifact, capsys):
    from sensai.manifest import load_manifest
    from sensai.pruning.decompose import evaluate_artifact

    m = load_manifest(tiny_artifact)
    res = evaluate_artifact(tiny_artifact, device="cpu", limit=500)
    # Same stratified subset, same subnets: the artifact's own evaluation is reproduced exactly.
    assert res["decomposed_top1"] == pytest.approx(m.evaluation["decomposed_top1"])
    assert res["original_top1"] == pytest.approx(m.evaluation["original_top1"])

    assert main(["evaluate", str(tiny_artifact), "--limit", "200", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "original   top-1" in out and "decomposed top-1" in out and "test images: 200" in out


def test_evaluate_says_n_a_for_a_group_without_test_images(tiny_artifact, capsys, monkeypatch):
    """A user's test split may hold no image of a group's classes: its top-1 is None, said as
    n/a (it was a traceback)."""
    from sensai.pruning import decompose

    res = decompose.evaluate_artifact(tiny_artifact, device="cpu", limit=100)
    res["per_group"][0].update(original_top1=None, decomposed_top1=None, images=0)
    monkeypatch.setattr(decompose, "evaluate_artifact", lambda *a, **k: res)
    assert main(["evaluate", str(tiny_artifact), "--device", "cpu"]) == 0
    assert "n/a -> n/a (0 images)" in capsys.readouterr().out


def test_load_subnets_refuses_tampered_weights(tiny_artifact, tmp_path):
    from sensai.artifact import load_artifact
    from sensai.errors import CheckpointError

    art = copy_artifact(tiny_artifact, tmp_path / "art")
    weights = art / "subnets" / "subnet_01.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CheckpointError, match="sha256"):
        load_artifact(art).load_subnets()
    assert main(["evaluate", str(art), "--limit", "50", "--device", "cpu"]) == 2


# --------------------------------------------------------------------------------------------
# Resuming


def test_rerun_resumes_and_redoes_only_a_lost_subnet(tiny_artifact, trained_model_dir, tmp_path):
    from sensai.manifest import load_manifest
    from sensai.pruning.decompose import decompose

    art = copy_artifact(tiny_artifact, tmp_path / "art")
    before = subnet_files(art)
    (art / "subnets" / "subnet_02.safetensors").unlink()
    stats_mtime = (art / "work" / "stats" / "group_00.npz").stat().st_mtime_ns
    m = decompose(trained_model_dir, art, groups=5, config=config_of(art), device="cpu",
                  use_ray=False, eval_limit=500)
    after = subnet_files(art)
    assert set(after) == set(before)
    for name in before:
        if name == "subnet_02.safetensors":
            continue
        assert after[name] == before[name], f"{name} was redone"
    assert (art / "work" / "stats" / "group_00.npz").stat().st_mtime_ns == stats_mtime
    assert load_manifest(art).subnets[2].weights_sha256 == after["subnet_02.safetensors"][1]
    assert m.stages["retrain"]["runs"] == 2 and m.stages["grouping"]["runs"] == 1


def test_failure_in_one_subnet_keeps_the_others_and_rerun_finishes(tiny_artifact,
                                                                   trained_model_dir, tmp_path):
    from sensai.manifest import load_manifest
    from sensai.pruning.decompose import decompose
    from sensai.pruning.errors import RetrainFailed
    from sensai.pruning.retrain import retrain_state

    art = copy_artifact(tiny_artifact, tmp_path / "art")
    shutil.rmtree(art / "subnets")
    shutil.rmtree(art / "work" / "retrain")
    (art / "manifest.json").unlink()
    calls = []

    def failing_for_classes_of_subnet_1(**job):
        calls.append(job["state"]["classifier.weight"].shape[0])
        if len(calls) == 2:  # the second subnet retrained (subnet 1) breaks
            raise RuntimeError("simulated out-of-memory on this worker")
        return retrain_state(**job)

    with pytest.raises(RetrainFailed, match="subnet 1 .*simulated out-of-memory") as info:
        decompose(trained_model_dir, art, groups=5, config=config_of(art), device="cpu",
                  use_ray=False, eval_limit=500, retrain_fn=failing_for_classes_of_subnet_1)
    assert list(info.value.failures) == [1]
    assert len(calls) == 5  # the others went on after the failure
    kept = subnet_files(art)
    assert sorted(kept) == [f"subnet_{g:02d}.safetensors" for g in (0, 2, 3, 4)]
    assert not (art / "manifest.json").exists()

    decompose(trained_model_dir, art, groups=5, config=config_of(art), device="cpu",
              use_ray=False, eval_limit=500)
    after = subnet_files(art)
    assert len(after) == 5
    assert all(after[name] == kept[name] for name in kept)
    assert len(load_manifest(art).subnets) == 5


# --------------------------------------------------------------------------------------------
# Errors, all one line through the CLI, before any long work


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("groups, message", [("11", "more than the model's 10 classes"),
                                              ("0", "at least 1"), ("-3", "at least 1")])
def test_cli_rejects_bad_group_counts(trained_model_dir, tmp_path, capsys, groups, message):
    out = tmp_path / "art"
    code, err = run_cli(capsys, "decompose", "--model-dir", str(trained_model_dir), "--groups",
                        groups, "--out", str(out), "--device", "cpu")
    assert code == 2 and message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_cli_rejects_missing_or_corrupt_model_dir(trained_model_dir, tiny_artifact, tmp_path,
                                                  capsys):
    code, err = run_cli(capsys, "decompose", "--model-dir", str(tmp_path / "nope"), "--groups", "2",
                        "--out", str(tmp_path / "art"))
    assert code == 2 and "does not exist" in err and len(err.splitlines()) == 1
    code, err = run_cli(capsys, "decompose", "--model-dir", str(tiny_artifact), "--groups", "2",
                        "--out", str(tmp_path / "art"))
    assert code == 2 and len(err.splitlines()) == 1 and f"{tiny_artifact} is an artifact " \
        "('sensai decompose'), not a trained model directory" in err

    broken = copy_artifact(trained_model_dir, tmp_path / "broken")
    (broken / "model.json").write_text("{not json")
    code, err = run_cli(capsys, "decompose", "--model-dir", str(broken), "--groups", "2",
                        "--out", str(tmp_path / "art"))
    assert code == 2 and "not valid JSON" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("args, message", [
    (["--policy", "magic"], "unknown pruning policy 'magic'"),
    (["--policy", "keep", "--set", "keep_fraction=1.5"], "keep_fraction must be in (0, 1]"),
    (["--policy", "params", "--set", "params_fraction=1.5"], "params_fraction must be in (0, 1]"),
    (["--set", "shrink=0.5"], "shrink must be a number >= 1"),
    (["--set", "distill_temperature=0"], "distill_temperature"),
    (["--set", "distill=2"], "distill must be in [0, 1]"),
    (["--samples-per-subnet", "1"], "--samples-per-subnet"),
    (["--set", "retrain_jobs=0"], "retrain_jobs must be at least 1"),
    (["--set", "prune_steps=0"], "prune_steps must be an integer from 1 to 10, got 0"),
    (["--set", "prune_steps=11"], "from 1 to 10"),
    (["--set", "prune_steps=2", "--policy", "keep"], "prune_steps: an iterative schedule needs a size budget"),
    (["--set", "prune_steps=2", "--retrain-epochs", "0"], "it needs --retrain-epochs of at least 1"),
])
def test_cli_rejects_bad_method_settings(trained_model_dir, tmp_path, capsys, args, message):
    code, err = run_cli(capsys, "decompose", "--model-dir", str(trained_model_dir), "--groups", "2",
                        "--out", str(tmp_path / "art"), *args)
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_cli_set_reaches_the_config_and_the_run(monkeypatch, tmp_path):
    """Each --set key lands in the DecomposeConfig the command builds (what the artifact
    records), or in how it runs; the flags beside them too."""
    import sensai.pruning.decompose as pruning_decompose
    from sensai.errors import SensaiError
    from sensai.pruning.decompose import DecomposeConfig

    seen = {}

    def stop(model_dir, out, **kwargs):
        seen.update(kwargs)
        raise SensaiError("stopped before any work")

    monkeypatch.setattr(pruning_decompose, "decompose", stop)
    assert main(["decompose", "--model-dir", "m", "-G", "2", "--out", str(tmp_path / "a"),
                 "--policy", "threshold", "--seed", "4", "--set", "theta1=0.6",
                 "--set", "use-tsne=yes", "--set", "params_fraction=none",
                 "--set", "retrain_jobs=3", "--set", "capture=false",
                 "--set", "eval_limit=50"]) == 2
    assert seen["config"] == DecomposeConfig(policy="threshold", seed=4, theta1=0.6,
                                             use_tsne=True, params_fraction=None)
    assert (seen["workers"], seen["compile_"], seen["capture"], seen["eval_limit"]) == \
        (3, False, False, 50)


@pytest.mark.parametrize("setting, message", [
    ("thet1=0.6", "--set thet1=0.6: expected KEY=VALUE with KEY one of keep_fraction, theta1"),
    ("theta1", "--set theta1: expected KEY=VALUE"),
    ("theta1=abc", "--set theta1=abc: expected a number"),
    ("stats_per_class=1.5", "--set stats_per_class=1.5: expected an integer"),
    ("use_tsne=maybe", "--set use_tsne=maybe: expected true or false"),
    ("allocation=magic", "--set allocation=magic: expected one of uniform, apoz, activity"),
    ("optimizer=lbfgs", "--set optimizer=lbfgs: expected one of sgd, adam"),
])
def test_cli_set_rejects_unknown_keys_and_bad_values_in_one_line(tmp_path, capsys, setting,
                                                                 message):
    with pytest.raises(SystemExit) as e:
        main(["decompose", "--model-dir", "m", "-G", "2", "--out", str(tmp_path / "a"),
              "--set", setting])
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # argparse's usage, then the one line that says what is wrong
    assert e.value.code == 2 and last.startswith("sensai decompose: error: ") and message in last
    assert "Traceback" not in err and not (tmp_path / "a").exists()


def test_cli_set_help_lists_every_key_with_its_default_and_meaning(capsys):
    from dataclasses import fields

    from sensai.cli.decompose import RunOptions
    from sensai.pruning.decompose import DecomposeConfig

    with pytest.raises(SystemExit) as e:
        main(["decompose", "--set", "help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    keys = [m.group(1) for line in out.splitlines()[1:] if (m := re.match(r"  (\w+)=", line))]
    flags = {"policy", "retrain_epochs", "samples_per_subnet", "seed"}  # the decisions
    assert flags == {f.name for f in fields(DecomposeConfig) if "flag" in f.metadata}
    assert keys == [f.name for f in fields(DecomposeConfig) if f.name not in flags] + \
        [f.name for f in fields(RunOptions)]
    assert "  theta1=0.73 " in out and "APoZ" in out
    flowing = " ".join(out.split())  # the meanings are wrapped to the terminal's width
    assert "allocation=uniform " in out and "(uniform, apoz, activity)" in flowing
    # The decisions stay flags, described by the same declarations.
    with pytest.raises(SystemExit):
        main(["decompose", "--help"])
    usage = capsys.readouterr().out
    assert "--theta1" not in usage and "epochs per subnet, 0 = no retraining" in usage


def test_cli_refuses_unwritable_output(trained_model_dir, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = run_cli(capsys, "decompose", "--model-dir", str(trained_model_dir), "--groups", "2",
                        "--out", str(blocker / "art"))
    assert code == 2 and "cannot write" in err and len(err.splitlines()) == 1


def test_cli_refuses_other_settings_in_an_existing_artifact(tiny_artifact, trained_model_dir,
                                                            tmp_path, capsys):
    art = copy_artifact(tiny_artifact, tmp_path / "art")
    before = subnet_files(art)
    code, err = run_cli(capsys, "decompose", "--model-dir", str(trained_model_dir), "--groups", "5",
                        "--out", str(art), "--set", "features_per_class=20",
                        "--set", "stats_per_class=40", "--samples-per-subnet", "384",
                        "--set", "batch_size=64", "--set", "shrink=5", "--no-ray")
    assert code == 2 and "other settings" in err and "shrink: 10.0 -> 5.0" in err
    assert "--force" in err and len(err.splitlines()) == 1
    assert subnet_files(art) == before  # nothing touched

    other = tmp_path / "not-an-artifact"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, err = run_cli(capsys, "decompose", "--model-dir", str(trained_model_dir), "--groups", "5",
                        "--out", str(other))
    assert code == 2 and "not empty" in err and (other / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------------------------
# Other shapes of decomposition


def test_retrain_sampling_is_balanced(fmnist_train):
    from sensai.pruning.retrain import balanced_sample, target_weights

    rng = np.random.default_rng(0)
    labels = fmnist_train.labels
    idx, tgt = balanced_sample(labels, [1, 4, 7], 4000, binary=False, rng=rng)
    assert np.bincount(tgt).tolist() == [1000, 1000, 1000, 1000]
    assert set(np.unique(labels[idx[tgt == 0]])) == set(range(10)) - {1, 4, 7}
    for pos, c in enumerate([1, 4, 7]):
        assert (labels[idx[tgt == pos + 1]] == c).all()
    # A share larger than a class repeats its images (every image at least once).
    few = np.flatnonzero(np.isin(labels, [0, 3]))[:300]
    idx, tgt = balanced_sample(labels[few], [0], 1000, binary=True, rng=rng)
    pos = idx[tgt == 1]
    assert len(pos) == 500 and set(pos) == set(np.flatnonzero(labels[few] == 0))
    assert (labels[few][idx[tgt == 0]] == 3).all()
    # Without --samples-per-subnet the retraining budget is shared by the G subnets.
    from sensai.pruning.decompose import DecomposeConfig

    assert [DecomposeConfig().samples_for(g) for g in (1, 2, 5, 10)] == [600000, 300000, 120000,
                                                                        60000]
    assert DecomposeConfig(samples_per_subnet=500).samples_for(10) == 500
    # More negatives than one share: the loss weights give every class the negatives' weight.
    idx, tgt = balanced_sample(labels, [2, 5], 4000, binary=False, rng=rng, negative_share=0.5)
    counts = np.bincount(tgt)
    assert counts.tolist() == [2000, 1000, 1000]
    w = target_weights(tgt, 3)
    assert (w * counts).tolist() == [2000.0, 2000.0, 2000.0]
    assert target_weights(np.array([0, 1, 1, 0]), 2).tolist() == [1.0, 1.0]
    # Hard negatives: half the negatives come from where the teacher is tempted (here: 50 shirts
    # it would call T-shirts); NaN marks images the teacher was not asked about.
    confusion = np.full(len(labels), np.nan)
    tempting = np.flatnonzero(labels == 6)[:50]
    confusion[tempting] = 0.9
    confusion[np.flatnonzero(labels == 8)[:50]] = 0.0
    idx, tgt = balanced_sample(labels, [0], 2000, binary=True, rng=rng, confusion=confusion,
                               hard_negatives=0.5)
    neg = idx[tgt == 0]
    assert len(neg) == 1000 and np.isin(neg, tempting).sum() >= 500
    assert not np.isin(labels[neg], [0]).any()


@pytest.mark.slow
def test_binary_decomposition_one_subnet_per_class(trained_model_dir, tmp_path):
    from sensai.pruning.decompose import DecomposeConfig, decompose

    cfg = DecomposeConfig(use_tsne=False, features_per_class=10, stats_per_class=20,
                          samples_per_subnet=128, batch_size=64, policy="keep", keep_fraction=0.25,
                          distill=0.0)
    m = decompose(trained_model_dir, tmp_path / "art", groups=10, config=cfg, device="cpu",
                  use_ray=False, eval_limit=300)
    assert m.groups == [[c] for c in range(10)]
    assert all(s.head == "binary" and s.num_outputs == 1 for s in m.subnets)
    assert all(m.source.params / s.params >= 10 for s in m.subnets)
    assert m.evaluation["images"] == 300 and m.evaluation["decomposed_top1"] > 0.2


@pytest.mark.slow
def test_cli_decompose_on_a_real_local_ray(trained_model_dir, tmp_path, capsys):
    """G=2 from scratch through the CLI with t-SNE grouping, retraining in 2 Ray tasks."""
    import ray

    from sensai.manifest import load_manifest

    with local_ray(num_cpus=2):
        node = ray.get_runtime_context().get_node_id()
        art = tmp_path / "art"
        code = main(["decompose", "--model-dir", str(trained_model_dir), "--groups", "2",
                     "--out", str(art), "--set", "features_per_class=20",
                     "--set", "stats_per_class=40", "--samples-per-subnet", "384",
                     "--set", "batch_size=64", "--set", "eval_limit=300",
                     "--set", "retrain_jobs=2", "--device", "cpu", "--set", "use_tsne=true"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert "decomposed fmnist_cnn into 2 subnets" in captured.out
    m = load_manifest(art)
    assert m.retrain["ray"] is True and m.grouping["tsne"] is True
    assert sorted(len(g) for g in m.groups) == [5, 5]
    for s in m.subnets:
        metrics = m.retrain["subnets"][str(s.index)]
        assert metrics["threads"] == 1 and metrics["samples"] == 384  # ran in a Ray task on CPU
        assert metrics["node"] == node
        assert s.num_outputs == 6
        assert metrics["step"] == "eager"  # a CPU captures nothing
        assert metrics["steps"] == 384 // 64  # batch_size reached the Ray task
    assert m.retrain["batch_size"] == 64


# --------------------------------------------------------------------------------------------
# Retraining's live progress, in process and across Ray tasks


def retrain_jobs(fmnist_spec, fmnist_train) -> list[dict]:
    """Two real retraining jobs (group heads of fmnist_cnn on classes {0, 1} and {2, 3}),
    built as the decomposition builds them."""
    from sensai.models import create_model
    from sensai.pruning.retrain import RetrainSettings, retrain_plan

    settings = RetrainSettings(samples=300, batch_size=64)
    jobs = []
    for g, classes in enumerate([[0, 1], [2, 3]]):
        idx, targets = retrain_plan(fmnist_train.labels, classes, settings, binary=False,
                                    subnet_seed=g)
        uniq, positions = np.unique(idx, return_inverse=True)
        torch.manual_seed(g)
        jobs.append({"index": g, "arch": "fmnist_cnn", "num_outputs": 3, "in_channels": 1,
                     "state": create_model("fmnist_cnn", 3, 1).state_dict(),
                     "images": fmnist_train.images[torch.from_numpy(uniq)].numpy(),
                     "positions": positions.astype(np.int64), "targets": targets, "soft": None,
                     "spec": fmnist_spec.to_dict(), "settings": settings.to_dict(),
                     "binary": False})
    return jobs


def test_retraining_in_process_reports_every_step_up_to_the_total(fmnist_spec, fmnist_train):
    from sensai.pruning.jobs import RetrainProgress, run_in_process
    from sensai.pruning.retrain import retrain_state

    jobs = retrain_jobs(fmnist_spec, fmnist_train)
    sizes = {j["index"]: len(j["positions"]) for j in jobs}
    done, failures = {}, {}
    with RetrainProgress(2, sum(sizes.values())) as progress:
        run_in_process(iter(jobs), retrain_state, "cpu", progress,
                       lambda g, state, metrics: done.update({g: metrics["samples"]}), failures)
    assert not failures and done == sizes
    assert progress.done == sizes and progress.total_done == progress.images == 600
    assert progress.finished == 2
    # Live: one report per training step of each subnet, not one at the end.
    assert progress.updates == sum(-(-n // 64) for n in sizes.values())


@pytest.mark.slow
def test_retraining_on_ray_reports_progress_from_the_tasks(fmnist_spec, fmnist_train):
    """Counts travel from the Ray tasks through the progress actor to the driver's bar."""
    from sensai.pruning.jobs import RetrainProgress, run_on_ray

    jobs = retrain_jobs(fmnist_spec, fmnist_train)
    sizes = {j["index"]: len(j["positions"]) for j in jobs}
    done, failures = {}, {}
    with local_ray(num_cpus=2), RetrainProgress(2, sum(sizes.values())) as progress:
        run_on_ray(iter(jobs), 2, "cpu", progress,
                   lambda g, state, metrics: done.update({g: metrics["samples"]}), failures, None)
    assert not failures and done == sizes
    assert progress.done == sizes and progress.total_done == progress.images
    assert progress.finished == 2
