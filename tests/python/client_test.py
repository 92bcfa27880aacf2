#!/usr/bin/env python3
"""The Python client as a user runs it: `pip install ./python` into a fresh virtual environment
(offline: --no-index; grpcio and protobuf from Debian's packages), then a real Python process
drives a local cluster (deploy/local/cluster.sh, 2 workers, a token) through the installed
package: submit a dict spec, watch it to the end, get, list, workers, cancel; and the errors:
mutual TLS against a second cluster; a bad spec names its field, an unknown job is NOT_FOUND, cancelling a finished job is
FAILED_PRECONDITION, a wrong token is UNAUTHENTICATED, a spec with an unknown key never leaves
the client. Exit 77 (skipped) where Debian's python3-grpcio or python3-venv is missing.

Usage: tests/python/client_test.py --build BUILD_DIR
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def inner(address, token, tls_address, pki):
    """Runs in the virtual environment's Python, against the installed package."""
    import grpc
    import lockstep

    assert os.path.dirname(lockstep.__file__).startswith(sys.prefix), lockstep.__file__

    class ClientTest(unittest.TestCase):
        def setUp(self):
            self.client = lockstep.Client(address, token=token)

        def tearDown(self):
            self.client.close()

        def spec(self, steps):
            return {
                "name": "python-client",
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

        def test_submit_watch_get_list_workers(self):
            job = self.client.submit(self.spec(200))
            self.assertTrue(job.job_id.startswith("job-"), job.job_id)
            events = list(self.client.watch(job.job_id))
            self.assertGreater(len(events), 2)
            self.assertEqual([e.sequence for e in events], list(range(len(events))))
            final = self.client.get(job.job_id)
            self.assertEqual(lockstep.to_dict(final)["state"], "JOB_STATE_SUCCEEDED", final.reason)
            self.assertEqual(final.step, 200)
            self.assertEqual(len({m.parameter_checksum for m in final.members}), 1)
            self.assertEqual(events[-1].job.state, final.state)
            as_dict = lockstep.to_dict(final)
            self.assertEqual(as_dict["state"], "JOB_STATE_SUCCEEDED")
            self.assertEqual(int(as_dict["step"]), 200)
            self.assertIn(job.job_id, [j.job_id for j in self.client.list()])
            workers = self.client.workers()
            self.assertEqual(len(workers), 2)
            self.assertTrue(all(w.device == "cpu" for w in workers))
            # Cancelling a finished job.
            with self.assertRaises(lockstep.LockstepError) as e:
                self.client.cancel(job.job_id)
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)

        def test_cancel_a_running_job(self):
            job = self.client.submit(self.spec(1_000_000))
            for event in self.client.watch(job.job_id):
                if event.job.step > 0:
                    break
            cancelled = self.client.cancel(job.job_id)
            self.assertEqual(lockstep.to_dict(cancelled)["state"], "JOB_STATE_CANCELLED")
            # watch of an ended job replays its history and ends.
            self.assertEqual(lockstep.to_dict(list(self.client.watch(job.job_id))[-1].job)["state"],
                             "JOB_STATE_CANCELLED")

        def test_errors_carry_the_code_and_the_coordinators_words(self):
            bad = self.spec(10)
            bad["globalBatchSize"] = -5
            with self.assertRaises(lockstep.LockstepError) as e:
                self.client.submit(bad)
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("global_batch_size", e.exception.message)
            with self.assertRaises(lockstep.LockstepError) as e:
                self.client.get("job-404-nowhere")
            self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
            with self.assertRaises(lockstep.LockstepError) as e:
                list(self.client.watch("job-404-nowhere"))
            self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
            typo = self.spec(10)
            typo["maxStpes"] = 10
            with self.assertRaises(lockstep.LockstepError) as e:
                self.client.submit(typo)
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("maxStpes", e.exception.message)
            with self.assertRaises(TypeError):
                self.client.submit("not a spec")

        def test_a_wrong_or_missing_token_is_refused(self):
            for wrong in ["not-the-token", ""]:
                with lockstep.Client(address, token=wrong) as client:
                    with self.assertRaises(lockstep.LockstepError) as e:
                        client.list()
                    self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)
                    self.assertIn("token", e.exception.message)

        def test_mutual_tls(self):
            files = {"ca": os.path.join(pki, "ca.crt"), "cert": os.path.join(pki, "client.crt"),
                     "key": os.path.join(pki, "client.key")}
            with lockstep.Client(tls_address, token=token, tls=files) as client:
                self.assertEqual(len(client.workers()), 1)
            # Without a client certificate, or in plaintext: refused.
            for tls in [{"ca": files["ca"]}, None]:
                with lockstep.Client(tls_address, token=token, tls=tls, timeout=5) as client:
                    with self.assertRaises(lockstep.LockstepError) as e:
                        client.list()
                    self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)

        def test_bad_client_arguments(self):
            with self.assertRaises(ValueError):
                lockstep.Client("no-port")
            with self.assertRaises(ValueError) as e:
                lockstep.Client(address, tls={"ca": "/nonexistent/ca.pem"})
            self.assertIn("/nonexistent/ca.pem", str(e.exception))
            with self.assertRaises(ValueError):
                lockstep.Client(address, tls={"cert": "c.pem"})

    result = unittest.TextTestRunner(verbosity=2).run(
        unittest.defaultTestLoader.loadTestsFromTestCase(ClientTest))
    return 0 if result.wasSuccessful() else 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--inner", nargs=4, metavar=("ADDRESS", "TOKEN", "TLS_ADDRESS", "PKI"))
    args = p.parse_args()
    if args.inner:
        return inner(*args.inner)
    try:
        import grpc  # noqa: F401
        import google.protobuf  # noqa: F401
        import venv  # noqa: F401
    except ImportError as e:
        print(f"SKIP: {e} (scripts/install_deps.sh --test installs python3-grpcio, "
              "python3-protobuf and python3-venv)")
        return 77
    work = tempfile.mkdtemp(prefix="lockstep-python.")
    cluster = os.path.join(work, "cluster")
    tls_cluster = os.path.join(work, "tls-cluster")
    try:
        # A copy of what a user has: the package and the protos it is built from.
        for d in ["python", "proto"]:
            shutil.copytree(os.path.join(ROOT, d), os.path.join(work, "src", d))
        env_dir = os.path.join(work, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", env_dir], check=True)
        py = os.path.join(env_dir, "bin", "python")
        subprocess.run([py, "-m", "pip", "install", "--no-index", "--quiet",
                        os.path.join(work, "src", "python")], check=True, cwd=work)
        token = "python-" + os.urandom(8).hex()
        token_file = os.path.join(work, "token")
        with open(token_file, "w") as f:
            f.write(token + "\n")
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "start", "--dir", cluster,
                        "--workers", "2", "--bin", args.build, "--token_file", token_file],
                       check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(cluster, "address")) as f:
            address = f.read().strip()
        # A second cluster with mutual TLS: every daemon reads $LOCKSTEP_TLS_* (one certificate
        # for 127.0.0.1, signed by the test's CA, serves as the coordinator's and the worker's).
        pki = os.path.join(work, "pki")
        os.makedirs(pki)
        script = """set -e
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -subj /CN=ca -days 2 -out ca.crt
for who in node client; do
  openssl req -newkey rsa:2048 -nodes -keyout $who.key -subj /CN=$who -out $who.csr
  echo subjectAltName=IP:127.0.0.1 > san.ext
  openssl x509 -req -in $who.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \\
    -extfile san.ext -out $who.crt
done"""
        subprocess.run(["/bin/bash", "-c", script], cwd=pki, check=True, capture_output=True)
        tls_env = dict(os.environ, LOCKSTEP_TLS_CERT=os.path.join(pki, "node.crt"),
                       LOCKSTEP_TLS_KEY=os.path.join(pki, "node.key"),
                       LOCKSTEP_TLS_CA=os.path.join(pki, "ca.crt"))
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "start", "--dir", tls_cluster,
                        "--workers", "1", "--bin", args.build, "--token_file", token_file],
                       check=True, stdout=subprocess.DEVNULL, env=tls_env)
        with open(os.path.join(tls_cluster, "address")) as f:
            tls_address = f.read().strip()
        # The installed package, not the source tree: run from the work directory.
        return subprocess.run([py, os.path.abspath(__file__), "--inner", address, token,
                               tls_address, pki], cwd=work, timeout=600).returncode
    finally:
        for d in [cluster, tls_cluster]:
            if os.path.exists(os.path.join(d, "address")):
                subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "stop", "--dir", d],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
