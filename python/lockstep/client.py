"""The client: one gRPC channel to the coordinator's JobService."""
import ipaddress
import os
import platform
import time
import warnings

import grpc
from google.protobuf import json_format

from lockstep.v1 import job_pb2, job_pb2_grpc

# The metadata the coordinator reads: the shared token, and who is calling (shown by
# `lockstepctl workers` when a call is refused).
_AUTHORIZATION = "authorization"
_CLIENT = "x-lockstep-client"
# A standby coordinator (coordinators on etcd) names the leader in this trailing metadata.
_LEADER = "x-lockstep-leader"
# The leading coordinator's term, in the initial metadata of its answers (coordinators on etcd).
_TERM = "x-lockstep-term"
# Calls whose answer stands even from an older term: the coordinator answers a submit only
# after etcd took its fenced write (so it led then), and sending it again could run it twice.
_NOT_SENT_AGAIN = {"SubmitJob"}


def _term_of(call):
    for key, value in call.initial_metadata() or ():
        if key == _TERM:
            try:
                return int(value)
            except ValueError:
                return None
    return None

# Job states after which nothing changes.
_ENDED = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED)

# list(): the most pages followed (10**8 jobs in the full pages of 1000 it asks for), a bound on a
# server that pages in circles with ever new tokens. The same bound as lockstepctl's.
MAX_LIST_PAGES = 100_000


class InsecureTokenWarning(UserWarning):
    """A token sent without TLS to a coordinator beyond loopback: anyone on the network path can
    read it. Silence it with warnings.filterwarnings("ignore", category=InsecureTokenWarning)."""


class LockstepError(Exception):
    """A call that failed: `code` is the grpc.StatusCode, `message` the coordinator's words."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def to_dict(message):
    """A protobuf message as the JSON mapping (camelCase names), e.g. for json.dumps."""
    return json_format.MessageToDict(message)


def _is_loopback(address):
    """True when the gRPC target `address` stays on this machine: a loopback IP address
    (127.0.0.0/8, ::1), localhost, or a Unix socket. The rule of lockstepctl's and the
    coordinator's IsLoopbackAddress, extended to gRPC's target prefixes."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if address.startswith(prefix):
            address = address[len(prefix):]
            break
    host = address.rsplit(":", 1)[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"tls {what} {path}: {e.strerror}") from None


