"""``hookllm serve`` in a subprocess on 127.0.0.1 and a free port, for the server tests."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def free_port_pair() -> int:
    """A port ``P`` of loopback with ``P + 1`` free too (a multi-node engine listens on
    ``master_port + 1``). Drawn below the kernel's ephemeral range (32768 and up), where no
    ``free_port`` and no client connection of a test running beside this one can take ``P + 1``
    between this check and the engine's bind."""
    for _ in range(200):
        port = random.randrange(20000, 32000, 2)
        with socket.socket() as first, socket.socket() as second:
            try:
                first.bind((HOST, port))
                second.bind((HOST, port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports on loopback between 20000 and 32000")


def with_chat_template(source: Path, target: Path, template: str = CHAT_TEMPLATE) -> Path:
    """A copy of a checkpoint folder whose tokenizer has ``template``."""
    shutil.copytree(source, target)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(target)
    return target


def tiny_chat_model(root: Path, max_positions: int) -> Path:
    """A tiny random Llama of ``max_positions`` positions, with a tokenizer and a chat template,
    at ``root``/model."""
    from hookllm import testing

    base = root / "base"
    testing.build_tiny_checkpoint(testing.tiny_llama_config(max_position_embeddings=max_positions), base)
    testing.build_tiny_tokenizer(base)
    return with_chat_template(base, root / "model")


class Server:
    """A running ``hookllm serve``: its base URL; ``stop()`` sends SIGTERM and waits."""

    def __init__(self, args: list[str], startup_s: float = 120.0):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        command = [sys.executable, "-m", "hookllm.entrypoints.cli", "serve", "--host", HOST, "--port", str(self.port),
                   "--log-level", "warning", *args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._wait_healthy(startup_s)

    def _wait_healthy(self, startup_s: float) -> None:
        deadline = time.monotonic() + startup_s
        for _ in range(int(startup_s / 0.25)):
            if self.process.poll() is not None:
                raise RuntimeError(f"hookllm serve exited with {self.process.returncode}:\n{self.process.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"hookllm serve did not become healthy within {startup_s} s")

    def stop(self, timeout_s: float = 30.0) -> int:
        self.process.terminate()
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout_s)
            raise

    def metric(self, name: str, label: str = "") -> float:
        """A sample's value from /metrics: the first named ``name`` whose labels contain ``label``
        (0 if none: a labelled counter appears only once it counted)."""
        for line in httpx.get(f"{self.url}/metrics", timeout=5.0).text.splitlines():
            sample, _, value = line.rpartition(" ")
            if sample.split("{")[0] == name and label in sample:
                return float(value)
        return 0.0
