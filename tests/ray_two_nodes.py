"""A real two-node Ray cluster on this machine, a sweep on it, and one of its workers killed mid-sweep.

    unshare -n python tests/ray_two_nodes.py STORE          (run by tests/test_sweep.py)

Run inside a network namespace of its own (``unshare -n``) holding only the loopback interface, so every
Ray address is 127.0.0.1 and no traffic leaves it (Ray otherwise advertises the machine's outward
address). Starts a head node and a worker node with Ray's own commands (``ray start --head``, ``ray start
--address``: separate raylets and object stores, one CPU each), connects as a driver, and sweeps the
shipped 2-layer model over the stdlib corpus with the Ray engine (the settings of ``test_sweep.SETTINGS``)
into ``STORE``. After the second shard is kept it kills one ``ShardWorker`` actor's process (SIGKILL):
the sweep either finishes (Ray restarts the actor and retries its shard) or stops with the engine's
"run the same sweep again" error, and then runs again to resume. Prints one JSON line: the nodes seen,
the killed pid, and how the first run ended. Stops both nodes (their process groups) however it ends.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6391
START_S = 300  # Ray's start on a loaded 2-core machine has taken ~50 s (README, "Ray")


def start(*args: str) -> subprocess.Popen:
    """``ray start ARGS --block`` in a process group of its own (its node's processes are its children)."""
    return subprocess.Popen([RAY, "start", *args, "--num-cpus=1", "--disable-usage-stats", "--block"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})


def wait_for(what: str, ready, nodes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_S
    while not ready():
        for node in nodes:
            if node.poll() is not None:
                raise SystemExit(f"{what}: a ray start exited ({node.returncode}): {node.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not ready after {START_S} s")
        time.sleep(1)


def stop(nodes: list[subprocess.Popen]) -> None:
    for node in reversed(nodes):
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(node.pid, sig)
            except ProcessLookupError:
                break
            try:
                node.wait(grace)
                break
            except subprocess.TimeoutExpired:
                continue


def alive_nodes(ray) -> int:
    return sum(n["Alive"] for n in ray.nodes())


def main(store: str) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    os.environ["RAY_AUTH_MODE"] = "disabled"  # one machine, loopback only
    import ray

    import pycircuits_widgets as pcw

    nodes = [start("--head", f"--port={PORT}", "--include-dashboard=false")]
    try:
        def head_up() -> bool:
            try:
                return subprocess.run([RAY, "status", f"--address=127.0.0.1:{PORT}"], capture_output=True,
                                      timeout=60).returncode == 0
            except subprocess.TimeoutExpired:
                return False

        wait_for("the head node", head_up, nodes)
        nodes.append(start(f"--address=127.0.0.1:{PORT}"))
        ray.init(address=f"127.0.0.1:{PORT}", logging_level="warning")
        wait_for("the worker node", lambda: alive_nodes(ray) == 2, nodes)
        seen = [(n["NodeManagerAddress"], n["Resources"].get("CPU")) for n in ray.nodes() if n["Alive"]]

        killed = []

        def kill_a_worker(progress):
            if progress.shards_done == 2 and not killed:
                pids = subprocess.run(["pgrep", "-f", "ray::ShardWorker"], capture_output=True, text=True).stdout.split()
                killed.append(int(pids[0]))
                os.kill(killed[0], signal.SIGKILL)

        torch.set_num_threads(1)
        model, corpus = pcw.load_pretrained("attn-only-2l"), pcw.Corpus.python_stdlib()
        settings = {"seq_len": 32, "k": 20, "max_windows": 2000, "batch_size": 50, "shard_windows": 250, "engine": "ray", "workers": 2}
        try:
            pcw.sweep(model, corpus, store, progress=kill_a_worker, **settings)
            first = "finished"
        except RuntimeError as err:
            if "run the same sweep again" not in str(err):
                raise
            first = f"failed: {err}"
            pcw.sweep(model, corpus, store, progress=False, **settings)
        print(json.dumps({"nodes": seen, "killed": killed, "first_run": first}))
    finally:
        ray.shutdown()
        stop(nodes)


if __name__ == "__main__":
    main(sys.argv[1])
