"""`dtrain export`: checkpoint -> a verified, self-contained model directory.

1. The network is wrapped so it takes uint8 images and normalises them itself, then
   written as ONNX (fp32, and int8) and/or a torch.export program (run in fp32, and in
   bf16 where the machine multiplies bf16 natively).
2. On the validation split the checkpoint's own P(defect) fixes the threshold for the
   target miss rate (dtrain.evaluation.metrics.choose_threshold, as evaluation does),
   unless it is given: taken from a report.json (--threshold-from; a k-fold quickstart's
   final model has no held-out images left to choose it on) or --threshold
   (given_threshold.py). A checkpoint without a validation split is then verified on
   --data's val split or its own training images, and model.json says so.
3. Every candidate backend is run over the same validation images and compared with
   the checkpoint: verdict agreement, largest |P(defect)| difference, and its miss
   rate. fp32 backends decide at the checkpoint's threshold; a quantised one (int8,
   bf16) at its own, chosen by the same rule on its own validation scores, wherever the
   threshold was chosen on the validation split, here or by the report taken
   (OWN_THRESHOLD; model.json verification.BACKEND.threshold). At any other given threshold, a
   quantised backend the export tried on its own (--quantize auto) that misses more
   than the target is left out of the directory; any other backend that does stops
   the export: nothing is published.
4. Each candidate is timed at the serving batch size; the fastest of those that
   reproduce >= 99.5 % of the checkpoint's validation verdicts (a quantised one: shown
   on enough images to bound its disagreement under 1 %) and miss no more
   defects than it is chosen (choice.py), and recorded under this machine's kind with
   the whole table; a small sample of validation inputs and the checkpoint's logits
   go with it, so that another kind of machine can re-check the choice without torch.
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
from dtrain.data.decode import FULL_BITS
from dtrain.errors import DtrainError
from dtrain.serve import backends as B
from dtrain.serve.choice import PREFER_MIN_AGREEMENT, BackendRow, MachineChoice, agreement, batch_of, pick, sample_indices, write_sample
from dtrain.serve.given_threshold import GivenThreshold, from_number, from_report
from dtrain.serve.machine import bf16_hardware, machine_kind
from dtrain.serve.model_dir import ModelCard, Preprocessing, check_replaceable, publish, staging_dir, write_card
from dtrain.serve.verify import ValData, describe_disagreement, load_val, reference_logits, verify_backend

Step = Callable[[str], None]

# Which network files a --format writes.
FORMATS: dict[str, tuple[str, ...]] = {
    "onnx": (B.ONNX_FP32,),
    "torch": (B.TORCH_PROGRAM,),
    "all": (B.ONNX_FP32, B.TORCH_PROGRAM),
}
# Backends each --quantize adds to the fp32 ones. ONNX Runtime's CPU provider has no bf16
# kernels on x86 (its one bf16 switch, mlas.enable_gemm_fastmath_arm64_bfloat16, is
# for Arm GEMMs), so bf16 runs on PyTorch.
QUANTIZED: dict[str, tuple[str, ...]] = {
    "none": (), "int8": ("ort-int8",), "bf16": ("torch-bf16",), "auto": ("ort-int8", "torch-bf16"),
}
FP32_BACKENDS = ("ort-fp32", "torch-eager", "torch-compile")
# Backends whose threshold the export chooses on their own validation scores, by the rule
# the checkpoint's was chosen by. Quantisation shifts P(defect) systematically (int8
# lowers the faintest defects' scores by 10-40 %, BENCHMARKS.md), and the chosen threshold
# lies next to a validation defect's own score, so the checkpoint's threshold on a
# quantised network's scores misses that defect: what must hold is the miss target on the
# scores of the network that runs. fp32 backends reproduce the checkpoint's scores to
# ~1e-6 and keep its threshold. A number (--threshold) or a report's threshold chosen on
# out-of-fold scores (a k-fold quickstart, whose final model has no held-out images left)
# is kept for every backend (_own_threshold_rule).
QUANTISED_BACKENDS = frozenset(QUANTIZED["auto"])
OWN_THRESHOLD = QUANTISED_BACKENDS
DEFAULT_TARGET_MISS_RATE = 0.005
# A quantised backend may be chosen only where the validation split shows, at 95 %
# confidence, that it changes under 1 in 100 of the checkpoint's verdicts (_unfaithful):
# 0 disagreements need 299 images, 1 needs 473, 2 need 628.
QUANTISED_MAX_DISAGREEMENT = 0.01
NO_BF16 = "this machine has no native bf16 (avx512_bf16/amx_bf16 or a GPU of compute capability 8+)"


class ExportOptions(StrictModel):
    checkpoint: str
    out: str
    format: Literal["onnx", "torch", "all"] = "all"
    # auto: every quantisation this machine runs natively, kept only where it is within target.
    quantize: Literal["auto", "none", "int8", "bf16"] = "auto"
    # Data root for the validation split (default: the training run's data root).
    data: str | None = None
    # Images (directory/glob) to calibrate int8 on (default: the validation split).
    calibration: str | None = None
    calibration_images: int = Field(256, ge=1)
    # None: the report's (--threshold-from), else DEFAULT_TARGET_MISS_RATE.
    target_miss_rate: float | None = Field(None, gt=0.0, lt=1.0)
    # A threshold taken instead of chosen (at most one of the two): a number, or a report.json to take it from.
    threshold: float | None = Field(None, gt=0.0, lt=1.0)
    threshold_from: str | None = None
    # How the threshold is chosen on validation (dtrain.evaluation.metrics.allowed_misses):
    # bound95, the miss rate's 95 % upper bound within target, is what the quickstart
    # evaluates with; a plant line wants the bound, not a coin flip on new parts.
    threshold_rule: Literal["rate", "bound95"] = "bound95"
    # Candidate backends to verify and time (default: every one this export can run).
    backends: list[str] | None = None
    batch: int = Field(32, ge=1)
    measure_seconds: float = Field(1.0, gt=0.0, le=10.0)


def export(opts: ExportOptions, step: Step = lambda _msg: None) -> ModelCard:
    from dtrain import __version__
    from dtrain.evaluation.metrics import choose_threshold, miss_rate, p_defect
    from dtrain.train.checkpoint import input_hw, load_for_inference, sample_bits

    out = Path(opts.out)
    check_replaceable(out)  # before a minute of work, not after
    step("loading the checkpoint")
    model, meta = load_for_inference(opts.checkpoint)
    classes, negative = list(meta["classes"]), meta["negative_class"]
    size = input_hw(meta)
    given = _given_threshold(opts, meta)
    target = _target_miss_rate(opts, given)
    kind = machine_kind()
    candidates, rows = _candidates(opts, bf16_hardware(kind))

    step("reading the validation split")
    val = load_val(opts.data, meta, choosing=given is None)
    wrapped = Deployable(model, meta["mean"], meta["std"]).eval()
    views = int(meta["config"]["model"].get("views", 1))
    ref = reference_logits(wrapped, val.images, views)
    broken = _not_finite(ref)
    if broken:
        raise DtrainError(
            f"refusing to export: the checkpoint scores {broken} of {len(ref)} {val.split} images as NaN or infinite "
            "(its weights hold NaN or overflow: a diverged run); nothing was written",
            "export an earlier checkpoint (OUTPUT/checkpoints/ckpt-epochNNNN.pt), or train again with a lower optim.lr",
        )
    from dtrain.serve.predictor import softmax64

    neg = None if negative is None else classes.index(negative)
    p_ref = p_defect(softmax64(ref), neg)
    is_defect = np.ones(len(val.labels), bool) if neg is None else val.labels != neg
    threshold_rule, threshold_source = opts.threshold_rule, f"chosen by the export on the {val.split!r} split of {val.data_cfg.root}"
    if neg is None:
        # A classifier (no defect-free class): P(defect) is 1 for every part, every verdict
        # is "defect" with the most likely class; there is no threshold to choose.
        threshold, threshold_rule, threshold_source = 0.5, "none (classification)", "none (classification)"
    elif given is None:
        threshold = float(choose_threshold(p_ref, is_defect, target, opts.threshold_rule).threshold)
    else:
        threshold, threshold_rule, threshold_source = given.threshold, given.rule, given.source
    ref_miss_rate = miss_rate(p_ref, is_defect, threshold).rate
    own_rule = _own_threshold_rule(opts, given, neg, val)
    notes = [val.note] if val.note else []
    limit, limit_text = target, f"the target {target:.2%}"
    if given is not None and ref_miss_rate > target:
        # A chosen threshold keeps the checkpoint within target; at a given one the model may
        # miss these itself (the report's test figures say how it does), so a backend is held
        # to missing no more than the checkpoint.
        limit, limit_text = ref_miss_rate, f"the checkpoint's own {ref_miss_rate:.2%}"
        notes.append(f"at the given threshold the checkpoint itself misses {ref_miss_rate:.2%} of the defective images of "
                     f"the {val.split!r} split, above the target {target:.2%}; the backends are held to missing no more")
    sample = sample_indices(len(val.images))
    # What the export tries on its own it may leave out; what was asked for by name must hold.
    droppable = set(QUANTIZED["auto"]) if opts.quantize == "auto" and opts.backends is None else set()

    staged = staging_dir(out)
    try:
        written, failed = _write_networks(opts, candidates, wrapped, size, val, staged, step, may_fail=bool(droppable),
                                          bits=sample_bits(meta), views=views)
        rows += [BackendRow(backend=n, note=f"not shipped: {failed[B.get_backend(n).network]}")
                 for n in candidates if B.get_backend(n).network in failed]
        verification, throughput = {}, {}
        for name in [n for n in candidates if B.get_backend(n).network in written]:
            step(f"verifying {name} on {len(val.images)} validation images")
            backend = B.get_backend(name)
            run = backend.runner(staged / backend.network, views)
            logits = run(val.images)
            broken = _not_finite(logits)
            if broken:
                # A NaN would also become the backend's threshold and make model.json unreadable.
                why = f"scores {broken} of {len(logits)} {val.split} images as NaN or infinite"
                if name not in droppable:
                    raise DtrainError(f"refusing to export: backend {name} {why}; nothing was written",
                                      "export without it (--backends, --quantize none)")
                rows.append(BackendRow(backend=name, note=f"not shipped: {why}"))
                continue
            chooses_own = name in OWN_THRESHOLD and own_rule is not None
            own = threshold
            if chooses_own:
                own = float(choose_threshold(p_defect(softmax64(logits), neg), is_defect, target, own_rule).threshold)
            report = verify_backend(logits, val, ref, neg, threshold, own)
            if report.miss_rate > limit and name in droppable:
                rows.append(BackendRow(backend=name, verdict_agreement=report.verdict_agreement, miss_rate=report.miss_rate,
                                       threshold=own, note=f"not shipped: {val.split} miss rate above {limit_text}"))
                continue
            _refuse_if_worse(name, report, limit, limit_text, own)
            verification[name] = report  # its threshold is the one it decides at (ModelCard.threshold_for)
            if chooses_own:
                notes.append(_own_threshold_note(name, own, threshold))
            step(f"timing {name} at batch {opts.batch}")
            throughput[name] = round(B.measure(run, batch_of(val.images, opts.batch), min_seconds=opts.measure_seconds), 1)
            why_not = _unfaithful(report, ref_miss_rate, quantised=name in QUANTISED_BACKENDS)
            if why_not and name in droppable and neg is not None and report.verdict_agreement < PREFER_MIN_AGREEMENT:
                notes.append(describe_disagreement(name, p_defect(softmax64(logits), neg), p_ref, is_defect, threshold, own,
                                                   PREFER_MIN_AGREEMENT))
            rows.append(BackendRow(
                backend=name, verdict_agreement=report.verdict_agreement, miss_rate=report.miss_rate,
                sample_agreement=agreement(run(val.images[sample]), ref[sample], classes, neg, threshold, own),
                images_per_s=throughput[name], threshold=own, eligible=not why_not, note=why_not,
            ))
        if not throughput:
            raise DtrainError("no backend could be verified for this export", f"candidates were: {', '.join(candidates)}")
        shipped = {n: B.get_backend(n).network for n in throughput}
        if B.ONNX_INT8 in written and B.ONNX_INT8 not in shipped.values():
            (staged / B.ONNX_INT8).unlink()
        write_sample(staged, val.images[sample], ref[sample])
        chosen = pick(rows)
        card = ModelCard(
            dtrain_version=__version__,
            arch=meta["config"]["model"]["arch"],
            checkpoint=str(Path(opts.checkpoint).resolve()),
            preprocessing=Preprocessing(image_size=size[0], image_width=meta.get("image_width"), mean=list(meta["mean"]),
                                        std=list(meta["std"]), sample_bits=sample_bits(meta)),
            views=views,
            classes=classes,
            negative_class=negative,
            score=meta["score"],
            threshold=threshold,
            target_miss_rate=target,
            threshold_rule=threshold_rule,
            threshold_source=threshold_source,
            reference_val_miss_rate=ref_miss_rate,
            backends=shipped,
            preferred_backend=chosen,
            throughput_images_per_s=throughput,
            throughput_batch=opts.batch,
            verification=verification,
            notes=notes,
            machine_choices={kind: MachineChoice(backend=chosen, source="export", batch=opts.batch, rows=rows)},
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


def _own_threshold_rule(opts: ExportOptions, given: GivenThreshold | None, neg: int | None, val: ValData) -> str | None:
    """The rule a quantised backend's own threshold is chosen by, or None: it keeps the checkpoint's."""
    if neg is None or val.note:  # a classifier, or no held-out images to choose on
        return None
    if given is None:
        return opts.threshold_rule
    # A report's threshold chosen on this validation split (a quickstart without k-fold) is
    # what the export would have chosen; out-of-fold scores and bare numbers are kept as given.
    return given.rule if given.on_validation else None


def _own_threshold_note(name: str, own: float, threshold: float) -> str:
    return (f"{name} decides at its own threshold {own:.4f} (the checkpoint: {threshold:.4f}), chosen by the same rule on "
            f"its own validation scores: quantisation shifts P(defect), so the miss target is kept on the scores of the "
            f"network that runs")


def _given_threshold(opts: ExportOptions, meta: dict) -> GivenThreshold | None:
    """The threshold to take instead of choosing one, checked against the checkpoint; None: choose."""
    if opts.threshold is not None and opts.threshold_from is not None:
        raise DtrainError("--threshold and --threshold-from both give the threshold", "pass one of them")
    if opts.threshold is None and opts.threshold_from is None:
        return None
    if meta["negative_class"] is None:
        raise DtrainError("the checkpoint is a classifier (no defect-free class): its verdict is its most likely class, "
                          "there is no threshold to give", "export without --threshold / --threshold-from")
    if opts.threshold is not None:
        return from_number(opts.threshold)
    return from_report(Path(opts.threshold_from), Path(opts.checkpoint), meta)


def _target_miss_rate(opts: ExportOptions, given: GivenThreshold | None) -> float:
    """--target-miss-rate, else the one the given threshold was chosen for, else the default."""
    chosen_for = given.target_miss_rate if given is not None else None
    if opts.target_miss_rate is not None and chosen_for is not None and opts.target_miss_rate != chosen_for:
        raise DtrainError(f"the threshold from {opts.threshold_from} was chosen for a target miss rate of {chosen_for:.2%}, "
                          f"not --target-miss-rate {opts.target_miss_rate:.2%}", "leave --target-miss-rate out: the report's is used")
    return opts.target_miss_rate or chosen_for or DEFAULT_TARGET_MISS_RATE


def _candidates(opts: ExportOptions, bf16_here: bool) -> tuple[list[str], list[BackendRow]]:
    """The backends to verify and time, and a row for each left out on this machine."""
    if opts.quantize == "int8" and opts.format == "torch":
        raise DtrainError("--quantize int8 runs on ONNX Runtime", "use --format onnx or --format all with --quantize int8")
    if opts.quantize == "bf16" and opts.format == "onnx":
        raise DtrainError("--quantize bf16 runs on PyTorch (autocast)", "use --format torch or --format all with --quantize bf16")
    wanted = list(FP32_BACKENDS) + list(QUANTIZED[opts.quantize])
    if opts.backends is not None:
        for name in opts.backends:
            B.get_backend(name)
        wanted = list(opts.backends)
    files = _network_files(opts)
    usable, skipped = [], []
    for name in wanted:
        backend = B.get_backend(name)
        if backend.network not in files:
            continue  # runs a network this --format does not write
        reason = backend.unavailable_reason()
        if reason is None and name == "torch-bf16" and opts.quantize == "auto" and opts.backends is None and not bf16_here:
            reason = NO_BF16  # emulated bf16 is slower than fp32: not worth timing
        if reason:
            skipped.append(BackendRow(backend=name, note=f"not tried: {reason}"))
        else:
            usable.append(name)
    for name in QUANTIZED[opts.quantize] if opts.quantize != "auto" else ():
        if name not in usable:
            raise DtrainError(f"--quantize {opts.quantize} needs backend {name}, which this export would not check",
                              f"add {name} to --backends")
    if not usable:
        raise DtrainError(f"none of the backends {', '.join(wanted)} runs a --format {opts.format} network",
                          "pick backends that match the format (ort-* for onnx, torch-* for torch)")
    return usable, skipped


def _network_files(opts: ExportOptions) -> tuple[str, ...]:
    int8 = opts.quantize in ("int8", "auto") and B.ONNX_FP32 in FORMATS[opts.format]
    return FORMATS[opts.format] + ((B.ONNX_INT8,) if int8 else ())


def _write_networks(
    opts: ExportOptions, candidates: list[str], wrapped, size: tuple[int, int], val: ValData, folder: Path, step: Step, may_fail: bool,
    bits: int = FULL_BITS, views: int = 1,
) -> tuple[set[str], dict[str, str]]:
    """The networks written, and {network: why not} for an int8 quantisation that failed
    where `may_fail` (what `--quantize auto` tries on its own it may leave out); `views`: the
    pictures the network makes of each image (calibration passes are sized by them)."""
    example = torch.from_numpy(batch_of(val.images, 2))
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
    if any(B.get_backend(n).network == B.ONNX_INT8 for n in candidates):
        from dtrain.serve.quantize import quantize_int8
        from dtrain.serve.verify import calibration_images, calibration_sample

        if opts.calibration is None:
            calib = calibration_sample(val.images, opts.calibration_images)
        else:
            step("reading calibration images")
            calib = calibration_images(opts.calibration, size, opts.calibration_images, sample_bits=bits)
        step(f"quantising to int8 (calibrating on {len(calib)} images)")
        try:
            quantize_int8(folder / B.ONNX_FP32, folder / B.ONNX_INT8, calib, views)
        except Exception as exc:  # ONNX Runtime's quantiser on a graph it cannot follow: any error type
            if not may_fail:
                raise DtrainError(f"int8 quantisation failed: {type(exc).__name__}: {exc}",
                                  "export without it (--quantize none or auto)") from exc
            step(f"int8 quantisation failed ({type(exc).__name__}: {exc}); int8 is left out")
            (folder / B.ONNX_INT8).unlink(missing_ok=True)
            return written, {B.ONNX_INT8: f"int8 quantisation failed ({type(exc).__name__})"}
        written.add(B.ONNX_INT8)
    return written, {}


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


def _not_finite(logits: np.ndarray) -> int:
    """How many images' scores hold a NaN or an infinity."""
    return int((~np.isfinite(logits).all(axis=1)).sum())


