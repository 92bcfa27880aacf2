"""PyTorch programs under Lockstep: the coordinator's store for c10d, and progress reports.

A script written for torchrun runs unchanged as a Lockstep program job (docs/programs.md):
the worker gives it torchrun's environment, and init_process_group's env:// rendezvous works.
This module adds what torchrun cannot give:

    import lockstep.torch as lt
    lt.init_process_group("gloo")   # the group forms through the coordinator: no MASTER_PORT
    ...
    lt.report(step=step, loss=loss.item(), samples=global_batch_size)
    ckpt = lt.Checkpointer()          # the model and optimizer in the worker's memory
    start = ckpt.load(model, opt) or 0
    ...
    ckpt.save(step, model, opt)       # a memory copy; a restarted group resumes from it

init_process_group forms the group over the coordinator's bootstrap store (the same scope the
worker's generation has: a restarted group never meets an older one's keys), so NCCL's unique
id comes through the coordinator. report() shows the program's progress in status, watch,
metrics and the dashboard, and arms the job's step_timeout_ms: a process stuck in a
collective is found and the group restarted. Outside Lockstep (no LOCKSTEP_AGENT_ADDRESS in
the environment) init_process_group is torch's own and report() does nothing, so one script
runs under torchrun and under Lockstep alike.
"""
import atexit
import datetime
import os
import threading
import warnings

import grpc
import torch.distributed as dist

from lockstep._agent import agent as _agent, available, call as _call, metadata as _metadata
from lockstep.v1 import program_pb2

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
_report_warned = False


def _ms(timeout):
    if timeout is None:
        return 0
    return max(1, int(timeout.total_seconds() * 1000))


class Store(dist.Store):
    """A c10d Store over the coordinator's bootstrap store, scoped to this generation."""

    def __init__(self, timeout=_DEFAULT_TIMEOUT):
        super().__init__()
        self._timeout = timeout

    def set(self, key, value):
        if isinstance(value, str):
            value = value.encode()
        _call(_agent().StoreSet, program_pb2.ProgramStoreRequest(key=key, value=bytes(value)))

    def get(self, key):
        response = _call(_agent().StoreGet,
                         program_pb2.ProgramStoreRequest(key=key, timeout_ms=_ms(self._timeout)))
        return response.value

    def add(self, key, amount):
        return _call(_agent().StoreAdd,
                     program_pb2.ProgramStoreRequest(key=key, amount=int(amount))).sum

    def wait(self, keys, timeout=None):
        timeout = self._timeout if timeout is None else timeout
        _call(_agent().StoreWait,
              program_pb2.ProgramStoreRequest(keys=list(keys), timeout_ms=_ms(timeout)))

    def check(self, keys):
        try:
            _call(_agent().StoreWait, program_pb2.ProgramStoreRequest(keys=list(keys),
                                                                       timeout_ms=1))
            return True
        except TimeoutError:
            return False

    def set_timeout(self, timeout):
        self._timeout = timeout

    def compare_set(self, key, expected, desired):
        raise RuntimeError("lockstep store: compare_set is not supported")

    def delete_key(self, key):
        raise RuntimeError("lockstep store: delete_key is not supported")

    def num_keys(self):
        raise RuntimeError("lockstep store: num_keys is not supported")


def init_process_group(backend=None, timeout=None, **kwargs):
    """torch.distributed.init_process_group over the coordinator's store (RANK and WORLD_SIZE
    from the environment); outside Lockstep, torch's own with its env:// rendezvous."""
    if timeout is not None:
        kwargs["timeout"] = timeout
    if not available():
        return dist.init_process_group(backend, **kwargs)
    store = Store(timeout or _DEFAULT_TIMEOUT)
    return dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                   world_size=int(os.environ["WORLD_SIZE"]), **kwargs)


def _cuda_device():
    """The CUDA device this process computes on, when it has started using CUDA (the worker
    checks that it is LOCAL_RANK, its own GPU)."""
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:  # no CUDA build, no driver: nothing to check
        return None
    return None


class _Reporter:
    """Sends report()s to the worker from a thread of its own, so that a step costs the
    training loop no round trip: the newest report waits in one slot (a newer one replaces it;
    the worker counts samples over the steps between two reports), the first is sent at once
    and the rest at most every INTERVAL_S, and what is still waiting at exit is sent then."""

    INTERVAL_S = 0.1

    def __init__(self):
        self._cv = threading.Condition()
        self._pending = None
        self._sending = False
        self._gone = False  # the worker no longer takes reports: the generation is ending
        self._flushing = 0  # flush() calls waiting: send without pacing
        self._thread = None

    def put(self, request):
        with self._cv:
            if self._gone:
                return False
            self._pending = request
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lockstep-report",
                                                daemon=True)
                self._thread.start()
                atexit.register(self.flush)
            self._cv.notify_all()
            return True

    def flush(self, timeout_s=5.0):
        """Waits until the waiting report (if any) has been sent, up to timeout_s."""
        with self._cv:
            self._flushing += 1
            self._cv.notify_all()
            try:
                self._cv.wait_for(lambda: (self._pending is None and not self._sending) or
                                  self._gone, timeout=timeout_s)
            finally:
                self._flushing -= 1

    def _run(self):
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None)
                request, self._pending, self._sending = self._pending, None, True
            gone = not self._send(request)
            with self._cv:
                self._sending = False
                self._gone = self._gone or gone
                self._cv.notify_all()
                if self._gone:
                    return
                # Paces the next send (put() notifies every step: only flush() ends it early).
                self._cv.wait_for(lambda: self._flushing > 0, timeout=self.INTERVAL_S)

    @staticmethod
    def _send(request):
        global _report_warned
        try:
            _agent().Report(request, metadata=_metadata(), timeout=10)
            return True
        except grpc.RpcError as e:
            if not _report_warned:
                warnings.warn(f"lockstep.torch.report: {e.code().name}: {e.details()}")
                _report_warned = True
            return e.code() != grpc.StatusCode.UNAUTHENTICATED


_reporter = _Reporter()


def report(step, loss=None, samples=None):
    """Tells the worker this process completed optimizer step `step` (1-based), with its loss
    and the samples the step trained over all ranks. Returns at once (a thread sends it: see
    _Reporter); False outside Lockstep, or once the worker no longer takes reports (the
    generation is ending). Raises ValueError for a step below 1 or negative samples."""
    step = int(step)
    samples = int(samples or 0)
    if step < 1:
        raise ValueError(f"lockstep.torch.report: step: must be > 0, got {step}")
    if samples < 0:
        raise ValueError(f"lockstep.torch.report: samples: must be >= 0, got {samples}")
    if not available():
        return False
    request = program_pb2.ProgramReportRequest(step=step, samples=samples)
    device = _cuda_device()
    if device is not None:
        request.cuda_device = device
    if loss is not None:
        request.loss = float(loss)
        request.has_loss = True
    return _reporter.put(request)


from lockstep.checkpoint import Checkpointer, SaveHandle  # noqa: E402  (it imports torch)
