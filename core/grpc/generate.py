"""Regenerate the Python modules of ``vllm_engine.proto`` beside it (needs grpcio-tools):

    python -m hookllm.grpc.generate [OUT_DIR]

protoc names a module's imports by the path it reads the ``.proto`` from, so the file is read as
``hookllm/grpc/vllm_engine.proto`` (a copy under a temporary root) and the modules import each
other as ``hookllm.grpc.vllm_engine_pb2``. ``tests/test_grpc_server.py`` checks that the
committed modules are what this writes.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "vllm_engine.proto"
GENERATED = ("vllm_engine_pb2.py", "vllm_engine_pb2.pyi", "vllm_engine_pb2_grpc.py")


def generate(out_dir: Path = HERE) -> list[Path]:
    """Write the generated modules into ``out_dir``; their paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as root:
        package = Path(root, "hookllm", "grpc")
        package.mkdir(parents=True)
        shutil.copy(HERE / PROTO, package / PROTO)
        status = protoc.main(["protoc", f"-I{root}", f"--python_out={root}", f"--pyi_out={root}",
                              f"--grpc_python_out={root}", f"hookllm/grpc/{PROTO}"])
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (status {status})")
        out_dir.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(package / name, out_dir / name)) for name in GENERATED]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
