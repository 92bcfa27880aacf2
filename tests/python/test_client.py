"""pytest tests of the installed Python client against the clusters client_test.py started (it
passes them in LOCKSTEP_TEST_*): submit a dict spec, watch it to the end, get, list, workers,
the training curve, cancel; mutual TLS; and the errors: a bad spec names its field, an unknown
job is NOT_FOUND, cancelling a finished job is FAILED_PRECONDITION, a wrong or missing token is
UNAUTHENTICATED, a spec with an unknown key never leaves the client."""
import os
import sys
import time

import grpc
import pytest

import lockstep

ADDRESS = os.environ.get("LOCKSTEP_TEST_ADDRESS", "")
TOKEN = os.environ.get("LOCKSTEP_TEST_TOKEN", "")
TLS_ADDRESS = os.environ.get("LOCKSTEP_TEST_TLS_ADDRESS", "")
PKI = os.environ.get("LOCKSTEP_TEST_PKI", "")
PROGRAMS = os.environ.get("LOCKSTEP_TEST_PROGRAMS", "")

if not ADDRESS:
    pytest.skip("run through tests/python/client_test.py, which starts the clusters",
                allow_module_level=True)


def spec(steps):
    return {
        "name": "python-client",
        # The form before the family messages (model.mlp): still accepted, end to end.
        "model": {"type": "mlp", "hiddenWidths": [32]},
        "dataset": {"type": "synthetic",
                    "synthetic": {"trainSamples": 2048, "testSamples": 512, "inputDim": 16,
                                  "numClasses": 4, "seed": 1}},
        "optimizer": {"type": "sgd", "learningRate": 0.05, "momentum": 0.9},
        "globalBatchSize": 64,
        "maxSteps": steps,
        "minWorkers": 2,
        "maxWorkers": 2,
    }


@pytest.fixture
def client():
    with lockstep.Client(ADDRESS, token=TOKEN) as c:
        yield c


def test_the_package_is_the_installed_one():
    assert os.path.dirname(lockstep.__file__).startswith(sys.prefix), lockstep.__file__


def test_submit_watch_get_list_workers_curve(client):
    job = client.submit(spec(200))
    assert job.job_id.startswith("job-"), job.job_id
    events = list(client.watch(job.job_id))
    assert len(events) > 2
    assert [e.sequence for e in events] == list(range(len(events)))
    final = client.get(job.job_id)
    assert lockstep.to_dict(final)["state"] == "JOB_STATE_SUCCEEDED", final.reason
    assert final.step == 200
    assert len({m.parameter_checksum for m in final.members}) == 1
    assert events[-1].job.state == final.state
    assert int(lockstep.to_dict(final)["step"]) == 200
    assert job.job_id in [j.job_id for j in client.list()]
    workers = client.workers()
    assert len(workers) == 2
    assert all(w.device == "cpu" for w in workers)
    # The membership timeline and the training curve.
    assert [g.generation for g in final.generations] == [1]
    assert sorted(final.generations[0].joined) == sorted(w.name for w in workers)
    points = client.curve(job.job_id)
    assert len(points) >= 2
    assert points[0].step == 1 and points[-1].step == 200
    assert all(b.step > a.step for a, b in zip(points, points[1:]))
    assert all(p.loss > 0 for p in points)
    # Cancelling a finished job.
    with pytest.raises(lockstep.LockstepError) as e:
        client.cancel(job.job_id)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_cancel_a_running_job(client):
    job = client.submit(spec(1_000_000))
    for event in client.watch(job.job_id):
        if event.job.step > 0:
            break
    cancelled = client.cancel(job.job_id)
    assert lockstep.to_dict(cancelled)["state"] == "JOB_STATE_CANCELLED"
    # watch of an ended job replays its history and ends.
    assert lockstep.to_dict(list(client.watch(job.job_id))[-1].job)["state"] == "JOB_STATE_CANCELLED"


def wait_for(client, job_id, done):
    for event in client.watch(job_id):
        if done(event.job):
            return event.job
    return client.get(job_id)


