#!/usr/bin/env python3
"""The Python client as a user runs it: `pip install ./python` into a fresh virtual environment
(offline: --no-index; grpcio, protobuf and pytest from Debian's packages), two local clusters
(deploy/local/cluster.sh with a token; the second with mutual TLS), and then pytest in that
environment runs tests/python/test_client.py against them through the installed package, and
tests/python/test_client_unit.py (fake servers of its own; no cluster).
Exit 77 (skipped) where Debian's python3-grpcio, python3-venv or python3-pytest is missing.

Usage: tests/python/client_test.py --build BUILD_DIR
"""
import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    args = p.parse_args()
    try:
        import grpc  # noqa: F401
        import google.protobuf  # noqa: F401
        import pytest  # noqa: F401
        import venv  # noqa: F401
    except ImportError as e:
        print(f"SKIP: {e} (scripts/install_deps.sh --test installs python3-grpcio, "
              "python3-protobuf, python3-pytest and python3-venv)")
        return 77
    work = tempfile.mkdtemp(prefix="lockstep-python.")
    os.chmod(work, 0o755)  # the programs run as nobody when the test runs as root
    programs = os.path.join(work, "programs")
    os.makedirs(programs)
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
        # The Checkpointer's native copy was compiled into the installed package, and loads
        # (lockstep.checkpoint imports torch: checked where Debian's python3-torch is).
        if importlib.util.find_spec("torch") is not None:
            check = ("import sys, lockstep.checkpoint as c; sys.exit(c._GATHER is None and "
                     "'the installed package has no liblockstep_checkpoint.so')")
            subprocess.run([py, "-c", check], check=True, cwd=work)
        token = "python-" + os.urandom(8).hex()
        token_file = os.path.join(work, "token")
        with open(token_file, "w") as f:
            f.write(token + "\n")
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "start", "--dir", cluster,
                        "--workers", "2", "--bin", args.build, "--token_file", token_file,
                        "--programs_root", programs],
                       check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(cluster, "address")) as f:
            address = f.read().strip()
        # A second cluster with mutual TLS: every daemon reads $LOCKSTEP_TLS_* (one certificate
        # for 127.0.0.1 named w0, signed by the test's CA, serves as the coordinator's and as
        # the worker w0's).
        pki = os.path.join(work, "pki")
        os.makedirs(pki)
        script = """set -e
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -subj /CN=ca -days 2 -out ca.crt
for who in node client; do
  cn=$who; [ $who = node ] && cn=w0   # a worker registers under its certificate's name
  openssl req -newkey rsa:2048 -nodes -keyout $who.key -subj /CN=$cn -out $who.csr
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
        # The installed package, not the source tree: the tests run from the work directory.
        env = dict(os.environ, LOCKSTEP_TEST_ADDRESS=address, LOCKSTEP_TEST_TOKEN=token,
                   LOCKSTEP_TEST_TLS_ADDRESS=tls_address, LOCKSTEP_TEST_PKI=pki,
                   LOCKSTEP_TEST_PROGRAMS=programs)
        for key in ["LOCKSTEP_TOKEN", "LOCKSTEP_TLS_CERT", "LOCKSTEP_TLS_KEY", "LOCKSTEP_TLS_CA"]:
            env.pop(key, None)
        here = os.path.dirname(os.path.abspath(__file__))
        test_files = [os.path.join(here, name)
                      for name in ["test_client.py", "test_client_unit.py"]]
        return subprocess.run([py, "-m", "pytest", "-v", "-p", "no:cacheprovider", *test_files],
                              cwd=work, env=env, timeout=600).returncode
    finally:
        for d in [cluster, tls_cluster]:
            if os.path.exists(os.path.join(d, "address")):
                subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "stop", "--dir", d],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
