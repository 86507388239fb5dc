"""Ray starts its workers at niceness 15; a replica runs at 0: a local instance is started with
``worker_niceness`` 0, and a replica on a cluster started without it lowers its own threads' niceness
or says, in one line, how to fix it.  No Ray needed: the functions alone, in a child process where
niceness changes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ditattn.server import rayserve

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no os.setpriority on this platform")

CHILD = r"""
import os, sys, threading, time, json
from ditattn.server.rayserve import raise_priority
os.nice(10)                                   # the main thread (on Linux, niceness is per thread)
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()                                     # inherits 10
why = raise_priority()
later = threading.Thread(target=stop.wait)
later.start()                                 # started after: inherits what the main thread has now
nice = [os.getpriority(os.PRIO_PROCESS, int(x)) for x in os.listdir("/proc/self/task")]
stop.set()
print(json.dumps({"why": why, "nice": nice}))
"""


def _can_lower_niceness() -> bool:
    """Whether this process holds CAP_SYS_NICE (bit 23 of its effective capabilities)."""
    try:
        with open("/proc/self/status") as f:
            cap = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(cap, 16) >> 23 & 1)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_a_reniced_process_comes_back_to_0_or_says_why():
    import json

    env = {k: v for k, v in os.environ.items() if k != rayserve.NICENESS_ENV}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["nice"]) == 3
    if _can_lower_niceness():
        assert got["why"] is None and got["nice"] == [0, 0, 0]
    else:
        assert got["nice"] == [10, 10, 10]
        assert "niceness 10" in got["why"] and "RAY_worker_niceness=0" in got["why"]


def test_refusal_names_the_niceness_and_the_fix(monkeypatch):
    monkeypatch.delenv(rayserve.NICENESS_ENV, raising=False)
    monkeypatch.setattr(os, "getpriority", lambda which, who: 15)

    def refuse(which, who, value):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "setpriority", refuse)
    why = rayserve.raise_priority()
    assert why.startswith("this replica runs at niceness 15") and "CAP_SYS_NICE" in why
    assert "RAY_worker_niceness=0 ray start --head" in why


def test_a_niceness_the_user_chose_stays(monkeypatch):
    calls = []
    monkeypatch.setenv(rayserve.NICENESS_ENV, "10")
    monkeypatch.setattr(os, "getpriority", lambda which, who: 10)
    monkeypatch.setattr(os, "setpriority", lambda *a: calls.append(a))
    assert rayserve.raise_priority() is None and calls == []
    assert rayserve.local_system_config() == {}
    monkeypatch.delenv(rayserve.NICENESS_ENV)
    assert rayserve.local_system_config() == {"worker_niceness": 0}
    assert rayserve.raise_priority() is None and calls and all(a[2] == 0 for a in calls)
