"""The artifact's accuracy and shrink, as the decomposition recorded them in its manifest, so
``bench.json`` shows speed and accuracy side by side.

Accuracy: original and decomposed top-1 from the manifest's ``evaluation`` (``sensai decompose``
evaluates both on the test split, or on a stratified subset of it with ``--set eval_limit=N``),
and the original's top-1 recorded at training (``source.test_top1``, the whole test split).
Shrink: the original's params and MACs against the largest subnet's.
"""

from __future__ import annotations

from typing import Any

from sensai.manifest import DecompositionManifest

from .stats import rounded


def accuracy(manifest: DecompositionManifest) -> dict[str, Any]:
    ev = manifest.evaluation or {}
    original = ev.get("original_top1")
    original_from = "evaluation"
    if original is None and manifest.source.test_top1 is not None:
        original, original_from = manifest.source.test_top1, "training record (source.test_top1)"
    decomposed = ev.get("decomposed_top1")
    images, limit, split = ev.get("images"), ev.get("limit"), ev.get("split", "test")
    if decomposed is None:
        measured_on = "not recorded in the manifest"
    elif limit:
        measured_on = (f"a stratified subset of {images} images of the {manifest.dataset.name} "
                       f"{split} split (sensai decompose --set eval_limit={limit})")
    else:
        measured_on = f"the whole {manifest.dataset.name} {split} split ({images} images)"
    delta = (round(100 * (decomposed - original), 3)
             if decomposed is not None and original is not None else None)
    return {"source": "the artifact's manifest (sensai decompose's evaluation)",
            "split": split, "images": images, "limit": limit,
            "measured_on": measured_on, "original_top1": rounded(original, 5),
            "original_top1_from": original_from if original is not None else None,
            "decomposed_top1": rounded(decomposed, 5), "delta_points": delta,
            "original_top1_at_training": rounded(manifest.source.test_top1, 5)}


def shrink(manifest: DecompositionManifest) -> dict[str, Any]:
    src = manifest.source
    by_params = max(manifest.subnets, key=lambda s: s.params)
    by_flops = max(manifest.subnets, key=lambda s: s.flops)
    return {"original": {"params": src.params, "flops": src.flops},
            "largest_subnet": {"params": by_params.params, "params_subnet": by_params.index,
                               "flops": by_flops.flops, "flops_subnet": by_flops.index},
            "params_ratio": round(src.params / by_params.params, 3) if by_params.params else None,
            "flops_ratio": round(src.flops / by_flops.flops, 3) if by_flops.flops else None,
            "subnets": len(manifest.subnets),
            "params_all_subnets": sum(s.params for s in manifest.subnets),
            "flops_all_subnets": sum(s.flops for s in manifest.subnets)}
