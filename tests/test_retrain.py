"""Retraining as the offline pipeline runs it: on held images with no per-step host reads, several
subnets at once, and the sensAI paper's 20x-smaller subnets within their budget."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from sensai.data import DatasetSpec, normalize
from sensai.errors import SensaiError
from sensai.learning import augment
from tests.test_decompose import retrain_jobs


def host_path_retrain(job: dict) -> dict[str, torch.Tensor]:
    """The retraining loop as it was before the images were held on the device: each batch
    gathered, mirrored and normalised on the host, the loss read after every step (group head,
    SGD, no distillation - what ``retrain_jobs`` asks for)."""
    from sensai.checkpoint import build_from_weights
    from sensai.feed import DeviceImages
    from sensai.learning import fast_layout
    from sensai.pruning.retrain import RetrainSettings, recalibrate_batchnorm, target_weights

    s = RetrainSettings(**job["settings"])
    spec = DatasetSpec.from_dict(job["spec"])
    model = build_from_weights(job["arch"], job["num_outputs"], job["in_channels"],
                               copy.deepcopy(job["state"]), "test")
    model.train()
    images = torch.from_numpy(job["images"])
    positions = torch.from_numpy(job["positions"])
    targets = torch.from_numpy(np.asarray(job["targets"], dtype=np.int64))
    assert s.optimizer == "sgd" and s.distill == 0
    opt = torch.optim.SGD(model.parameters(), lr=s.lr, momentum=s.momentum, nesterov=True,
                          weight_decay=s.weight_decay)
    weights = torch.as_tensor(target_weights(job["targets"], job["num_outputs"]),
                              dtype=torch.float32)
    total = max(1, math.ceil(len(positions) / s.batch_size))
    warm = max(1, int(0.03 * total))
    gen = torch.Generator().manual_seed(s.seed)
    with fast_layout(model, torch.device("cpu")) as layout:
        for step, start in enumerate(range(0, len(positions), s.batch_size)):
            lr = (s.lr * (step + 1) / warm if step < warm else
                  0.5 * s.lr * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm))))
            for g in opt.param_groups:
                g["lr"] = lr
            x = layout(normalize(augment(images[positions[start:start + s.batch_size]], gen), spec))
            y = targets[start:start + s.batch_size]
            w = weights[y]
            loss = (w * -torch.log_softmax(model(x), 1).gather(1, y[:, None])[:, 0]).sum() / w.sum()
            assert math.isfinite(float(loss.detach()))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    recalibrate_batchnorm(model, DeviceImages(images, spec, torch.device("cpu")),
                          job["positions"], batch_size=s.batch_size)
    return model.state_dict()


def test_held_images_retrain_exactly_as_the_host_path_did(fmnist_spec, fmnist_train, fmnist_test):
    """Same batches, same flips, same steps: the same subnet, bit for bit on the CPU, so the same
    accuracy as before."""
    from sensai.checkpoint import build_from_weights
    from sensai.pruning.retrain import retrain_state

    job = retrain_jobs(fmnist_spec, fmnist_train)[0]
    job.pop("index")
    before = host_path_retrain(job)
    after, metrics = retrain_state(**job, device="cpu")
    assert metrics["steps"] == -(-len(job["positions"]) // 64) and metrics["samples"] == 300
    assert math.isfinite(metrics["mean_loss"]) and math.isfinite(metrics["final_loss"])
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
    # And the subnet learnt its task: its classes (0, 1) told apart from the rest better than
    # the 1/3 of a guess.
    model = build_from_weights("fmnist_cnn", 3, 1, after, "test").eval()
    mine = np.isin(fmnist_test.labels[:1000], [0, 1])
    target = np.where(mine, fmnist_test.labels[:1000] + 1, 0)
    with torch.no_grad():
        pred = model(normalize(fmnist_test.images[:1000], fmnist_spec)).argmax(1).numpy()
    recalls = [float((pred[target == t] == t).mean()) for t in range(3)]
    assert np.mean(recalls) > 0.5


def test_subnets_at_once_equal_one_at_a_time(fmnist_spec, fmnist_train):
    """Two subnets retrained side by side (a thread each: the way one GPU is shared in process)
    come out as they do one after another, every step reported."""
    from sensai.pruning.jobs import RetrainProgress, run_in_process
    from sensai.pruning.retrain import retrain_state

    results = {}
    for at_once in (1, 2):
        jobs = retrain_jobs(fmnist_spec, fmnist_train)
        done, failures = {}, {}
        with RetrainProgress(2, 600) as progress:
            run_in_process(iter(jobs), retrain_state, "cpu", progress,
                           lambda g, state, metrics: done.update({g: (state, metrics)}), failures,
                           at_once=at_once)
        assert not failures and sorted(done) == [0, 1]
        assert progress.total_done == 600 and progress.finished == 2
        results[at_once] = done
    for g in (0, 1):
        one, both = results[1][g][0], results[2][g][0]
        for k in one:
            torch.testing.assert_close(one[k], both[k], rtol=0, atol=1e-6)
        assert results[1][g][1]["mean_loss"] == pytest.approx(results[2][g][1]["mean_loss"])


def test_a_failure_beside_others_keeps_them(fmnist_spec, fmnist_train):
    from sensai.pruning.jobs import RetrainProgress, run_in_process
    from sensai.pruning.retrain import retrain_state

    jobs = retrain_jobs(fmnist_spec, fmnist_train)
    second = jobs[1]["images"]

    def flaky(**job):
        if job["images"] is second:
            raise RuntimeError("out of memory")
        return retrain_state(**job)

    done, failures = {}, {}
    with RetrainProgress(2, 600) as progress:
        run_in_process(iter(jobs), flaky, "cpu", progress,
                       lambda g, state, metrics: done.update({g: metrics}), failures, at_once=2)
    assert sorted(done) == [0] and "out of memory" in failures[1] and progress.finished == 2


def test_gpu_share_lets_every_subnet_run_at_once():
    from sensai.pruning.jobs import gpu_share

    assert gpu_share(1, 1) == 1.0 and gpu_share(4, 2) == 1.0 and gpu_share(2, 2) == 1.0
    assert gpu_share(1, 2) == 0.5 and gpu_share(1, 10) == 0.1 and gpu_share(2, 10) == 0.2
    # A task never spans GPUs: three on two share them two and one, half a GPU each.
    assert gpu_share(2, 3) == 0.5 and gpu_share(4, 6) == 0.5
    # Ray resolves 1/10,000 of a GPU: shares are rounded down to that, so they always fit.
    assert gpu_share(1, 3) == 0.3333 and 3 * gpu_share(1, 3) <= 1
    assert gpu_share(1, 100_000) == 1e-4


def test_retraining_that_diverges_stops_in_one_line(fmnist_spec, fmnist_train):
    from sensai.pruning.retrain import retrain_state

    job = retrain_jobs(fmnist_spec, fmnist_train)[0]
    job.pop("index")
    # A plan long enough for a periodic read (every 50 steps) and a learning rate no network
    # survives.
    job["positions"] = np.tile(job["positions"], 12)
    job["targets"] = np.tile(job["targets"], 12)
    job["settings"] = {**job["settings"], "optimizer": "sgd", "lr": 1e12, "batch_size": 16}
    with pytest.raises(SensaiError, match=r"retraining diverged \(the loss stopped being finite "
                                          r"at step \d+\); lower the learning rate"):
        retrain_state(**job, device="cpu")


@pytest.mark.parametrize("groups", [2, 10])
def test_20x_decomposition_is_within_budget(trained_model_dir, tmp_path, groups):
    """The sensAI paper's regime: every subnet at most 1/20 of the original's parameters and of
    its MACs, widths in multiples of 8 (or below 8, or whole), retrained and exported."""
    from sensai.pruning.decompose import DecomposeConfig, decompose

    from tests.conftest import TINY_DECOMPOSE

    m = decompose(trained_model_dir, tmp_path / f"x20_g{groups}", groups=groups,
                  config=DecomposeConfig(**{**TINY_DECOMPOSE, "samples_per_subnet": 128,
                                            "shrink": 20.0}),
                  device="cpu", use_ray=False, eval_limit=200)
    assert len(m.subnets) == groups and m.pruning["channel_multiple"] == 8
    for s in m.subnets:
        assert s.params * 20 <= m.source.params and s.flops * 20 <= m.source.flops
        assert all(w < 8 or w % 8 == 0 for w in s.widths.values()), s.widths
        assert (tmp_path / f"x20_g{groups}" / s.onnx).is_file()
    # Equal shares of the 128 for the k + 1 targets of every subnet.
    assert 100 < m.retrain["subnets"]["0"]["samples"] <= 128
    assert m.evaluation["decomposed_top1"] is not None


def test_new_widths_are_a_new_run_for_an_artifact_made_before_them(tiny_artifact, tmp_path):
    """An artifact whose settings do not record the channel multiple was made with any width
    (what sensai did then): re-running it with today's defaults is refused as other settings,
    not resumed into a mix."""
    import json
    import shutil

    from sensai.pruning.decompose import DecomposeConfig, decompose
    from sensai.pruning.errors import SettingsMismatch

    from tests.conftest import TINY_DECOMPOSE

    art = tmp_path / "old"
    shutil.copytree(tiny_artifact, art)
    settings = json.loads((art / "work" / "settings.json").read_text())
    del settings["config"]["channel_multiple"]
    (art / "work" / "settings.json").write_text(json.dumps(settings))
    model_dir = json.loads((art / "manifest.json").read_text())["source"]["model_dir"]
    with pytest.raises(SettingsMismatch, match="channel_multiple"):
        decompose(model_dir, art, groups=5, config=DecomposeConfig(**TINY_DECOMPOSE),
                  device="cpu", use_ray=False, eval_limit=500)


@pytest.mark.slow
def test_compiled_step_learns_what_the_eager_step_does(fmnist_spec, fmnist_train):
    """``compile`` changes how a step runs (Inductor's fused kernels), not what it learns: the
    same subnet up to float rounding, a short last batch included."""
    from sensai.pruning.retrain import retrain_state

    job = retrain_jobs(fmnist_spec, fmnist_train)[0]
    job.pop("index")
    eager, m_eager = retrain_state(**job, device="cpu")
    job["settings"] = {**job["settings"], "compile": True}
    compiled, m_compiled = retrain_state(**job, device="cpu")
    assert m_compiled["steps"] == m_eager["steps"] == 5  # 300 items: 4 x 64 and one of 44
    for k, v in eager.items():
        torch.testing.assert_close(compiled[k].float(), v.float(), rtol=1e-2, atol=1e-2)
    assert m_compiled["mean_loss"] == pytest.approx(m_eager["mean_loss"], rel=1e-3)