class Client:
    """A connection to a coordinator.

    address: HOST:PORT, or several comma-separated (coordinators on etcd, one leading): calls go
    to the leader, following the one a standby names, or to the next address when one cannot
    be reached (a call that reached a coordinator that then failed is not sent again: it may
    have been done). An answer from a coordinator that leads an older term than one already
    seen (a deposed leader, which steps down within seconds) is not trusted: the call goes to
    the next address, except a submit (answered only after its write was taken). token: the cluster's shared token (default $LOCKSTEP_TOKEN; None sends
    none). tls: None (plaintext), True (TLS with the system's roots), or a dict with "ca" (the
    CA file that signed the coordinator's certificate) and, for mutual TLS, "cert" and "key".
    timeout: seconds for each call (watch streams are not limited).

    A token sent without TLS to an address beyond loopback crosses the network in the clear: the
    client then warns once (InsecureTokenWarning), as lockstepctl does.
    """

    def __init__(self, address, token=None, tls=None, timeout=30.0):
        if not isinstance(address, str):
            raise ValueError(f"address {address!r} is not HOST:PORT")
        self._addresses = [a.strip() for a in address.split(",")]
        for a in self._addresses:
            if ":" not in a:
                raise ValueError(f"address {a!r} in {address!r} is not HOST:PORT")
        if token is None:
            token = os.environ.get("LOCKSTEP_TOKEN") or None
        self._timeout = timeout
        self._term = 0  # the largest leader's term seen (coordinators on etcd)
        self._metadata = [(_CLIENT, f"python {platform.node()}-{os.getpid()}")]
        if token:
            self._metadata.append((_AUTHORIZATION, f"Bearer {token}"))
        self._credentials = None
        self._channel = None
        if tls is None or tls is False:
            beyond = [a for a in self._addresses if not _is_loopback(a)]
            if token and beyond:
                warnings.warn(
                    f"lockstep.Client: sending the token to {beyond[0]} without TLS: anyone on "
                    "the network path can read it (pass tls=...)",
                    InsecureTokenWarning, stacklevel=2)
        else:
            options = {} if tls is True else dict(tls)
            unknown = set(options) - {"ca", "cert", "key"}
            if unknown:
                raise ValueError(f"tls: unknown keys {sorted(unknown)} (ca, cert, key)")
            if ("cert" in options) != ("key" in options):
                raise ValueError("tls: cert and key go together (mutual TLS)")
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(options["ca"], "ca") if "ca" in options else None,
                private_key=_read(options["key"], "key") if "key" in options else None,
                certificate_chain=_read(options["cert"], "cert") if "cert" in options else None)
        self._connect(self._addresses[0])

    def _connect(self, address):
        if self._channel is not None:
            self._channel.close()
        self._address = address
        if self._credentials is None:
            self._channel = grpc.insecure_channel(address)
        else:
            self._channel = grpc.secure_channel(address, self._credentials)
        self._stub = job_pb2_grpc.JobServiceStub(self._channel)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request):
        tried = set()
        while True:
            try:
                answer, call = getattr(self._stub, method).with_call(
                    request, timeout=self._timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                tried.add(self._address)
                following = self._next_address(e, tried)
                if following is None:
                    raise LockstepError(e.code(), e.details() or "") from None
                self._connect(following)
                continue
            term = _term_of(call)
            if term is None or term >= self._term or method in _NOT_SENT_AGAIN:
                self._term = max(self._term, term or 0)
                return answer
            # A deposed leader (it steps down within seconds, and etcd refuses its writes):
            # its answer may be stale; ask the others.
            tried.add(self._address)
            untried = [a for a in self._addresses if a not in tried]
            if not untried:
                raise LockstepError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{self._address} answered as the leader of term {term}, but term "
                    f"{self._term} has led since: it was deposed") from None
            self._connect(untried[0])

    def _next_address(self, error, tried):
        """Where a call that failed with `error` goes next: the leader a standby named, or, when
        the coordinator could not be reached at all, the next address; None: nowhere."""
        if error.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        leader = dict(error.trailing_metadata() or ()).get(_LEADER)
        if leader and leader not in tried:
            return leader
        details = (error.details() or "").lower()
        # A standby (which never acts on a call) naming a leader already tried, or a call that
        # never reached a coordinator: refused, or a name (say, a container's, named by a
        # standby) that does not resolve from here.
        if (not leader and "failed to connect" not in details
                and "dns resolution failed" not in details):
            return None
        untried = [a for a in self._addresses if a not in tried]
        return untried[0] if untried else None

    def submit(self, spec):
        """Submits a job: a JobSpec, or a dict in the JSON form of docs/job_spec_example.md
        (camelCase or snake_case names). Returns the Job as the coordinator accepted it."""
        if isinstance(spec, dict):
            try:
                spec = json_format.ParseDict(spec, job_pb2.JobSpec())
            except json_format.ParseError as e:
                raise LockstepError(grpc.StatusCode.INVALID_ARGUMENT, f"job spec: {e}") from None
        elif not isinstance(spec, job_pb2.JobSpec):
            raise TypeError(f"submit takes a dict or a lockstep.v1 JobSpec, not {type(spec).__name__}")
        return self._call("SubmitJob", job_pb2.SubmitJobRequest(spec=spec))

    def get(self, job_id):
        return self._call("GetJob", job_pb2.GetJobRequest(job_id=job_id))

    def list(self):
        """Every job, newest first (the coordinator pages them; this follows every page).

        The coordinator's pages walk back through its jobs, each page holding at least one, so a
        repeated page token or job, an empty page that is not the last, or more than
        MAX_LIST_PAGES pages mean the server would keep this paging forever: LockstepError with
        code INTERNAL instead."""
        jobs, token = [], ""
        tokens, job_ids = set(), set()
        pages = 0
        while True:
            page = self._call("ListJobs",
                              job_pb2.ListJobsRequest(page_size=1000, page_token=token))
            pages += 1
            for job in page.jobs:
                if job.job_id in job_ids:
                    raise LockstepError(
                        grpc.StatusCode.INTERNAL,
                        f"the coordinator listed job {job.job_id!r} twice (page {pages}); "
                        "stopped following its pages")
                job_ids.add(job.job_id)
            jobs.extend(page.jobs)
            token = page.next_page_token
            if not token:
                return jobs
            if not page.jobs:
                raise LockstepError(
                    grpc.StatusCode.INTERNAL,
                    f"the coordinator sent page {pages} without jobs but with a next page "
                    "token; stopped following its pages")
            if token in tokens:
                raise LockstepError(
                    grpc.StatusCode.INTERNAL,
                    f"the coordinator repeated the page token {token!r} (page {pages}); "
                    "stopped following its pages")
            tokens.add(token)
            if pages >= MAX_LIST_PAGES:
                raise LockstepError(
                    grpc.StatusCode.INTERNAL,
                    f"the coordinator sent more than {MAX_LIST_PAGES} pages of jobs; stopped "
                    "following them")

    def queue(self):
        """The queued jobs (PENDING, and SUSPENDED for another job) in the order they will
        start; each one's reason says why it waits (docs/scheduling.md)."""
        return list(self._call("ListJobs",
                               job_pb2.ListJobsRequest(queue=True, page_size=1000)).jobs)

    def cancel(self, job_id):
        return self._call("CancelJob", job_pb2.CancelJobRequest(job_id=job_id))

    def suspend(self, job_id):
        """Stops the job, its state kept in its workers' memory; it waits, SUSPENDED, for
        resume(). FAILED_PRECONDITION for a job that has ended or is already suspended."""
        return self._call("SuspendJob", job_pb2.SuspendJobRequest(job_id=job_id))

    def resume(self, job_id):
        """Queues a job suspended by suspend(): it goes on from its kept state when workers
        free up. FAILED_PRECONDITION for a job that is not suspended."""
        return self._call("ResumeJob", job_pb2.ResumeJobRequest(job_id=job_id))

    def workers(self):
        """The registered workers (WorkerInfo messages)."""
        return list(self._call("ListWorkers", job_pb2.ListWorkersRequest()).workers)

    def curve(self, job_id):
        """The job's training loss and throughput, oldest first (TrainingPoint messages: step,
        time_unix_ms, loss, samples_per_second, tokens_per_second), as the coordinator kept
        them: at most 512 points, evenly spaced in steps. For a plot:

            points = client.curve(job_id)
            plt.plot([p.step for p in points], [p.loss for p in points])
        """
        return list(self._call("GetTrainingCurve",
                               job_pb2.GetTrainingCurveRequest(job_id=job_id)).points)

    def logs(self, job_id, rank=None, generation=0, follow=False, poll=0.5):
        """A program job's output lines (LogLine messages: sequence, generation, rank, worker,
        stderr, text, unix_ms), oldest first, as the coordinator keeps them (the latest 2 MiB of
        the job). Only `rank`'s or `generation`'s when given. With follow=True it keeps yielding
        new lines until the job has ended:

            for line in client.logs(job_id, follow=True):
                print(f"[default{line.rank}]:{line.text}")
        """
        request = job_pb2.GetJobLogsRequest(job_id=job_id, generation=generation)
        if rank is not None:
            request.rank = rank
        while True:
            ended = not follow or self.get(job_id).state in _ENDED
            while True:
                answer = self._call("GetJobLogs", request)
                yield from answer.lines
                more = len(answer.lines) > 0 and answer.next_sequence > request.from_sequence
                request.from_sequence = answer.next_sequence
                if not more:
                    break
            if ended:
                return
            time.sleep(poll)

    def watch(self, job_id, from_sequence=0):
        """The job's events (JobEvent), from its history on, live until the job has ended."""
        if len(self._addresses) > 1:
            self.get(job_id)  # on the leader first (a stream is not sent again)
        stream = self._stub.WatchJob(
            job_pb2.WatchJobRequest(job_id=job_id, from_sequence=from_sequence),
            metadata=self._metadata)
        try:
            for event in stream:
                yield event
        except grpc.RpcError as e:
            raise LockstepError(e.code(), e.details() or "") from None
        finally:
            stream.cancel()
