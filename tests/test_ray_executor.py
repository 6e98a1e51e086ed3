"""The Ray executor: a local Ray cluster on loopback, started by this module and stopped after it,
runs two tensor-parallel ranks as Ray actors; they give the tokens one process gives, and their
actors and placement are gone when the engine shuts down. Without Ray the backend is refused in
one line naming the extra."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hookllm import LLM, EngineConfig, SamplingParams, testing
from server_fixtures import free_port

RAY = str(Path(sys.executable).with_name("ray"))
CLUSTER_CPUS = 4
LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """``ray start --head`` on 127.0.0.1 (no dashboard), its address; ``ray stop`` afterwards."""
    import ray

    port = free_port()
    # Ray's "local machine only" mode: every Ray process binds and dials 127.0.0.1, never the
    # host's other addresses.
    env = {**os.environ, LOOPBACK_ONLY: "0", "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                    f"--num-cpus={CLUSTER_CPUS}", "--num-gpus=0", "--include-dashboard=false",
                    "--disable-usage-stats", f"--temp-dir={tmp_path_factory.mktemp('ray')}"],
                   check=True, capture_output=True, timeout=180, env=env)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=180, env=env)


def test_two_ranks_as_ray_actors_answer_as_one_process_and_leave_nothing(ray_cluster, tiny_llama_dir, monkeypatch,
                                                                         tmp_path):
    import ray
    from ray._private import ray_constants

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # this process dials 127.0.0.1 too
    # Ray puts the driver's working directory first on its workers' sys.path: not this
    # repository's root, whose kernels/ folder would hide the `kernels` package transformers imports.
    monkeypatch.chdir(tmp_path)
    prompts = testing.random_prompts(3, 320, min_len=5, max_len=30, seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    options = dict(device="cpu", dtype="float32", num_kv_blocks=64)
    expected = LLM(str(tiny_llama_dir), **options).generate([{"prompt_token_ids": p} for p in prompts], params)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, distributed_executor_backend="ray", **options)
    try:
        assert len(llm.engine.engine_core.executor.actors) == 2
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < CLUSTER_CPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == CLUSTER_CPUS  # the placement group is gone


def test_the_ray_backend_without_ray_installed_names_the_extra(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"needs Ray, which is not installed: pip install 'hookllm\[ray\]'"):
        EngineConfig(model="unused", distributed_executor_backend="ray")
