"""The worker's ProgramService as a program reaches it (lockstep.torch, lockstep.checkpoint):
its Unix socket (LOCKSTEP_AGENT_ADDRESS) and the generation's secret (LOCKSTEP_AGENT_TOKEN)."""
import os

import grpc

from lockstep.v1 import program_pb2_grpc

_SECRET_HEADER = "x-lockstep-program"
_stub = None


def available():
    """True when this process runs under a Lockstep worker (its agent can be reached)."""
    return bool(os.environ.get("LOCKSTEP_AGENT_ADDRESS")) and bool(
        os.environ.get("LOCKSTEP_AGENT_TOKEN"))


def agent():
    global _stub
    if _stub is None:
        if not available():
            raise RuntimeError("lockstep.torch: not running under a Lockstep worker "
                               "(LOCKSTEP_AGENT_ADDRESS and LOCKSTEP_AGENT_TOKEN are not set)")
        channel = grpc.insecure_channel(os.environ["LOCKSTEP_AGENT_ADDRESS"])
        _stub = program_pb2_grpc.ProgramServiceStub(channel)
    return _stub


def metadata():
    return ((_SECRET_HEADER, os.environ["LOCKSTEP_AGENT_TOKEN"]),)


def call(method, request, deadline_s=None, what="lockstep store"):
    """method(request) with the secret; errors as exceptions c10d and scripts can report (a
    timeout as TimeoutError, RESOURCE_EXHAUSTED as MemoryError, the rest RuntimeError)."""
    try:
        return method(request, metadata=metadata(), timeout=deadline_s)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise TimeoutError(f"{what}: {e.details()}") from None
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise MemoryError(f"{what}: {e.details()}") from None
        raise RuntimeError(f"{what}: {e.code().name}: {e.details()}") from None
