"""Storage addresses: the ONE place that turns a data address into an fsspec filesystem.

An address is a local path or NAS mount (`/mnt/nas/defects`), `s3://bucket/prefix`, or
anything else fsspec reaches (`gs://`, `az://`, ...). For S3-compatible stores the
endpoint comes from `storage_options={"endpoint_url": ...}` or `AWS_ENDPOINT_URL`, the
credentials from the usual AWS environment variables / config files / instance roles.

Credentials never appear in a message: errors name the address with any user-info
stripped, and every known secret value is blanked out of the text we show.

A `DataStore` is safe to hand to DataLoader workers: the filesystem object is created lazily
in each process (s3fs clients hold an event loop and sockets that must not cross a fork).

Every remote call has a time limit (`timeout`, default 60 s, `DTRAIN_STORAGE_TIMEOUT`):
on S3 a request gives up after timeout/3 s of silence (connect or read) and is tried
twice, so a stalled endpoint fails a call in about two thirds of the timeout; on top, a
metadata call is cancelled after `timeout` s and an upload after `timeout` s plus its
size at MIN_RATE, whatever the client library does.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Any, Iterator
from urllib.parse import urlsplit, urlunsplit

from dtrain.errors import DtrainError
from dtrain.extras import require

_SECRET_KEYS = ("key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
DEFAULT_TIMEOUT = 60.0
TIMEOUT_ENV = "DTRAIN_STORAGE_TIMEOUT"
MIN_RATE = 100_000  # bytes/s: an upload slower than this on average counts as stalled


def default_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        raise DtrainError(f"bad {TIMEOUT_ENV}={raw!r}", "give it in seconds, e.g. 60") from None
    if value <= 0:
        raise DtrainError(f"bad {TIMEOUT_ENV}={raw!r}", "give it in seconds, e.g. 60")
    return value


def _s3_timeouts(options: dict[str, Any], timeout: float) -> dict[str, Any]:
    """botocore limits for every request (the user's own config_kwargs win)."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", min(10.0, timeout / 3))
    config.setdefault("read_timeout", timeout / 3)
    config.setdefault("retries", {"max_attempts": 2, "mode": "standard"})  # attempts in all
    return {**options, "config_kwargs": config}


def is_url(address: str) -> bool:
    """True for `proto://...` addresses other than plain local files."""
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", address)) and not address.startswith("file://")


def redact(address: str) -> str:
    """The address without user-info (`s3://KEY:SECRET@bucket` -> `s3://bucket`)."""
    if not is_url(address):
        return address
    parts = urlsplit(address)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class DataStore:
    """A data address resolved to a filesystem and a root; names are '/'-joined below it."""

    def __init__(self, address: str, storage_options: dict[str, Any] | None = None,
                 timeout: float | None = None) -> None:
        self.address = address.rstrip("/") or "/"
        self.display = redact(self.address)
        self.options = dict(storage_options or {})
        self.timeout = timeout if timeout is not None else default_timeout()
        self.protocol = urlsplit(self.address).scheme if is_url(self.address) else "file"
        if self.protocol in ("s3", "s3a"):
            require("s3", f"the data address {self.display}")
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint and "endpoint_url" not in self.options and "client_kwargs" not in self.options:
                self.options["endpoint_url"] = endpoint
            self.options = _s3_timeouts(self.options, self.timeout)
        self._fs: Any = None
        self._root = ""
        self._pid = -1
        self._lock = threading.Lock()

    # -- process-local filesystem -------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_fs=None, _pid=-1, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def fs(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            with self._lock:
                if self._fs is None or self._pid != os.getpid():
                    import fsspec

                    options = dict(self.options)
                    if self._fs is not None and "session" not in options:
                        options.update(_forked_session(self._fs))
                    # A fresh instance per DataStore: fsspec's instance cache is keyed on the
                    # arguments, not on the credentials found in the environment.
                    with self.errors():
                        fs, root = fsspec.core.url_to_fs(self.address, skip_instance_cache=True, **options)
                    if self.protocol in ("s3", "s3a"):
                        fs.retries = 1  # botocore retries already; s3fs would multiply them
                    self._fs, self._root, self._pid = fs, root.rstrip("/"), os.getpid()
        return self._fs

    @property
    def is_local(self) -> bool:
        return self.protocol == "file"

    def _limit(self, nbytes: int = 0) -> dict[str, float]:
        """The `timeout` argument that bounds one call of an async filesystem (fsspec
        cancels it); local filesystems take none."""
        if not getattr(self.fs, "async_impl", False):
            return {}
        return {"timeout": self.timeout + nbytes / MIN_RATE}

    def path(self, name: str) -> str:
        self.fs  # noqa: B018 - resolves _root
        return f"{self._root}/{name}" if name else self._root

    def local_path(self, name: str) -> str | None:
        """A path open() can read directly, for local / NAS stores; None for remote ones."""
        return self.path(name) if self.is_local else None

    # -- operations (every one maps failures to a DtrainError naming the address) --------
    def exists(self, name: str) -> bool:
        with self.errors(name):
            return bool(self.fs.exists(self.path(name), **self._limit()))

    def size(self, name: str) -> int | None:
        """Size in bytes, or None when the object does not exist."""
        with self.errors(name):
            try:
                return int(self.fs.size(self.path(name), **self._limit()))
            except FileNotFoundError:
                return None

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """Sizes of the objects below `prefix` (one listing request), by name relative to the root."""
        with self.errors(prefix):
            try:
                found = self.fs.find(self.path(prefix), detail=True, **self._limit())
            except FileNotFoundError:
                return {}
        cut = len(self._root) + 1 if self._root else 0
        return {p[cut:]: int(d.get("size") or 0) for p, d in found.items() if d.get("type") != "directory"}

    def info(self, name: str) -> dict[str, Any]:
        with self.errors(name):
            return dict(self.fs.info(self.path(name), **self._limit()))

    def read_bytes(self, name: str) -> bytes:
        with self.errors(name):
            return bytes(self.fs.cat_file(self.path(name)))

    def read_ranges(self, names: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        """Byte ranges [start, end) of several objects; concurrent requests on object stores."""
        if not names:
            return []
        with self.errors(names[0]):
            if self.is_local:
                out = []
                for name, start, end in zip(names, starts, ends):
                    with open(self.path(name), "rb") as f:
                        f.seek(start)
                        out.append(f.read(end - start))
                return out
            paths = [self.path(n) for n in names]
            return [bytes(b) for b in self.fs.cat_ranges(paths, list(starts), list(ends), on_error="raise")]

    def iter_chunks(self, name: str, chunk: int = 8 << 20) -> Iterator[bytes]:
        with self.errors(name), self.fs.open(self.path(name), "rb", block_size=chunk) as f:
            while data := f.read(chunk):
                yield data

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.errors(name):
            self._ensure_parent(name)
            if self.is_local:  # atomic on local / NAS paths: readers never see half a file
                tmp = f"{self.path(name)}.tmp-{os.getpid()}"
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path(name))
            else:  # a single PUT is atomic on object stores
                self.fs.pipe_file(self.path(name), data, **self._limit(len(data)))

    def put_file(self, local: str, name: str) -> None:
        with self.errors(name):
            self._ensure_parent(name)
            if self.is_local:
                tmp = f"{self.path(name)}.tmp-{os.getpid()}"
                self.fs.put_file(local, tmp)
                os.replace(tmp, self.path(name))
            else:
                self.fs.put_file(local, self.path(name), **self._limit(os.path.getsize(local)))

    def delete(self, names: list[str]) -> None:
        if names:
            with self.errors(names[0]):
                self.fs.rm([self.path(n) for n in names], **self._limit())

    def get_file(self, name: str, local: str) -> None:
        with self.errors(name):
            self.fs.get_file(self.path(name), local)

    def _ensure_parent(self, name: str) -> None:
        if self.is_local:
            os.makedirs(os.path.dirname(self.path(name)) or ".", exist_ok=True)

    def check_reachable(self) -> None:
        """Fail early and clearly when the bucket (or root folder) is absent or not ours."""
        if self.is_local:
            return
        bucket = urlsplit(self.address).netloc.rsplit("@", 1)[-1]
        with self.errors():
            if self.protocol in ("s3", "s3a"):
                # HEAD bucket tells "absent" (404) from "not yours" (403); exists() hides both.
                self.fs.call_s3("head_bucket", Bucket=bucket, **self._limit())
            elif not self.fs.exists(bucket, **self._limit()):
                raise FileNotFoundError(bucket)

    # -- error mapping ------------------------------------------------------------------
    @contextlib.contextmanager
    def errors(self, name: str = "") -> Iterator[None]:
        where = f"{self.display}/{name}" if name else self.display
        try:
            yield
        except DtrainError:
            raise
        except FileNotFoundError as exc:
            if not self.is_local and _mentions_bucket(exc):
                raise DtrainError(
                    f"{where}: the bucket does not exist", "create it first, or check the address"
                ) from None
            raise DtrainError(f"{where}: not found", "check the address (dtrain data info ADDRESS)") from None
        except PermissionError as exc:
            raise DtrainError(
                f"{where}: access denied ({self._clean(exc)})",
                "check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws) and the bucket policy",
            ) from None
        except Exception as exc:  # noqa: BLE001 - any transport failure becomes one line
            kind = type(exc).__name__
            if kind in ("NoCredentialsError", "PartialCredentialsError"):
                raise DtrainError(f"{where}: no credentials found", "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws/credentials") from None
            if isinstance(exc, (ImportError, ValueError)) and "protocol" in str(exc).lower():
                raise DtrainError(f"{where}: unsupported storage protocol '{self.protocol}' ({self._clean(exc)})",
                                  "install the fsspec backend for it, or use a local path / s3://") from None
            if "Timeout" in kind or isinstance(exc, TimeoutError):
                raise DtrainError(f"{where}: the store did not answer within {self.timeout:g} s ({kind})",
                                  f"check the endpoint and the network; for a slow store raise {TIMEOUT_ENV}"
                                  " (or --timeout)") from None
            if isinstance(exc, OSError) or "Connect" in kind or "Endpoint" in kind:
                raise DtrainError(f"{where}: cannot reach the store ({kind}: {self._clean(exc)})",
                                  "check the endpoint (AWS_ENDPOINT_URL / storage_options) and the network") from None
            raise

    def _clean(self, exc: BaseException) -> str:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        secrets = [str(v) for k, v in self.options.items() if k.lower() in _SECRET_KEYS and v]
        secrets += [os.environ[k] for k in _SECRET_ENV if os.environ.get(k)]
        for secret in secrets:
            text = text.replace(secret, "***")
        return text[:200]


def _forked_session(parent_fs: Any) -> dict[str, Any]:
    """For a forked process (a loader worker) whose parent already used S3: a fresh
    aiobotocore session that reuses the parent's botocore data loader, i.e. the parsed
    service models (pure data, ~0.2 s of JSON per process); clients, connections and
    credentials stay per process."""
    parent = getattr(parent_fs, "session", None)
    if parent is None or not hasattr(parent, "get_component"):
        return {}
    from aiobotocore.session import AioSession

    session = AioSession()
    session.register_component("data_loader", parent.get_component("data_loader"))
    return {"session": session}


def _mentions_bucket(exc: BaseException) -> bool:
    text = f"{exc} {getattr(exc, '__cause__', '')}"
    return "NoSuchBucket" in text or "bucket" in text.lower()


def open_store(address: str, storage_options: dict[str, Any] | None = None, timeout: float | None = None) -> DataStore:
    return DataStore(address, storage_options, timeout)
