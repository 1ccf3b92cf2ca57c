"""A store that stalls or a push that is stopped: `dtrain data push` ends within its
timeout with one line, reports progress, and leaves no staging files behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

STALL_TIMEOUT = 6


@pytest.fixture
def stalled_endpoint():
    """A loopback TCP server that accepts every connection and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


def _push_env(tmp_path, **extra: str) -> dict[str, str]:
    staging = tmp_path / "tmp"
    staging.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(staging), **extra}


@pytest.mark.slow  # a `dtrain data push` process that waits out its timeout: ~11 s on the loaded 2-core machine
def test_push_to_a_stalled_endpoint_fails_within_its_timeout_in_one_line(synth_data, stalled_endpoint, tmp_path):
    env = _push_env(tmp_path, AWS_ENDPOINT_URL=stalled_endpoint, AWS_ACCESS_KEY_ID="AKIAEXAMPLE",
                    AWS_SECRET_ACCESS_KEY="not-a-real-secret", AWS_DEFAULT_REGION="us-east-1",
                    AWS_EC2_METADATA_DISABLED="true")
    # The subprocess limit leaves room for interpreter start-up on a loaded machine; a
    # push without time limits would still be retrying long after it.
    res = subprocess.run([sys.executable, "-m", "dtrain", "data", "push", str(synth_data), "s3://stalled/x",
                          "--timeout", str(STALL_TIMEOUT)], capture_output=True, text=True, env=env,
                         timeout=STALL_TIMEOUT + 60)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert lines and lines[0].startswith("dtrain: error: s3://stalled/x"), res.stderr
    assert f"did not answer within {STALL_TIMEOUT} s" in lines[0], res.stderr
    assert "Traceback" not in res.stderr and "not-a-real-secret" not in res.stderr
    assert list((tmp_path / "tmp").iterdir()) == []


def test_sigterm_mid_push_leaves_no_staging_and_progress_is_reported(synth_data, s3_server, tmp_path):
    bucket = s3_server.new_bucket()
    env = _push_env(tmp_path, **s3_server.env())
    proc = subprocess.Popen([sys.executable, "-m", "dtrain", "data", "push", str(synth_data), f"s3://{bucket}/d",
                             "--shard-size", "10kB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    first = proc.stderr.readline()  # a progress line per shard, with the rate
    assert first.startswith("push: ") and "/s" in first, first + proc.stderr.read()
    assert [p.name for p in (tmp_path / "tmp").iterdir()][0].startswith(f"dtrain-push-{proc.pid}-")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err  # as for Ctrl-C
    assert "Traceback" not in err
    assert list((tmp_path / "tmp").iterdir()) == []
