"""Charts of the benchmark results (the JSON files in benchmarks/results/), as PNGs.

- throughput.png: workload A output tok/s per shape, hookllm against its peers, each engine's
  latest result, with the physical limits (decode only, and with prefill where the run recorded it).
- step-breakdown.png: one decode step of the latest profile_step.py run: GPU kernel time by
  kernel and host time by part, beside the step's wall time.
- progress.png: hookllm's workload A output tok/s on the Llama-3.2-1B shape, run by run, in the
  order of the commits measured.

"Latest" and "in order" go by the commit measured (its git commit time; the run's date where git
does not know the commit), then by the run's date.

    python benchmarks/plots.py [--results benchmarks/results] [--out docs/images]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
ENGINES = {"hookllm": "hookllm", "transformers_cb": "transformers continuous batching",
           "transformers_static": "transformers static generate"}
PROGRESS_SHAPE = "llama-3.2-1b"
# profile_step.py's host parts that contain another part: parent -> child (the stack shows the parent less the child).
HOST_NESTING = {"forward (build inputs + launch or replay)": "build_inputs", "process outputs": "wait for tokens"}


@functools.cache
def commit_time(sha: str) -> float | None:
    """Seconds since the epoch at which ``sha`` was committed; None where git does not know it."""
    try:
        out = subprocess.check_output(["git", "show", "-s", "--format=%ct", sha.removesuffix("-dirty")], cwd=HERE,
                                      text=True, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError):
        return None
    return float(out.strip())


def run_time(run: dict) -> float:
    when = datetime.datetime.strptime(run["date"], "%Y-%m-%d %H:%M UTC")
    return when.replace(tzinfo=datetime.timezone.utc).timestamp()


def load(results: Path, pattern: str) -> list[dict]:
    """The result files matching ``pattern``, oldest commit first (then oldest run)."""
    runs = [json.loads(path.read_text()) for path in results.glob(pattern)]
    return sorted(runs, key=lambda run: (commit_time(run["commit"]) or run_time(run), run_time(run)))


def workload_a_runs(results: Path) -> list[dict]:
    """throughput.py runs of workload A in the model dtype (files from before --workload existed are
    all workload A); FP8 runs (``--quantization``, ``--kv-cache-dtype``) are tabled in
    docs/performance.md, not charted beside them."""
    return [run for run in load(results, "throughput-*.json") if run.get("workload_name", "a") == "a"
            and not run.get("quantization") and run.get("kv_cache_dtype", "auto") == "auto"]


def plot_throughput(runs: list[dict], out: Path) -> Path:
    latest: dict[str, dict[str, tuple[float, str]]] = {}  # shape -> engine -> (tok/s, commit)
    limits: dict[str, dict] = {}  # shape -> its latest run that recorded the limits
    for run in runs:  # oldest first: later runs overwrite
        for engine, row in run["results"].items():
            if engine in ENGINES and "output_tok_s" in row:
                latest.setdefault(run["model"], {})[engine] = (row["output_tok_s"], run["commit"])
        if "physical_limit_output_tok_s" in run:
            limits[run["model"]] = run
    shapes = sorted(latest)
    fig, ax = plt.subplots(figsize=(10, 5.5))
    labelled: set[str] = set()

    def once(label: str) -> str:  # one legend entry per label
        if label in labelled:
            return "_nolegend_"
        labelled.add(label)
        return label

    width = 0.8 / len(ENGINES)
    for i, shape in enumerate(shapes):
        for k, (engine, label) in enumerate(ENGINES.items()):
            if engine in latest[shape]:
                value, sha = latest[shape][engine]
                x = i - 0.4 + (k + 0.5) * width
                ax.bar(x, value, width, color=f"C{k}", label=once(label))
                ax.annotate(f"{value:,.0f}\n{sha}", (x, value), ha="center", va="bottom", fontsize=7)
        for key, style, label in (("physical_limit_output_tok_s", "--", "decode limit"),
                                  ("physical_limit_with_prefill_output_tok_s", ":", "limit with prefill")):
            if key in limits.get(shape, {}):
                ax.hlines(limits[shape][key], i - 0.45, i + 0.45, colors="black", linestyles=style, label=once(label))
                ax.annotate(f"{limits[shape][key]:,.0f}", (i + 0.45, limits[shape][key]), va="center", fontsize=7)
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_yscale("log")
    ax.set_ylabel("output tok/s (log scale)")
    ax.set_title("Workload A: output tok/s per shape, each engine's latest result")
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    return save(fig, out / "throughput.png")


def kernel_group(name: str) -> str:
    """Matmul kernels (cuBLAS's nvjet, CUTLASS, gemm) as one group; other kernels by name."""
    if any(key in name.lower() for key in ("nvjet", "gemm", "cutlass")):
        return "GEMMs"
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    return name.split("<")[0].split("(")[0].strip("_ ")[:48]


def step_parts(profile: dict) -> tuple[dict[str, float], dict[str, float]]:
    """(GPU kernel ms by group, host ms by part with nested parts taken out of their parents)."""
    per_step = profile["per_step"]
    gpu: dict[str, float] = {}
    for name, us in profile["top_kernels_us_per_step"].items():
        gpu[kernel_group(name)] = gpu.get(kernel_group(name), 0.0) + us / 1e3
    gpu["other kernels"] = max(0.0, per_step["gpu_busy_ms_per_step"] - sum(gpu.values()))
    host = {key.removeprefix("host_ms_"): ms for key, ms in per_step.items() if key.startswith("host_ms_")}
    for parent, child in HOST_NESTING.items():
        if parent in host and child in host:
            host[f"{parent} less {child}"] = host.pop(parent) - host[child]
    return gpu, host


def plot_step_breakdown(profile: dict, out: Path) -> Path:
    gpu, host = step_parts(profile)
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for row, (parts, colors) in enumerate(((host, plt.cm.Set2), (gpu, plt.cm.tab20))):
        left = 0.0
        for k, (name, ms) in enumerate(sorted(parts.items(), key=lambda item: -item[1])):
            ax.barh(row, ms, left=left, color=colors(k), edgecolor="white", label=f"{name}: {ms:.2f} ms")
            left += ms
    wall = profile["per_step"]["wall_ms_per_step"]
    ax.axvline(wall, color="black", linestyle="--", label=f"wall time per step: {wall:.2f} ms")
    ax.set_yticks([0, 1], ["host", "GPU kernels"])
    ax.set_xlabel("ms per decode step")
    ax.set_title(f"{profile['model']}: one decode step at batch {profile['per_step']['batch']} "
                 f"({profile['commit']}, {profile['date']})")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    return save(fig, out / "step-breakdown.png")


def plot_progress(runs: list[dict], out: Path) -> Path:
    runs = [run for run in runs if run["model"] == PROGRESS_SHAPE and "hookllm" in run["results"]]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    values = [run["results"]["hookllm"]["output_tok_s"] for run in runs]
    ax.plot(range(len(runs)), values, marker="o", label="hookllm")
    for i, value in enumerate(values):
        ax.annotate(f"{value:,.0f}", (i, value), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    limit_runs = [run for run in runs if "physical_limit_output_tok_s" in run]
    if limit_runs:
        ax.axhline(limit_runs[-1]["physical_limit_output_tok_s"], color="black", linestyle="--", label="decode limit")
        if "physical_limit_with_prefill_output_tok_s" in limit_runs[-1]:
            ax.axhline(limit_runs[-1]["physical_limit_with_prefill_output_tok_s"], color="black", linestyle=":",
                       label="limit with prefill")
    ax.set_xticks(range(len(runs)), [f"{run['commit']}\n{run['date'][:10]}" for run in runs], fontsize=7)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("output tok/s")
    ax.set_title(f"hookllm, workload A, {PROGRESS_SHAPE} shape: one point per run, in commit order")
    ax.legend(fontsize=8)
    return save(fig, out / "progress.png")


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=HERE / "results", metavar="DIR")
    parser.add_argument("--out", type=Path, default=HERE.parent / "docs" / "images", metavar="DIR")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = workload_a_runs(args.results)
    written = [plot_throughput(runs, args.out), plot_progress(runs, args.out)]
    profiles = load(args.results, "profile-*.json")
    if profiles:
        written.append(plot_step_breakdown(profiles[-1], args.out))
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
