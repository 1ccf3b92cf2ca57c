"""int8 by ONNX Runtime static quantization: QDQ format, per-channel weights, activation
ranges calibrated on training images.

Activations are uint8 and weights int8 (ORT's "U8S8"), the fast pair on x86. Without
VNNI (AVX2 only, as on the development machines) ORT multiplies u8 x s8 pairs with
VPMADDUBSW, whose 16-bit sums can saturate; `reduce_range` keeps weights to 7 bits so
they cannot, at no measurable cost in accuracy on our models (BENCHMARKS.md).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dtrain.errors import DtrainError
from dtrain.passes import images_per_pass


def _reader(images: np.ndarray, input_name: str, batch: int):
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches: Iterator[np.ndarray] = iter(images[i : i + batch] for i in range(0, len(images), batch))

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self._batches, None)
            return None if batch is None else {input_name: batch}

    return Reader()


def quantize_int8(fp32_path: Path, out_path: Path, calibration: np.ndarray, views: int = 1) -> None:
    """Write the int8 QDQ version of the fp32 ONNX network at `fp32_path` to `out_path`,
    calibrated on `calibration` (uint8 [N, 3, S, S], the network's own input), fed to the
    calibrator in passes of at most CPU_PASS pictures, each image's `views` counted
    (dtrain/passes.py). The calibrating graph keeps every activation of a pass for its
    ranges: passes of 16 images on 8 views (128 pictures) peaked at 8.1 GB at 320 px, passes
    of 2 at 1.6 GB, and wrote the same int8 file byte for byte (each pass is reduced to its
    minima and maxima, merged over the passes: the batching does not enter the ranges)."""
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quant_pre_process, quantize_static

    if len(calibration) == 0:
        raise DtrainError("no calibration images for the int8 export", "pass --calibration DIR with training images")
    input_name = onnx.load(str(fp32_path), load_external_data=False).graph.input[0].name
    with tempfile.TemporaryDirectory(prefix="dtrain-quant-") as tmp:
        # Shape inference + graph optimisation (conv+BN folding) first, as ORT advises:
        # ranges are then calibrated on the tensors that really get quantised.
        prepared = Path(tmp) / "prepared.onnx"
        try:
            quant_pre_process(str(fp32_path), str(prepared))
        except TypeError:
            # ORT's symbolic shape inference (meant for transformers' dynamic shapes) cannot
            # follow the reshape by which a network scored on several views
            # (dtrain/models/views.py) regroups its batch: it fails with a TypeError.
            # ONNX's own shape inference, which still runs, is all a CNN needs.
            quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=True)
        tail = _probability_nodes(prepared)
        quantize_static(
            str(prepared),
            str(out_path),
            _reader(calibration, input_name, images_per_pass(views, gpu=False)),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            reduce_range=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=tail,
        )


# Where a network's class scores become probabilities: from here on the graph computes
# with log-probabilities and probabilities (the views' average, the mask head's vote).
PROBABILITY_OPS = frozenset({"Softmax", "LogSoftmax"})


def _probability_nodes(path: Path) -> list[str]:
    """The names of the probability arithmetic of the ONNX file at `path` (its nodes get
    names in place where they have none: the quantiser excludes nodes by name): the (log-)softmax nodes and all
    that their outputs feed. They stay fp32: quantised to uint8 over one calibrated range,
    log-probabilities that run to -inf for a sure part lose all resolution (the pooled
    score's, dtrain/models/defect_score.py, then no longer summed to 1; its log-sigmoid
    quantised gave NaN). What stays fp32 is a handful
    of element-wise operations on [batch, classes] tensors; on a plain classifier with 8
    views it changed nothing measurable (session 27's plant model: the same 95.17 %
    agreement and threshold either way, BENCHMARKS.md session 29)."""
    import onnx

    model = onnx.load(str(path))
    graph = model.graph
    for i, node in enumerate(graph.node):
        if not node.name:
            node.name = f"dtrain_node_{i}"
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    tail: set[str] = set()
    stack = [n for n in graph.node if n.op_type in PROBABILITY_OPS]
    while stack:
        node = stack.pop()
        if node.name in tail:
            continue
        tail.add(node.name)
        for out in node.output:
            stack.extend(consumers.get(out, []))
    onnx.save(model, str(path))
    return sorted(tail)
