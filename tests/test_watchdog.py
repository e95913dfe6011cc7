"""experiments/watchdog.py in-process: its limit, the pause around a first evaluation, its config values. (That it
ends a hung process, stacks written, exit 124: tests/test_multiprocess.py.)"""

import time

import pytest

import shardkit as sk
from experiments.watchdog import Watchdog, parse


def test_the_limit_the_pause_and_the_config_values(tmp_path, monkeypatch):
    fired = []
    monkeypatch.setattr(Watchdog, "_fire", lambda self, waited: fired.append(round(waited, 1)))
    dog = Watchdog(0.3, tmp_path, 0, lambda: "step 0")
    with dog:
        with dog.paused():  # a first evaluation's compile: no limit
            time.sleep(0.8)
        assert not fired
        dog.beat(1)
        time.sleep(0.8)  # a hang: past 0.3 s
    assert fired and fired[0] >= 0.3
    auto = Watchdog("auto", tmp_path, 0, lambda: "", floor_s=300, multiple=20, warmup=3)
    assert auto.limit == 300  # the floor until 3 steps are known
    auto.gaps = [20.0, 21.0, 19.0]
    assert auto.limit == 400  # 20 x the median
    assert parse("off") is None and parse("auto") == 0.0 and parse("90") == 90.0
    with pytest.raises(sk.ShardkitError, match="watchdog='-5'"):
        parse("-5")
