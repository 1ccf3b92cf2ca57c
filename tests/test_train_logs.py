"""The trainer's console output when it is not a terminal (under the launcher, in a log file)."""

from __future__ import annotations

import io

from dtrain.train.logs import PLAIN_EVERY_S, PlainProgress, RunLog


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_plain_progress_paces_lines_and_says_time_left():
    clock = FakeClock()
    bar = PlainProgress(total=100, done=0, clock=clock)
    lines = []
    for _ in range(100):
        clock.t += 2.0  # 2 s per step: 200 s in all
        lines.append(bar.advance(1, "epoch 1/2 loss 0.5000"))
    printed = [line for line in lines if line]
    # One line per PLAIN_EVERY_S (30 s = 15 steps) and one at the last step.
    assert len(printed) == int(200 // PLAIN_EVERY_S) + 1
    assert printed[0] == "step 15/100 (15 %) epoch 1/2 loss 0.5000, ~3 min left"  # 85 steps x 2 s = 170 s
    assert printed[1].startswith("step 30/100 (30 %)") and printed[1].endswith("~2 min left")  # 140 s
    assert printed[-2].startswith("step 90/100 (90 %)") and printed[-2].endswith("~20 s left")
    assert printed[-1] == "step 100/100 (100 %) epoch 1/2 loss 0.5000"


def test_plain_progress_of_a_resumed_run_paces_by_its_own_steps():
    clock = FakeClock()
    bar = PlainProgress(total=100, done=50, clock=clock)  # resumed at step 50
    clock.t += 40.0
    line = bar.advance(10, "epoch 2/2")
    # 10 steps in 40 s here; the 50 done before took no time in this process.
    assert line == "step 60/100 (60 %) epoch 2/2, ~3 min left"  # 40 steps x 4 s = 160 s


def test_run_log_without_a_terminal_prints_plain_lines(tmp_path):
    clock, out = FakeClock(), io.StringIO()
    log = RunLog(tmp_path, out, clock=clock)
    log.start(total_steps=4, done_steps=0, description="epoch 1/1")
    for step in range(4):
        clock.t += PLAIN_EVERY_S
        log.advance(1, f"epoch 1/1 loss {1 / (step + 1):.4f}")
    log.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "step 1/4 (25 %) epoch 1/1 loss 1.0000, ~90 s left",
        "step 2/4 (50 %) epoch 1/1 loss 0.5000, ~60 s left",
        "step 3/4 (75 %) epoch 1/1 loss 0.3333, ~30 s left",
        "step 4/4 (100 %) epoch 1/1 loss 0.2500",
    ]


def test_run_log_messages_stay_whole_lines_of_plain_text(tmp_path):
    out = io.StringIO()
    log = RunLog(tmp_path, out)
    long = "negative class: ok " + "x" * 150 + " (see [data] in train.yaml)"
    log.message(long)
    log.close()
    # One line, brackets kept: not broken at 80 columns, not read as rich markup.
    assert out.getvalue() == long + "\n"
