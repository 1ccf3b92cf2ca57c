"""A loaded model directory: uint8 image batches in, verdicts out.

The same arithmetic as evaluation (dtrain.evaluation.metrics): P(defect) = 1 - softmax
probability of the negative class, "defect" iff P(defect) >= threshold, and the class
shown for a defect is the most likely defect class. Softmax runs in float64 on the
logits so that P(defect) keeps its resolution next to 0 and 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dtrain.errors import DtrainError
from dtrain.serve.backends import Runner, get_backend
from dtrain.serve.model_dir import ModelCard, load_card


# Why an image whose network output is not a number (NaN or infinite logits: a broken
# export or backend) has no verdict: "p >= threshold" is false for NaN, so it read "ok".
NOT_A_NUMBER = ("the network's output for this image is not a number (NaN or infinite): not judged; "
                "the model or its backend is broken (export it again, or try another --backend)")


@dataclass(frozen=True)
class Verdict:
    verdict: str  # "ok" or "defect"; "" with an error
    cls: str
    p_defect: float
    error: str = ""  # why there is no verdict (NOT_A_NUMBER)

    def as_dict(self) -> dict[str, object]:
        return {"verdict": self.verdict, "class": self.cls, "p_defect": self.p_defect, "error": self.error}


def softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def judge(logits: np.ndarray, classes: list[str], negative_index: int | None, threshold: float) -> list[Verdict]:
    """Without a negative class (a classifier) P(defect) is 1: every verdict is "defect", with the argmax class."""
    from dtrain.evaluation.metrics import decide, p_defect

    probs = softmax64(logits)
    p_def = p_defect(probs, negative_index)
    pred = decide(probs, negative_index, threshold)
    return [
        Verdict("defect" if p >= threshold else "ok", classes[c], float(p)) if np.isfinite(p)
        else Verdict("", "", float("nan"), NOT_A_NUMBER)  # never "ok": a part nobody judged is not a good part
        for p, c in zip(p_def, pred, strict=True)
    ]


class Predictor:
    """The model of one directory on one backend (by default the one chosen for this machine kind)."""

    def __init__(self, model_dir: str | Path, backend: str | None = None, machine: str | None = None) -> None:
        from dtrain.serve.choice import backend_for

        self.dir = Path(model_dir)
        self.card: ModelCard = load_card(self.dir)
        # model.json's choice for this machine kind (`machine`, default: this one), re-checked on its first load here
        self.backend = backend or backend_for(self.dir, self.card, machine)
        if self.backend not in self.card.backends:
            get_backend(self.backend)  # an unknown name gets the list of all backends
            raise DtrainError(
                f"backend {self.backend!r} has no network in {self.dir}",
                f"this model directory runs on: {', '.join(self.card.backends)} (export with other "
                "--format/--quantize options for the others)",
            )
        impl = get_backend(self.backend)
        reason = impl.unavailable_reason()
        if reason:
            raise DtrainError(f"backend {self.backend!r} cannot run here: {reason}", f"use one of {', '.join(self.card.backends)}")
        self._run: Runner = impl.runner(self.dir / self.card.backends[self.backend], self.card.views)
        self.image_size = self.card.preprocessing.image_size
        self.input_hw = self.card.preprocessing.input_hw  # (rows, columns) every image is prepared to
        self.sample_bits = self.card.preprocessing.sample_bits
        self.threshold = self.card.threshold_for(self.backend)  # a quantised backend's own (export.py)

    def logits(self, images: np.ndarray) -> np.ndarray:
        return self._run(np.ascontiguousarray(images, dtype=np.uint8))

    def predict(self, images: np.ndarray) -> list[Verdict]:
        """uint8 [B, 3, S, S] -> one Verdict per image."""
        if len(images) == 0:
            return []
        card = self.card
        return judge(self.logits(images), card.classes, card.negative_index, self.threshold)
