"""A hook on the service's image preparation (owner: serve): which images of a request
were decoded, with one of them held until the test lets it go."""

from __future__ import annotations

import threading


class Decodes:
    """Counts the images the service prepares; the one at `hold_at` waits for `release`, so
    that the request is answered or given up while its decoding thread is busy."""

    def __init__(self, monkeypatch, hold_at: int) -> None:
        from dtrain.serve import app as module

        self.count, self.hold_at = 0, hold_at
        self.release, self.finished = threading.Event(), threading.Event()
        prepare_bytes, prepare_all = module.prepare_bytes, module._prepare_all

        def counted(*args, **kwargs):
            self.count += 1
            if self.count == self.hold_at:
                self.release.wait(30)
            return prepare_bytes(*args, **kwargs)

        def all_of_them(*args, **kwargs):
            try:
                return prepare_all(*args, **kwargs)
            finally:
                self.finished.set()

        monkeypatch.setattr(module, "prepare_bytes", counted)
        monkeypatch.setattr(module, "_prepare_all", all_of_them)

    def after_release(self) -> int:
        """How many images the request had prepared once its thread is done."""
        self.release.set()
        assert self.finished.wait(60)
        return self.count
