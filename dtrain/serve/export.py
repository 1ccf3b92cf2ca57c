"""`dtrain export`: checkpoint -> a verified, self-contained model directory.

1. The network is wrapped so it takes uint8 images and normalises them itself, then
   written as ONNX (fp32, and int8 when asked) and/or a torch.export program.
2. On the validation split the checkpoint's own P(defect) fixes the threshold for the
   target miss rate (dtrain.inspect.metrics.choose_threshold, as evaluation does).
3. Every candidate backend is run over the same validation images and compared with
   the checkpoint: verdict agreement, largest |P(defect)| difference, and its miss
   rate at that threshold. One that misses more than the target stops the export:
   nothing is published.
4. Each candidate is timed at the serving batch size; the fastest of those that
   reproduce >= 99.5 % of the checkpoint's validation verdicts is preferred.
Everything is written to a temporary sibling of OUT and renamed into place at the end.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from dtrain.configio import StrictModel
from dtrain.errors import DtrainError
from dtrain.serve import backends as B
from dtrain.serve.model_dir import ModelCard, Preprocessing, Verification, check_replaceable, publish, staging_dir, write_card
from dtrain.serve.verify import ValData, load_val, reference_logits, verify_backend

Step = Callable[[str], None]

# Which network files a --format writes.
FORMATS: dict[str, tuple[str, ...]] = {
    "onnx": (B.ONNX_FP32,),
    "torch": (B.TORCH_PROGRAM,),
    "all": (B.ONNX_FP32, B.TORCH_PROGRAM),
}
# Backends each --quantize adds to the fp32 ones.
QUANTIZED: dict[str, tuple[str, ...]] = {"none": (), "int8": ("ort-int8",), "bf16": ("torch-bf16",)}
FP32_BACKENDS = ("ort-fp32", "torch-eager", "torch-compile")
PREFER_MIN_AGREEMENT = 0.995


class ExportOptions(StrictModel):
    checkpoint: str
    out: str
    format: Literal["onnx", "torch", "all"] = "all"
    quantize: Literal["none", "int8", "bf16"] = "none"
    # Data root for the validation split (default: the training run's data root).
    data: str | None = None
    # Images (directory/glob) to calibrate int8 on (default: the training split).
    calibration: str | None = None
    calibration_images: int = Field(256, ge=1)
    target_miss_rate: float = Field(0.005, gt=0.0, lt=1.0)
    # How the threshold is chosen on validation (dtrain.inspect.metrics.allowed_misses):
    # bound95, the miss rate's 95 % upper bound within target, is what the quickstart
    # evaluates with; a plant line wants the bound, not a coin flip on new parts.
    threshold_rule: Literal["rate", "bound95"] = "bound95"
    # Candidate backends to verify and time (default: every one this export can run).
    backends: list[str] | None = None
    batch: int = Field(32, ge=1)
    measure_seconds: float = Field(1.0, gt=0.0)


def export(opts: ExportOptions, step: Step = lambda _msg: None) -> ModelCard:
    from dtrain import __version__
    from dtrain.inspect.metrics import choose_threshold, miss_rate, p_defect
    from dtrain.train.checkpoint import load_for_inference

    out = Path(opts.out)
    check_replaceable(out)  # before a minute of work, not after
    step("loading the checkpoint")
    model, meta = load_for_inference(opts.checkpoint)
    classes, negative = list(meta["classes"]), meta["negative_class"]
    size = int(meta["image_size"])
    candidates = _candidates(opts)

    step("reading the validation split")
    val = load_val(opts.data, meta)
    wrapped = Deployable(model, meta["mean"], meta["std"]).eval()
    ref = reference_logits(wrapped, val.images)
    from dtrain.serve.predictor import softmax64

    neg = None if negative is None else classes.index(negative)
    p_ref = p_defect(softmax64(ref), neg)
    is_defect = np.ones(len(val.labels), bool) if neg is None else val.labels != neg
    threshold_rule = opts.threshold_rule
    if neg is None:
        # A classifier (no defect-free class): P(defect) is 1 for every part, every verdict
        # is "defect" with the most likely class; there is no threshold to choose.
        threshold, threshold_rule = 0.5, "none (classification)"
    else:
        threshold = float(choose_threshold(p_ref, is_defect, opts.target_miss_rate, opts.threshold_rule).threshold)

    staged = staging_dir(out)
    try:
        written = _write_networks(opts, wrapped, size, val, staged, step)
        names = [n for n in candidates if B.get_backend(n).network in written]
        verification, throughput = {}, {}
        for name in names:
            step(f"verifying {name} on {len(val.images)} validation images")
            backend = B.get_backend(name)
            run = backend.load(staged / backend.network)
            report = verify_backend(run, val, ref, neg, threshold)
            _refuse_if_worse(name, report, opts, threshold)
            verification[name] = report
            step(f"timing {name} at batch {opts.batch}")
            throughput[name] = round(B.measure(run, _batch_of(val.images, opts.batch), min_seconds=opts.measure_seconds), 1)
        if not throughput:
            raise DtrainError("no backend could be verified for this export", f"candidates were: {', '.join(candidates)}")
        preferred = _prefer(throughput, verification)
        card = ModelCard(
            dtrain_version=__version__,
            arch=meta["config"]["model"]["arch"],
            checkpoint=str(Path(opts.checkpoint).resolve()),
            preprocessing=Preprocessing(image_size=size, mean=list(meta["mean"]), std=list(meta["std"])),
            classes=classes,
            negative_class=negative,
            threshold=threshold,
            target_miss_rate=opts.target_miss_rate,
            threshold_rule=threshold_rule,
            reference_val_miss_rate=miss_rate(p_ref, is_defect, threshold).rate,
            backends={n: B.get_backend(n).network for n in names},
            preferred_backend=preferred,
            throughput_images_per_s=throughput,
            throughput_batch=opts.batch,
            verification=verification,
        )
        write_card(staged, card)
        publish(staged, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return card


class Deployable(torch.nn.Module):
    """`net` behind a uint8 -> normalised float input stage, so every exported network
    carries its preprocessing and a plant cannot feed it wrongly scaled pixels."""

    def __init__(self, net: torch.nn.Module, mean, std) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("shift", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1) * 255.0)
        self.register_buffer("scale", 1.0 / (torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1) * 255.0))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net((images.float() - self.shift) * self.scale)


def _candidates(opts: ExportOptions) -> list[str]:
    wanted = list(FP32_BACKENDS) + list(QUANTIZED[opts.quantize])
    if opts.backends is not None:
        for name in opts.backends:
            B.get_backend(name)
        wanted = [n for n in opts.backends]
    files = FORMATS[opts.format] + ((B.ONNX_INT8,) if opts.quantize == "int8" else ())
    usable = [n for n in wanted if B.get_backend(n).network in files and not B.get_backend(n).unavailable_reason()]
    if opts.quantize == "int8" and opts.format == "torch":
        raise DtrainError("--quantize int8 runs on ONNX Runtime", "use --format onnx or --format all with --quantize int8")
    if opts.quantize == "bf16" and opts.format == "onnx":
        raise DtrainError("--quantize bf16 runs on PyTorch (autocast)", "use --format torch or --format all with --quantize bf16")
    for name in QUANTIZED[opts.quantize]:
        if name not in usable:
            raise DtrainError(f"--quantize {opts.quantize} needs backend {name}, which this export would not check",
                              f"add {name} to --backends")
    if not usable:
        raise DtrainError(f"none of the backends {', '.join(wanted)} runs a --format {opts.format} network",
                          "pick backends that match the format (ort-* for onnx, torch-* for torch)")
    return usable


def _write_networks(opts: ExportOptions, wrapped, size: int, val: ValData, folder: Path, step: Step) -> set[str]:
    example = torch.from_numpy(_batch_of(val.images, 2))
    dynamic = ({0: torch.export.Dim("batch", min=1, max=65536)},)
    written: set[str] = set()
    if B.ONNX_FP32 in FORMATS[opts.format]:
        step("exporting ONNX")
        _export_onnx(wrapped, example, dynamic, folder / B.ONNX_FP32)
        written.add(B.ONNX_FP32)
    if B.TORCH_PROGRAM in FORMATS[opts.format]:
        step("exporting the torch program")
        torch.export.save(torch.export.export(wrapped, (example,), dynamic_shapes=dynamic), str(folder / B.TORCH_PROGRAM))
        written.add(B.TORCH_PROGRAM)
    if opts.quantize == "int8":
        from dtrain.serve.quantize import quantize_int8
        from dtrain.serve.verify import calibration_images

        step("reading calibration images")
        calib = calibration_images(opts.calibration, val.data_cfg, size, opts.calibration_images)
        step(f"quantising to int8 (calibrating on {len(calib)} images)")
        quantize_int8(folder / B.ONNX_FP32, folder / B.ONNX_INT8, calib)
        written.add(B.ONNX_INT8)
    return written


def _export_onnx(wrapped, example, dynamic, path: Path) -> None:
    import contextlib
    import io
    import warnings

    # The exporter reports its stages on stdout; the CLI shows its own progress instead.
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapped, (example,), str(path), dynamo=True, input_names=["images"], output_names=["logits"],
            dynamic_shapes=dynamic, external_data=False, verbose=False,
        )


def _refuse_if_worse(name: str, report, opts: ExportOptions, threshold: float) -> None:
    if report.miss_rate > opts.target_miss_rate:
        raise DtrainError(
            f"refusing to export: with backend {name} the validation miss rate at the threshold {threshold:.4f} "
            f"is {report.miss_rate:.2%} ({round(report.miss_rate * report.n_defective)} of {report.n_defective} "
            f"defective images missed), above the target {opts.target_miss_rate:.2%}; nothing was written",
            "export without this quantisation (--quantize none), or calibrate int8 on more or more representative "
            "training images (--calibration)",
        )


def _prefer(throughput: dict[str, float], verification: dict[str, Verification]) -> str:
    """The fastest backend among those that reproduce the checkpoint's validation
    verdicts (a faster one that flips more of them is kept in the directory, not
    preferred); without any such, the most faithful."""
    faithful = [n for n in throughput if verification[n].verdict_agreement >= PREFER_MIN_AGREEMENT]
    if faithful:
        return max(faithful, key=throughput.__getitem__)
    return max(throughput, key=lambda n: (verification[n].verdict_agreement, throughput[n]))


def _batch_of(images: np.ndarray, n: int) -> np.ndarray:
    """Exactly n images, repeating the validation images when there are fewer."""
    reps = -(-n // max(len(images), 1))
    return np.ascontiguousarray(np.concatenate([images] * reps)[:n])
