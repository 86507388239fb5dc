"""Replaying rank 0's pipeline calls on the other ranks of a sequence-parallel job.

A sequence-parallel pipeline call is collective: every rank must make it, with the same inputs,
in the same order.  When only rank 0 receives the work (an HTTP server), :class:`PipelineRelay`
broadcasts each call it makes and the other ranks replay it.
"""

from __future__ import annotations

import contextlib
import datetime

import torch.distributed as dist

from ditattn.errors import AttentionConfigError


class PipelineRelay:
    """Keeps every rank's pipeline calls in step (``ditattn serve --num-gpus N``).

    Rank 0 (the leader, inside :meth:`leading`) broadcasts a picklable description of each
    ``WanPipelineNative.generate`` call on a gloo control group before running it; calls are
    serialised by a lock, so every rank issues the same collectives in the same order.  The other
    ranks (:meth:`follow`) replay each call on their own pipeline, re-preparing the request's
    attention override / skip softmax locally (the prepared tables hold process-local objects), and
    return when the leader stops.  While idle the leader sends a heartbeat every ``heartbeat_s``
    seconds so that the followers' waits never reach the control group's timeout.

    The control group is created collectively: construct the relay on every rank, in the same order.
    """

    def __init__(self, heartbeat_s: float = 60.0, timeout_s: float = 3600.0):
        import threading

        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.heartbeat_s = heartbeat_s
        self.lock = threading.Lock()
        self._stop = threading.Event()

    def _send(self, msg) -> None:
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.group)

    def _recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    @staticmethod
    def describe_call(args: tuple, kwargs: dict) -> dict:
        """The picklable part of a ``generate(*args, **kwargs)`` call: the request state becomes its
        override name and skip-softmax parameters; callbacks and progress bars are dropped."""
        kw = dict(kwargs)
        state = kw.pop("request_state", None)
        kw.pop("on_step", None)
        kw.pop("should_stop", None)
        kw.pop("progress", None)
        msg = {"op": "generate", "args": args, "kwargs": kw, "override": None, "skip_softmax": None}
        if state is not None:
            msg["override"] = state.override.value if state.override is not None else None
            ss = state.skip_softmax
            msg["skip_softmax"] = (
                None
                if ss is None
                else {"threshold_scale_factor": ss.threshold_scale_factor, "start_step": ss.start_step}
            )
        return msg

    @contextlib.contextmanager
    def leading(self, pipeline_cls: type):
        """Rank 0: relay every ``pipeline_cls.generate`` call made inside the block (any class with
        ``generate(*args, request_state=..., **kwargs)`` and ``prepare_request(override,
        skip_softmax)``, e.g. ``WanPipelineNative``); tell the followers to stop on exit.  A call's
        ``should_stop`` is dropped: a collective run cannot stop on one rank alone."""
        import threading

        orig = pipeline_cls.__dict__["generate"]
        relay = self

        def generate(pipe, *a, **kw):
            # a collective run cannot stop on one rank alone (the others would wait in the next step's
            # collectives): under sequence parallelism a request is only cancelled before it starts
            kw.pop("should_stop", None)
            with relay.lock:
                relay._send(relay.describe_call(a, kw))
                return orig(pipe, *a, **kw)

        def heartbeat():
            while not relay._stop.wait(relay.heartbeat_s):
                if relay.lock.acquire(blocking=False):
                    try:
                        if not relay._stop.is_set():
                            relay._send({"op": "noop"})
                    finally:
                        relay.lock.release()

        pipeline_cls.generate = generate
        beat = threading.Thread(target=heartbeat, name="ditattn-sp-heartbeat", daemon=True)
        beat.start()
        try:
            yield self
        finally:
            pipeline_cls.generate = orig
            self._stop.set()
            beat.join()
            with self.lock:
                try:
                    self._send({"op": "stop"})
                except Exception:  # followers already gone (e.g. Ctrl-C reached them first)
                    pass

    def follow(self, pipe) -> int:
        """Ranks other than 0: replay the leader's calls on ``pipe`` until it stops; returns the
        number of calls replayed.  A call that fails here fails identically on the leader (same
        inputs, same checks), so the error is logged and the loop goes on."""
        import logging

        done = 0
        while True:
            msg = self._recv()
            op = msg.get("op") if isinstance(msg, dict) else None
            if op == "stop":
                return done
            if op != "generate":
                continue
            try:
                state = pipe.prepare_request(msg["override"], msg["skip_softmax"])
                pipe.generate(*msg["args"], **msg["kwargs"], request_state=state, progress=False)
            except AttentionConfigError as exc:
                logging.getLogger("ditattn.distributed").info("rank %d: relayed call refused: %s", self.rank, exc)
            done += 1
