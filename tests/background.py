"""Subprocesses of tests, run in the background while the rest of the suite runs.

The suite's own process runs one test at a time on one CPU thread, so on a 2-core machine a core is idle most
of the time.  A test whose work is a subprocess that depends on nothing the session does before it (a fresh
``python -m ditattn ...``, a benchmark script, the offline SM90 compile) declares that subprocess with
``@pytest.mark.background.with_args(spec)`` (``with_args``: a mark called with a lone function would decorate
it).  Every such subprocess of the selected tests is queued when collection ends and run, one at a time, at a
lower CPU priority (:data:`NICENESS`), while the suite runs.  The test then reads the finished run from the
``background_run`` fixture and asserts on it exactly as it did on its own ``subprocess.run``.  A test that
comes before its subprocess has started runs it at once itself (not lowered); one that comes while it runs
waits for it.

``spec(folder)`` (called when the run starts) returns :class:`subprocess.Popen` keywords (``args``, ``env``,
``cwd``...) and may add ``timeout`` (seconds, default 600); ``folder`` is an empty directory of the run's
own (its working directory unless ``cwd`` says otherwise).  Output is captured as text.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading

#: the background runs' niceness (the lowest priority): the suite and the processes it starts come first
NICENESS = 19


def lower_priority(pid: int, niceness: int) -> None:
    """Run process ``pid`` (a session leader) and the processes it starts later at ``niceness``.  Where the
    kernel groups processes by session for scheduling (autogroup: ``/proc/sys/kernel/sched_autogroup_enabled``),
    a niceness weighs only within the session, so the session's own group gets it too."""
    with contextlib.suppress(OSError):  # its children inherit the niceness it has when they start
        os.setpriority(os.PRIO_PROCESS, pid, niceness)
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/autogroup", "w") as fh:
            fh.write(str(niceness))


class Job:
    """One subprocess: started by the runner's thread (lowered priority) or by the test that needs it."""

    def __init__(self, key, spec, root: str):
        self.key, self.spec, self.root = key, spec, root
        self.folder = None
        self.proc = None
        self.timeout = 600.0
        self.result = None  # subprocess.CompletedProcess once it ended
        self.error = None  # an exception raised while starting it
        self.started = False
        self.done = threading.Event()
        self._lock = threading.Lock()

    def claim(self) -> bool:
        """True for the one caller that is to start it."""
        with self._lock:
            if self.started:
                return False
            self.started = True
            return True

    def start(self, niceness: int = 0) -> None:
        try:
            self.folder = tempfile.mkdtemp(prefix="run-", dir=self.root)
            kw = dict(self.spec(self.folder))
            self.timeout = float(kw.pop("timeout", self.timeout))
            kw.setdefault("cwd", self.folder)
            self._out = os.path.join(self.folder, ".stdout")
            self._err = os.path.join(self.folder, ".stderr")
            with open(self._out, "wb") as out, open(self._err, "wb") as err:
                self.proc = subprocess.Popen(**kw, stdout=out, stderr=err, start_new_session=True)
            if niceness:
                lower_priority(self.proc.pid, niceness)
        except BaseException as exc:  # noqa: BLE001 - reported to the test that reads the run
            self.error = exc
            self.done.set()

    def finish(self) -> None:
        """Wait for the process (killing it past its timeout) and keep its output."""
        if self.proc is None:
            return
        try:
            rc = self.proc.wait(self.timeout)
        except subprocess.TimeoutExpired as exc:
            self.kill()
            self.error = exc
        else:
            try:
                with open(self._out, "rb") as out, open(self._err, "rb") as err:
                    stdout = out.read().decode(errors="replace")
                    stderr = err.read().decode(errors="replace")
            except OSError as exc:  # the session's folder is gone: it ended
                self.error = exc
            else:
                self.result = subprocess.CompletedProcess(self.proc.args, rc, stdout, stderr)
        finally:
            self.done.set()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the process and any it started
            self.proc.wait()


class Runner:
    """The queued jobs of a session, run in order by a daemon thread."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.jobs: dict = {}
        self._stopped = False
        self._thread = None

    def add(self, key, spec) -> None:
        if key not in self.jobs:
            self.jobs[key] = Job(key, spec, self.root)

    def start(self) -> None:
        if self.jobs and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tests-background", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        for job in list(self.jobs.values()):
            if self._stopped:
                return
            if job.claim():
                job.start(NICENESS)
                if self._stopped:  # the session ended while it started
                    job.kill()
                job.finish()

    def result(self, key, spec) -> tuple:
        """``(subprocess.CompletedProcess, folder)`` of the job ``key`` (added now if it was not queued)."""
        self.add(key, spec)
        job = self.jobs[key]
        if job.claim():  # not started yet: run it here and now
            job.start()
            job.finish()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result, job.folder

    def stop(self) -> None:
        """End of the session: nothing more starts, a running job is killed."""
        self._stopped = True
        for job in self.jobs.values():
            if not job.claim():
                job.kill()
        if self._thread is not None:
            self._thread.join(10)
