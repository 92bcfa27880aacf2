"""The Lockstep Python client.

    python3 -m venv --system-site-packages venv && venv/bin/pip install ./python

grpcio and protobuf come from Debian (python3-grpcio, python3-protobuf); the gRPC stubs are
generated from ../proto when the package is built (protoc and grpc_python_plugin, from
protobuf-compiler and protobuf-compiler-grpc), never checked in; so is the Checkpointer's
native copy (native/checkpoint_copy.cc, with g++ and libxxhash-dev, else left out). No network
is needed.
"""
import os
import shlex
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


def build_native(out_dir):
    """Compiles native/checkpoint_copy.cc into out_dir/lockstep/liblockstep_checkpoint.so, the
    copy lockstep.torch.Checkpointer.save makes (docs/programs.md). Where no C++ compiler or
    libxxhash is found (Debian: g++, libxxhash-dev) it says so and goes on: a save then copies
    with torch.cat and hashes with the xxhash module, to the same bytes, more slowly."""
    cxx = shlex.split(os.environ.get("CXX", "")) or \
        [c for c in (shutil.which("c++"), shutil.which("g++")) if c][:1]
    out = os.path.join(out_dir, "lockstep", "liblockstep_checkpoint.so")
    if os.path.exists(out):
        os.remove(out)  # an earlier build's: never installed in place of this one's
    why = "no C++ compiler (c++, g++ or $CXX)"
    if cxx:
        try:
            done = subprocess.run([*cxx, "-O2", "-std=c++17", "-shared", "-fPIC",
                                   "-fvisibility=hidden", "-o", out,
                                   os.path.join(HERE, "native", "checkpoint_copy.cc"),
                                   "-lxxhash", "-Wl,-z,defs"],  # every symbol found now
                                  capture_output=True, text=True)
        except OSError as e:
            why = f"{cxx[0]}: {e.strerror}"
        else:
            if done.returncode == 0:
                return
            why = (done.stderr.strip().splitlines() or ["failed"])[0]
    print(f"lockstep: liblockstep_checkpoint.so not built ({why}); Checkpointer.save will copy "
          f"with torch.cat")


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        generate_stubs(self.build_lib)
        build_native(self.build_lib)


setup(
    name="lockstep",
    version="0.1.0",
    description="Client for the Lockstep elastic training service",
    packages=["lockstep"],
    python_requires=">=3.9",
    install_requires=[],  # grpcio and protobuf: Debian's python3-grpcio, python3-protobuf
    cmdclass={"build_py": BuildWithStubs},
)
