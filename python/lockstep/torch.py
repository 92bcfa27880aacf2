"""PyTorch programs under Lockstep: the coordinator's store for c10d, and progress reports.

A script written for torchrun runs unchanged as a Lockstep program job (docs/programs.md):
the worker gives it torchrun's environment, and init_process_group's env:// rendezvous works.
This module adds what torchrun cannot give:

    import lockstep.torch as lt
    lt.init_process_group("gloo")   # the group forms through the coordinator: no MASTER_PORT
    ...
    lt.report(step=step, loss=loss.item(), samples=global_batch_size)

init_process_group forms the group over the coordinator's bootstrap store (the same scope the
worker's generation has: a restarted group never meets an older one's keys), so NCCL's unique
id comes through the coordinator. report() shows the program's progress in status, watch,
metrics and the dashboard, and arms the job's step_timeout_ms: a process stuck in a
collective is found and the group restarted. Outside Lockstep (no LOCKSTEP_AGENT_ADDRESS in
the environment) init_process_group is torch's own and report() does nothing, so one script
runs under torchrun and under Lockstep alike.
"""
import datetime
import os
import warnings

import grpc
import torch.distributed as dist

from lockstep.v1 import program_pb2, program_pb2_grpc

_SECRET_HEADER = "x-lockstep-program"
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
_stub = None
_report_warned = False


def available():
    """True when this process runs under a Lockstep worker (its agent can be reached)."""
    return bool(os.environ.get("LOCKSTEP_AGENT_ADDRESS")) and bool(
        os.environ.get("LOCKSTEP_AGENT_TOKEN"))


def _agent():
    global _stub
    if _stub is None:
        if not available():
            raise RuntimeError("lockstep.torch: not running under a Lockstep worker "
                               "(LOCKSTEP_AGENT_ADDRESS and LOCKSTEP_AGENT_TOKEN are not set)")
        channel = grpc.insecure_channel(os.environ["LOCKSTEP_AGENT_ADDRESS"])
        _stub = program_pb2_grpc.ProgramServiceStub(channel)
    return _stub


def _metadata():
    return ((_SECRET_HEADER, os.environ["LOCKSTEP_AGENT_TOKEN"]),)


def _ms(timeout):
    if timeout is None:
        return 0
    return max(1, int(timeout.total_seconds() * 1000))


def _call(method, request, deadline_s=None):
    try:
        return method(request, metadata=_metadata(), timeout=deadline_s)
    except grpc.RpcError as e:  # c10d wants exceptions it can report; a timeout as such
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise TimeoutError(f"lockstep store: {e.details()}") from None
        raise RuntimeError(f"lockstep store: {e.code().name}: {e.details()}") from None


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


def report(step, loss=None, samples=None):
    """Tells the worker this process completed optimizer step `step` (1-based), with its loss
    and the samples the step trained over all ranks. Returns False outside Lockstep, or when
    the worker no longer takes reports (the generation is ending); never raises for that."""
    global _report_warned
    if not available():
        return False
    request = program_pb2.ProgramReportRequest(step=int(step), samples=int(samples or 0))
    device = _cuda_device()
    if device is not None:
        request.cuda_device = device
    if loss is not None:
        request.loss = float(loss)
        request.has_loss = True
    try:
        _agent().Report(request, metadata=_metadata(), timeout=10)
        return True
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            raise ValueError(f"lockstep.torch.report: {e.details()}") from None
        if not _report_warned:
            warnings.warn(f"lockstep.torch.report: {e.code().name}: {e.details()}")
            _report_warned = True
        return False
