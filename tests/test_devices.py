"""Many devices and many processes: bit-identical parameters, fitness-only traffic."""

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--data", "stdlib", "--dir_path", str(ROOT / "cached_files")] + (
    "--n_embd 8 --n_layer 2 --group_size 4 --tokens_per_update 8 --validation_batch_size 8 "
    "--validation_tokens 16 --num_epochs 3 --alpha 0.3 --no-fast_fitness"
).split()


def launch(devices, flags, runs):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *COMMON, "--runs_dir", str(runs), *flags],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait(*procs):
    """The first process's output, once all have ended well."""
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err[-3000:]
        outs.append(out)
    return outs[0]


def digest(runs: Path) -> str:
    (final,) = runs.glob("*/checkpoints/gen-00000003")
    h = hashlib.sha256()
    for name in ("params.npz", "states.npz"):
        with np.load(final / name) as f:
            for key in sorted(f.files):
                assert f[key].dtype == np.int8
                h.update(f[key].tobytes())
    return h.hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_device_four_devices_and_two_processes_agree_bit_for_bit(tmp_path):
    """Total population 64 in each case; --no-fast_fitness also exercises the global mean."""
    one = launch(1, ["--parallel_generations_per_gpu", "64"], tmp_path / "one")
    out = wait(one)
    four = launch(4, ["--parallel_generations_per_gpu", "16"], tmp_path / "four")
    out4 = wait(four)
    address = f"127.0.0.1:{free_port()}"
    hosts = [
        launch(
            2,
            [
                "--parallel_generations_per_gpu",
                "16",
                "--coord_addr",
                address,
                "--num_procs",
                "2",
                "--proc_id",
                str(i),
            ],
            tmp_path / "two",
        )
        for i in range(2)
    ]
    out2 = wait(*hosts)
    assert "population 64 on 1 cpu device(s) in 1 process(es)" in out
    assert "population 64 on 4 cpu device(s) in 1 process(es)" in out4
    assert "population 64 on 4 cpu device(s) in 2 process(es)" in out2
    hashes = {name: digest(tmp_path / name) for name in ("one", "four", "two")}
    print(hashes)
    assert len(set(hashes.values())) == 1
    assert len(list((tmp_path / "two").glob("*/metrics.jsonl"))) == 1  # only process 0 writes


TRAFFIC = """
import jax, numpy as np, run
args = run.Args(n_embd=8, n_layer=1, parallel_generations_per_gpu=256, group_size=4, fast_fitness={fast})
mesh = run.population_mesh()
cfg = run.make_config(args, mesh.size)
params = jax.eval_shape(lambda: run.init_params(cfg))
states = jax.ShapeDtypeStruct((cfg.population, 1, 8), np.int8)
batch = jax.ShapeDtypeStruct((cfg.population // 4, 9), np.uint8)
step = run.make_generation_step(cfg, mesh).lower(params, states, batch, np.int32(0), np.zeros(2, np.int32))
for op, size in run.collective_traffic(step.compile().as_text()):
    print(op, size)
print("params", run.num_parameters(cfg))
"""


def test_only_fitness_crosses_devices():
    for fast in (True, False):
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
        result = subprocess.run(
            [sys.executable, "-c", TRAFFIC.format(fast=fast)],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [line.split() for line in result.stdout.strip().splitlines()]
        params = int(lines.pop()[1])
        collectives = [(op, int(size)) for op, size in lines]
        print("fast" if fast else "normalised", collectives, "parameters", params)
        gathers = [size for op, size in collectives if op == "all-gather"]
        assert gathers == [512]  # one int8 score per pair of the population of 1024
        others = [size for op, size in collectives if op != "all-gather"]
        assert others == ([] if fast else [4, 4])  # the global max and sum of |differences|
        assert max(size for _, size in collectives) < params