def poll(client, job_id, done, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(job_id)
        if done(job) or time.monotonic() > deadline:
            return job
        time.sleep(0.05)


def test_the_queue_lists_jobs_in_the_order_they_start(client):
    running = client.submit(dict(spec(1_000_000), priority=5))
    wait_for(client, running.job_id, lambda j: j.step > 0)
    later = client.submit(spec(10))
    urgent = client.submit(dict(spec(10), priority=3))
    try:
        # A job's reason is set by the scheduler's pass after its submit: wait for both.
        deadline = time.monotonic() + 30
        queue = client.queue()
        while not all(j.reason for j in queue) and time.monotonic() < deadline:
            time.sleep(0.05)
            queue = client.queue()
        # The running job has the higher priority: priority 3 cannot preempt it, and waits first.
        assert [j.job_id for j in queue] == [urgent.job_id, later.job_id]
        assert "waiting for 2 idle" in queue[0].reason
        assert f"queued behind {urgent.job_id} (priority 3)" in queue[1].reason
        assert queue[0].spec.priority == 3
        assert lockstep.to_dict(queue[0])["state"] == "JOB_STATE_PENDING"

        # Suspended by hand, the running job gives its workers to the queue and keeps its state
        # in their memory; it waits for resume(), not for workers.
        suspended = client.suspend(running.job_id)
        assert lockstep.to_dict(suspended)["state"] == "JOB_STATE_SUSPENDED"
        assert suspended.suspension.by_user
        assert suspended.suspension.step > 0
        with pytest.raises(lockstep.LockstepError) as e:
            client.suspend(running.job_id)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        for job in (urgent, later):
            ended = wait_for(client, job.job_id, lambda j: j.state in (4, 5, 6))
            assert lockstep.to_dict(ended)["state"] == "JOB_STATE_SUCCEEDED", ended.reason
        assert [j.job_id for j in client.queue()] == []
        held = client.get(running.job_id)
        assert lockstep.to_dict(held)["state"] == "JOB_STATE_SUSPENDED"
        assert len(held.suspension.holders) == 2

        # Resumed, it goes on from the step it was suspended at: nothing redone, no restart
        # counted.
        client.resume(running.job_id)
        resumed = poll(client, running.job_id,
                       lambda j: j.step > suspended.suspension.step and j.recovery_history)
        assert lockstep.to_dict(resumed)["state"] == "JOB_STATE_RUNNING", (resumed.step, resumed.reason)
        assert resumed.recovery_history[-1].resumed_from_step >= held.suspension.step
        assert "resumed after" in resumed.recovery_history[-1].reason
        assert not resumed.recovery_history[-1].counted
        assert resumed.recoveries == 0
        with pytest.raises(lockstep.LockstepError) as e:
            client.resume(running.job_id)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        for job in (urgent, later, running):
            try:
                client.cancel(job.job_id)
            except lockstep.LockstepError:
                pass  # ended already
    assert client.queue() == []


def test_errors_carry_the_code_and_the_coordinators_words(client):
    bad = spec(10)
    bad["globalBatchSize"] = -5
    with pytest.raises(lockstep.LockstepError) as e:
        client.submit(bad)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "global_batch_size" in e.value.message
    for call in [lambda: client.get("job-404-nowhere"),
                 lambda: list(client.watch("job-404-nowhere")),
                 lambda: client.curve("job-404-nowhere")]:
        with pytest.raises(lockstep.LockstepError) as e:
            call()
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert "job-404-nowhere" in e.value.message
    typo = spec(10)
    typo["maxStpes"] = 10
    with pytest.raises(lockstep.LockstepError) as e:
        client.submit(typo)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "maxStpes" in e.value.message
    with pytest.raises(TypeError):
        client.submit("not a spec")


@pytest.mark.parametrize("wrong", ["not-the-token", ""])
def test_a_wrong_or_missing_token_is_refused(wrong):
    with lockstep.Client(ADDRESS, token=wrong) as c:
        with pytest.raises(lockstep.LockstepError) as e:
            c.list()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "token" in e.value.message


def test_mutual_tls():
    files = {"ca": os.path.join(PKI, "ca.crt"), "cert": os.path.join(PKI, "client.crt"),
             "key": os.path.join(PKI, "client.key")}
    with lockstep.Client(TLS_ADDRESS, token=TOKEN, tls=files) as c:
        assert len(c.workers()) == 1
    # Without a client certificate, or in plaintext: refused.
    for tls in [{"ca": files["ca"]}, None]:
        with lockstep.Client(TLS_ADDRESS, token=TOKEN, tls=tls, timeout=5) as c:
            with pytest.raises(lockstep.LockstepError) as e:
                c.list()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_bad_client_arguments():
    with pytest.raises(ValueError):
        lockstep.Client("no-port")
    with pytest.raises(ValueError) as e:
        lockstep.Client(ADDRESS, tls={"ca": "/nonexistent/ca.pem"})
    assert "/nonexistent/ca.pem" in str(e.value)
    with pytest.raises(ValueError):
        lockstep.Client(ADDRESS, tls={"cert": "c.pem"})


def test_a_program_jobs_output_through_logs(client):
    script = os.path.join(PROGRAMS, "hello.py")
    with open(script, "w") as f:
        f.write("import os, sys\n"
                "print('hello from rank', os.environ['RANK'])\n"
                "print('warned', file=sys.stderr)\n")
    os.chmod(script, 0o644)
    job = client.submit({"name": "hello", "minWorkers": 2, "maxWorkers": 2,
                         "program": {"argv": ["/usr/bin/python3", "hello.py"],
                                     "workdir": PROGRAMS}})
    lines = list(client.logs(job.job_id, follow=True))
    assert client.get(job.job_id).state == lockstep.v1.job_pb2.JOB_STATE_SUCCEEDED
    texts = sorted((line.rank, line.stderr, line.text) for line in lines)
    assert texts == [(0, False, "hello from rank 0"), (0, True, "warned"),
                     (1, False, "hello from rank 1"), (1, True, "warned")], texts
    assert sorted(line.text for line in client.logs(job.job_id, rank=1)) == [
        "hello from rank 1", "warned"]
    assert {line.generation for line in lines} == {1}

