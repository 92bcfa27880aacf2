"""The Lockstep Python client.

    python3 -m venv --system-site-packages venv && venv/bin/pip install ./python

grpcio and protobuf come from Debian (python3-grpcio, python3-protobuf); the gRPC stubs are
generated from ../proto when the package is built (protoc and grpc_python_plugin, from
protobuf-compiler and protobuf-compiler-grpc), never checked in. No network is needed.
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.join(HERE, "..", "proto")
PROTOS = ["lockstep/v1/job.proto", "lockstep/v1/model.proto", "lockstep/v1/program.proto"]


def generate_stubs(out_dir):
    """Writes lockstep/v1/{job,model}_pb2.py and job_pb2_grpc.py under out_dir."""
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc is None or plugin is None:
        raise RuntimeError("generating the gRPC stubs needs protoc and grpc_python_plugin "
                           "(Debian: protobuf-compiler protobuf-compiler-grpc)")
    if not os.path.isdir(os.path.join(PROTO_ROOT, "lockstep")):
        raise RuntimeError(f"no proto/ next to {HERE}: install from a Lockstep checkout")
    os.makedirs(os.path.join(out_dir, "lockstep", "v1"), exist_ok=True)
    subprocess.run([protoc, f"-I{PROTO_ROOT}", f"--python_out={out_dir}",
                    f"--grpc_python_out={out_dir}", f"--plugin=protoc-gen-grpc_python={plugin}",
                    *PROTOS], check=True)
    with open(os.path.join(out_dir, "lockstep", "v1", "__init__.py"), "w") as f:
        f.write('"""Generated from proto/lockstep/v1 when the package was built."""\n')


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        generate_stubs(self.build_lib)


setup(
    name="lockstep",
    version="0.1.0",
    description="Client for the Lockstep elastic training service",
    packages=["lockstep"],
    python_requires=">=3.9",
    install_requires=[],  # grpcio and protobuf: Debian's python3-grpcio, python3-protobuf
    cmdclass={"build_py": BuildWithStubs},
)
