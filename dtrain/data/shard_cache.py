"""A bounded on-disk cache of whole shards from remote stores, shared by every rank and
loader worker of a node.

Reads never wait for it: a sample missing from the cache is fetched with a byte-range
request, and the first touch of a shard queues a background download of the whole
shard. A reader that had to fetch a whole shard anyway (a batch needing most of its
bytes) `offer`s the bytes instead, so the shard is not downloaded twice. Later epochs
(and the other ranks on the node) then read from local disk. Shards are checked against
the manifest's sha256 before they become visible, only one process writes a given shard
(an O_EXCL lock file), and the least recently used shards are evicted to stay under the
size limit.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dtrain.data.storage import DataStore

_STALE_LOCK_S = 600.0


class ShardCache:
    def __init__(self, directory: str, limit_bytes: int, store: DataStore, sha256: dict[str, str]) -> None:
        self.directory = directory
        self.limit = limit_bytes
        self.store = store
        self.sha256 = sha256  # shard name -> expected digest
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1
        self._queued: set[str] = set()
        self._mutex = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_pool=None, _pid=-1, _queued=set(), _mutex=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._mutex = threading.Lock()

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def get(self, name: str) -> str | None:
        """The local copy of a shard, if cached (marks it recently used)."""
        path = self.path(name)
        try:
            os.utime(path)
        except FileNotFoundError:
            return None
        return path

    def fits(self, size: int) -> bool:
        return size <= self.limit

    def want(self, name: str, size: int) -> None:
        """Queue a background download of this shard, unless it is cached or too big."""
        if self.fits(size) and self._claim(name):
            self._submit(self._install, name, size, lambda: self.store.iter_chunks(name))

    def offer(self, name: str, data: bytes) -> None:
        """Cache a whole shard the caller already holds (written in the background)."""
        if self.fits(len(data)) and self._claim(name):
            self._submit(self._install, name, len(data), lambda: iter((data,)))

    def _claim(self, name: str) -> bool:
        """True once per shard and process: the first want/offer wins, later ones are no-ops."""
        with self._mutex:
            if name in self._queued:
                return False
            self._queued.add(name)
            return True

    def _submit(self, fn, *args) -> None:
        with self._mutex:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="dtrain-shard-cache")
                self._pid = os.getpid()
            pool = self._pool
        pool.submit(fn, *args)

    def _install(self, name: str, size: int, chunks) -> None:
        path = Path(self.path(name))
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.with_name(path.name + ".lock")
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if time.time() - _mtime(lock) < _STALE_LOCK_S:
                return  # another process on this node is fetching it
            lock.unlink(missing_ok=True)
            return
        os.close(fd)
        tmp = path.with_name(f"{path.name}.part-{uuid.uuid4().hex}")
        try:
            h = hashlib.sha256()
            with open(tmp, "wb") as out:
                for chunk in chunks():
                    h.update(chunk)
                    out.write(chunk)
            if h.hexdigest() != self.sha256.get(name):
                return  # a damaged copy never enters the cache; reads stay remote
            with self._mutex:  # this process's two threads must not both fill the last room
                self._make_room(size)
                os.replace(tmp, path)
        except Exception:  # noqa: BLE001 - the cache is an optimisation; reads stay remote
            pass
        finally:
            tmp.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)

    def _make_room(self, incoming: int) -> None:
        files = []
        for root, _, names in os.walk(self.directory):
            for n in names:
                if n.endswith(".tar"):
                    p = os.path.join(root, n)
                    try:
                        st = os.stat(p)
                    except FileNotFoundError:
                        continue
                    files.append((st.st_mtime, st.st_size, p))
        used = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if used + incoming <= self.limit:
                break
            # Readers that opened it keep reading: unlink only drops the name.
            Path(p).unlink(missing_ok=True)
            used -= size

    def usage(self) -> int:
        return sum(p.stat().st_size for p in Path(self.directory).rglob("*.tar") if p.is_file())


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
