"""A Ray Serve proxy that cannot bind its port (taken after ``ditattn serve`` checked it) ends the start with one
line saying so, and Serve and Ray are shut down; any other start failure propagates as it was."""

from __future__ import annotations

import pytest

from ditattn.errors import AttentionConfigError
from ditattn.server import rayserve

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ditattn[scale]')")


class FakeServe:
    def __init__(self, error):
        self.error, self.started, self.shut = error, [], 0

    def start(self, http_options, logging_config):
        self.started.append(http_options)
        raise self.error

    def shutdown(self):
        self.shut += 1


def test_a_port_lost_to_another_process_is_one_line_and_ray_is_shut_down(monkeypatch):
    stopped = []
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(True))
    bind = "ray::ProxyActor.ready()\n  RuntimeError: Failed to bind to address '127.0.0.1:38851'."
    fake = FakeServe(RuntimeError(bind))
    with pytest.raises(AttentionConfigError) as err:
        rayserve.start_proxy(fake, "127.0.0.1", 38851)
    msg = str(err.value)
    assert "cannot listen on 127.0.0.1:38851" in msg and "--port" in msg and "\n" not in msg, msg
    assert fake.started == [{"host": "127.0.0.1", "port": 38851}] and fake.shut == 1 and stopped == [True]
    other = FakeServe(RuntimeError("the controller died"))
    with pytest.raises(RuntimeError, match="the controller died"):
        rayserve.start_proxy(other, "127.0.0.1", 8000)
    assert other.shut == 0 and stopped == [True]
