"""Inference backends, registered by name: each turns a network file of a model directory
into a callable `uint8 [B, 3, S, S] -> float32 logits [B, C]`.

A torch.export program is loaded weights-only (`load_program`): model.pt2 is a zip of
pickles, and a crafted one would otherwise run code when loaded.

Normalisation lives inside every exported network (see export.py), so a backend only
moves bytes in and logits out; P(defect) and verdicts are computed once, in
predictor.py, the same way for all of them.
"""

from __future__ import annotations

import difflib
import os
import pickle
import shutil
import time
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dtrain.errors import DtrainError
from dtrain.passes import images_per_pass, in_passes

Runner = Callable[[np.ndarray], np.ndarray]

# Network files a model directory may hold (export.py writes them).
ONNX_FP32 = "model.onnx"
ONNX_INT8 = "model.int8.onnx"
TORCH_PROGRAM = "model.pt2"


class Backend(ABC):
    name: str
    network: str  # the file in the model directory this backend runs
    summary: str

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run on this machine, or None when it can."""
        return None

    @abstractmethod
    def load(self, path: Path) -> Runner: ...

    def on_gpu(self) -> bool:
        """Whether the networks this backend loads run on a GPU here."""
        return False

    def runner(self, path: Path, views: int) -> Runner:
        """The network at `path`, run on batches of any size in passes of at most
        CPU_PASS / GPU_PASS pictures, each image's `views` counted (dtrain/passes.py): a
        batch of 32 parts on 8 views was one pass of 256 pictures, 3.4 GB at 320 px."""
        return in_passes(self.load(path), images_per_pass(views, self.on_gpu()))


BACKENDS: dict[str, Backend] = {}


def register(cls: type[Backend]) -> type[Backend]:
    BACKENDS[cls.name] = cls()
    return cls


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(BACKENDS), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise DtrainError(f"unknown backend {name!r}", f"{hint}valid backends: {', '.join(BACKENDS)}") from None


class _OnnxRuntime(Backend):
    def unavailable_reason(self) -> str | None:
        from dtrain.extras import missing

        return "onnxruntime is not installed: pip install 'dtrain[serve]'" if missing(["onnxruntime"]) else None

    def load(self, path: Path) -> Runner:
        import onnxruntime as ort

        from dtrain.cores import usable_cores

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Idle intra-op threads would otherwise spin between batches, taking the CPU
        # from the decoding threads that feed the next batch.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # One intra-op thread per core this process may use (ORT's default counts the
        # machine's physical cores, too many under taskset or a container's cpuset).
        # Inference is ~85 % of `dtrain inspect`'s work, so it gets every core; the
        # decoding threads run only while their bounded queue has room (inspect_batch.py).
        opts.intra_op_num_threads = usable_cores()
        session = ort.InferenceSession(str(path), sess_options=opts, providers=_ort_providers())
        input_name = session.get_inputs()[0].name

        def run(images: np.ndarray) -> np.ndarray:
            return session.run(None, {input_name: images})[0]

        return run

    def on_gpu(self) -> bool:
        return _ort_providers()[0] == "CUDAExecutionProvider"


def _ort_providers() -> list[str]:
    import onnxruntime as ort

    # CUDA where this onnxruntime build and the machine have it; the CPU provider always.
    preferred = ("CUDAExecutionProvider", "CPUExecutionProvider")
    available = set(ort.get_available_providers())
    return [p for p in preferred if p in available]


@register
class OrtFp32(_OnnxRuntime):
    name = "ort-fp32"
    network = ONNX_FP32
    summary = "ONNX Runtime, fp32 graph with fused conv+BN"


@register
class OrtInt8(_OnnxRuntime):
    name = "ort-int8"
    network = ONNX_INT8
    summary = "ONNX Runtime, int8 QDQ graph (static, per-channel, calibrated)"


class _Torch(Backend):
    """The torch.export program on the GPU when there is one (batches go there and the
    logits come back), else on the CPU."""

    network = TORCH_PROGRAM

    def unavailable_reason(self) -> str | None:
        from dtrain.extras import missing

        # An inspection PC may install dtrain[serve] without torch: then only the ONNX backends run.
        return "torch is not installed" if missing(["torch"]) else None

    def on_gpu(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def _module(self, path: Path):
        import torch

        program = load_program(path)
        if torch.cuda.is_available():
            from torch.export.passes import move_to_device_pass

            # The program was exported on the CPU: its weights and any device named in
            # its graph move with it.
            program = move_to_device_pass(program, "cuda")
        return program.module()

    def _wrap(self, module, *, bf16: bool = False) -> Runner:
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

        def run(images: np.ndarray) -> np.ndarray:
            x = torch.from_numpy(images).to(device)
            with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                return module(x).float().cpu().numpy()

        return run


def load_program(path: Path):
    """torch.export.load without running code from the file. A .pt2 archive holds pickles,
    which torch.export.load reads with weights_only=False (or falls back to it), so every
    torch.load inside it is forced weights-only, and an archive with pickled objects
    (custom or opaque constants, which dtrain export never writes) is refused unread."""
    import torch
    from torch.export.pt2_archive.constants import CUSTOM_OBJ_FILENAME_PREFIX, OPAQUE_OBJ_FILENAME_PREFIX

    refusal = f"refused to load {path}: the program holds Python objects besides tensors, which could run code when loaded"
    hint = "export the model again with dtrain export"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile) as exc:
        raise DtrainError(f"cannot read {path} as a torch.export program: {exc}", hint) from None
    if any(Path(n).name.startswith((CUSTOM_OBJ_FILENAME_PREFIX, OPAQUE_OBJ_FILENAME_PREFIX)) for n in names):
        raise DtrainError(refusal, hint)
    previous = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"  # read by torch.load at every call
    try:
        return torch.export.load(str(path))
    except pickle.UnpicklingError:
        raise DtrainError(refusal, hint) from None
    finally:
        if previous is None:
            del os.environ[FORCE_WEIGHTS_ONLY]
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = previous


FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


@register
class TorchEager(_Torch):
    name = "torch-eager"
    summary = "PyTorch eager (the exported program run op by op), fp32"

    def load(self, path: Path) -> Runner:
        return self._wrap(self._module(path))


@register
class TorchCompile(_Torch):
    name = "torch-compile"
    summary = "torch.compile (Inductor), fp32; compiles on the first batch"

    def unavailable_reason(self) -> str | None:
        # Inductor's CPU backend generates C++ and needs a compiler at run time.
        return super().unavailable_reason() or (None if shutil.which("cc") or shutil.which("gcc") else "no C compiler (Inductor needs one)")

    def load(self, path: Path) -> Runner:
        import torch

        return self._wrap(torch.compile(self._module(path), dynamic=True))


@register
class TorchBf16(_Torch):
    name = "torch-bf16"
    summary = "PyTorch eager under bf16 autocast (fast only with AMX / AVX512-BF16 or a GPU)"

    def load(self, path: Path) -> Runner:
        return self._wrap(self._module(path), bf16=True)


def measure(run: Runner, images: np.ndarray, *, min_seconds: float = 1.0, clock=time.perf_counter) -> float:
    """Images per second of `run` on `images` (one batch): one warm-up call (compilation,
    allocator), then repeated calls for at least `min_seconds` and at least 3 calls."""
    run(images)
    calls, start = 0, clock()
    while True:
        run(images)
        calls += 1
        elapsed = clock() - start
        if calls >= 3 and elapsed >= min_seconds:
            return calls * len(images) / elapsed
