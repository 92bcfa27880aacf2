"""pytest tests of the installed Python client that need no cluster: list() against a fake
coordinator (an in-process gRPC server on 127.0.0.1) that pages in circles, and the warning for
a token sent in plaintext beyond loopback, and the way calls find the leader among several
coordinators. client_test.py runs them with test_client.py."""
import warnings
from concurrent import futures

import grpc
import pytest

import lockstep
import lockstep.client
from lockstep.v1 import job_pb2, job_pb2_grpc

# Calls the fake server answers before it refuses: a client that pages forever gets an error it
# does not expect, instead of hanging the test.
_CALLS_BEFORE_REFUSING = 50


class _Pager(job_pb2_grpc.JobServiceServicer):
    """ListJobs answered by `pages(request_token, call_number)` -> (job ids, next token)."""

    def __init__(self, pages):
        self.pages = pages
        self.calls = 0

    def ListJobs(self, request, context):
        self.calls += 1
        if self.calls > _CALLS_BEFORE_REFUSING:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the client paged forever")
        ids, token = self.pages(request.page_token, self.calls)
        return job_pb2.ListJobsResponse(jobs=[job_pb2.Job(job_id=i) for i in ids],
                                        next_page_token=token, total_jobs=3)


@pytest.fixture
def serve():
    servers = []

    def start(pages):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pager = _Pager(pages)
        job_pb2_grpc.add_JobServiceServicer_to_server(pager, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", pager

    yield start
    for server in servers:
        server.stop(None)


def test_list_follows_every_page(serve):
    pages = {"": (["job-3"], "2"), "2": (["job-2"], "1"), "1": (["job-1"], "")}
    address, pager = serve(lambda token, _: pages[token])
    with lockstep.Client(address) as c:
        assert [j.job_id for j in c.list()] == ["job-3", "job-2", "job-1"]
    assert pager.calls == 3


@pytest.mark.parametrize("what,pages,expected", [
    ("the same token again", lambda token, n: ([f"job-{n}"], "same"), "repeated the page token"),
    ("tokens in a cycle", lambda token, n: ([f"job-{n}"], "ab"[n % 2]), "repeated the page token"),
    ("empty pages", lambda token, n: ([], str(n)), "without jobs"),
    ("the same jobs under new tokens", lambda token, n: (["job-1"], str(n)), "listed job"),
])
def test_list_stops_when_the_server_pages_in_circles(serve, what, pages, expected):
    address, pager = serve(pages)
    with lockstep.Client(address) as c:
        with pytest.raises(lockstep.LockstepError) as e:
            c.list()
    assert e.value.code == grpc.StatusCode.INTERNAL, what
    assert expected in e.value.message, what
    assert pager.calls <= 3, what


def test_list_is_bounded_in_pages(serve, monkeypatch):
    monkeypatch.setattr(lockstep.client, "MAX_LIST_PAGES", 7)
    address, pager = serve(lambda token, n: ([f"job-{n}"], str(n)))
    with lockstep.Client(address) as c:
        with pytest.raises(lockstep.LockstepError) as e:
            c.list()
    assert e.value.code == grpc.StatusCode.INTERNAL
    assert "more than 7 pages" in e.value.message
    assert pager.calls == 7


def _warnings_of(make):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make().close()
    return [w for w in caught if issubclass(w.category, lockstep.InsecureTokenWarning)]


# Channels connect lazily and these clients make no call: nothing is sent to any address.
@pytest.mark.parametrize("address", ["coordinator.invalid:7070", "dns:///coordinator.invalid:7070",
                                     "0.0.0.0:7070"])
def test_a_plaintext_token_beyond_loopback_warns_once(address, monkeypatch):
    monkeypatch.delenv("LOCKSTEP_TOKEN", raising=False)
    caught = _warnings_of(lambda: lockstep.Client(address, token="secret"))
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert address in message and "without TLS" in message, message
    assert "secret" not in message
    assert caught[0].filename == __file__, "the warning points at the caller's line"
    # The token from the environment is sent too.
    monkeypatch.setenv("LOCKSTEP_TOKEN", "from-env")
    assert len(_warnings_of(lambda: lockstep.Client(address))) == 1


@pytest.mark.parametrize("address", ["127.0.0.1:7070", "127.3.2.1:7070", "localhost:7070",
                                     "[::1]:7070", "ipv4:127.0.0.1:7070", "unix:/tmp/l.sock"])
def test_no_warning_on_loopback(address, monkeypatch):
    monkeypatch.delenv("LOCKSTEP_TOKEN", raising=False)
    assert _warnings_of(lambda: lockstep.Client(address, token="secret")) == []


def test_no_warning_without_a_token_or_with_tls(monkeypatch):
    monkeypatch.delenv("LOCKSTEP_TOKEN", raising=False)
    assert _warnings_of(lambda: lockstep.Client("coordinator.invalid:7070")) == []
    assert _warnings_of(lambda: lockstep.Client("coordinator.invalid:7070", token="")) == []
    assert _warnings_of(
        lambda: lockstep.Client("coordinator.invalid:7070", token="secret", tls=True)) == []


class _Coordinator(job_pb2_grpc.JobServiceServicer):
    """GetJob and SubmitJob as a leader answers them, or as a standby naming `leader`, or as a
    coordinator failing while it handles the call (`broken`)."""

    def __init__(self, leader=None, broken=False, term=None):
        self.leader = leader
        self.broken = broken
        self.term = term
        self.calls = 0

    def _answer(self, context):
        self.calls += 1
        if self.term is not None:
            context.send_initial_metadata((("x-lockstep-term", str(self.term)),))
        if self.leader:
            context.set_trailing_metadata((("x-lockstep-leader", self.leader),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "this coordinator is a standby")
        if self.broken:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the coordinator went away mid-call")

    def GetJob(self, request, context):
        self._answer(context)
        return job_pb2.Job(job_id=request.job_id)

    def SubmitJob(self, request, context):
        self._answer(context)
        return job_pb2.Job(job_id="job-1")


@pytest.fixture
def coordinators():
    servers = []

    def start(servicer):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        job_pb2_grpc.add_JobServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def _dead_address():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_calls_pass_a_dead_address_and_follow_the_leader_a_standby_names(coordinators):
    leader = _Coordinator()
    leader_address = coordinators(leader)
    standby = _Coordinator(leader=leader_address)
    standby_address = coordinators(standby)
    with lockstep.Client(f"{_dead_address()},{standby_address}", timeout=5) as c:
        assert c.get("job-7").job_id == "job-7"
        assert c.submit({"name": "x"}).job_id == "job-1"
    assert standby.calls == 1  # then straight to the leader
    assert leader.calls == 2


def test_a_leader_named_by_a_name_that_does_not_resolve_here_is_passed_over(coordinators):
    # As from a host outside compose's network, where a standby names "coordinator-2:7070".
    # Two standbys name it before the leader's own address comes.
    leader = _Coordinator()
    standbys = [_Coordinator(leader="coordinator-3.invalid:7070") for _ in range(2)]
    addresses = [coordinators(s) for s in standbys] + [coordinators(leader)]
    with lockstep.Client(",".join(addresses), timeout=5) as c:
        assert c.get("job-7").job_id == "job-7"
    assert [s.calls for s in standbys] + [leader.calls] == [1, 1, 1]


def test_an_answer_from_a_deposed_leaders_older_term_is_not_trusted(coordinators):
    # Term 5 leads; a deposed leader of term 3 still answers until it steps down.
    new = _Coordinator(term=5)
    deposed = _Coordinator(term=3)
    new_address, deposed_address = coordinators(new), coordinators(deposed)
    with lockstep.Client(f"{deposed_address},{new_address}", timeout=5) as c:
        assert c.get("job-1").job_id == "job-1"  # the deposed one first: no newer term seen yet
        c._connect(new_address)
        assert c.get("job-2").job_id == "job-2"  # term 5 seen
        c._connect(deposed_address)
        assert c.get("job-3").job_id == "job-3"  # term 3 passed over: asked term 5 again
        assert (deposed.calls, new.calls) == (2, 2)
        # With no other address left, the stale answer is an error that says why.
        new.term = 7
        assert c.get("job-4").job_id == "job-4"
    with lockstep.Client(deposed_address, timeout=5) as c:
        c._term = 7
        with pytest.raises(lockstep.LockstepError) as e:
            c.get("job-5")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert "term 3" in e.value.message and "term 7" in e.value.message
        # A submit's answer stands (its write was taken under that term): never sent twice.
        assert c.submit({"name": "x"}).job_id == "job-1"
        assert deposed.calls == 4


def test_a_call_that_reached_a_failing_coordinator_is_not_sent_again(coordinators):
    broken = _Coordinator(broken=True)
    other = _Coordinator()
    with lockstep.Client(f"{coordinators(broken)},{coordinators(other)}", timeout=5) as c:
        with pytest.raises(lockstep.LockstepError) as e:
            c.submit({"name": "x"})
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "mid-call" in e.value.message
    assert (broken.calls, other.calls) == (1, 0)


def test_an_address_list_with_a_bad_entry_is_refused():
    with pytest.raises(ValueError, match="'nocolon'"):
        lockstep.Client("127.0.0.1:1,nocolon")