def _unfaithful(report, ref_miss_rate: float, *, quantised: bool = False) -> str:
    """Why a backend may not be chosen ("" when it may)."""
    if report.verdict_agreement < PREFER_MIN_AGREEMENT:
        return f"agreement < {PREFER_MIN_AGREEMENT:.1%}"
    if quantised:
        # A quantised network moves every score a little, and a verdict flips wherever the
        # checkpoint's margin is smaller than that move: how often is a rate, and a rate is
        # only shown on enough images. 90 of 90 agreeing leaves up to 3.3 % disagreement
        # possible at 95 % confidence, and an int8 classifier chosen that way moved 4 of 90
        # test parts' classes (BENCHMARKS.md, session 28). fp32 backends reproduce the
        # checkpoint's scores to ~1e-6 and need no such evidence.
        from dtrain.evaluation.metrics import clopper_pearson_upper

        n = report.n_images
        k = round((1.0 - report.verdict_agreement) * n)
        bound = clopper_pearson_upper(k, n)
        if bound > QUANTISED_MAX_DISAGREEMENT:
            return (f"{k} of {n} {report.split} verdicts differ: too few images to show under "
                    f"{QUANTISED_MAX_DISAGREEMENT:.0%} disagreement (95 % bound {bound:.1%})")
    if report.miss_rate > ref_miss_rate:
        return f"misses more than the checkpoint ({ref_miss_rate:.2%})"
    return ""


def _refuse_if_worse(name: str, report, limit: float, limit_text: str, threshold: float) -> None:
    if report.miss_rate > limit:
        raise DtrainError(
            f"refusing to export: with backend {name} the miss rate on the {report.split!r} split at the threshold "
            f"{threshold:.4f} is {report.miss_rate:.2%} ({round(report.miss_rate * report.n_defective)} of "
            f"{report.n_defective} defective images missed), above {limit_text}; nothing was written",
            "export without this quantisation (--quantize none), or calibrate int8 on more or more representative "
            "training images (--calibration)",
        )
