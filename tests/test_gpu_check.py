"""scripts/gpu_check.py's CPU part: the same training compared bit for bit, a device trace read
kernel by kernel, and one profiled generation beside the cost model."""

import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest
from helpers import ROOT, cli, run_here, tiny_args

import bench
import run
from egg import hlo, kernel

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


@pytest.fixture
def trains_in_this_process():
    """gpu_check's run.py commands run in this process (the CPU's, as the platform they name):
    without a new interpreter's start-up and the tracing this one has done. Patched by hand, not by
    monkeypatch, which would have run.py's programs traced afresh (conftest.py): nothing they trace
    changes."""
    run_py = gpu_check.run_py

    def run_here_on(*flags, platform, script="run.py"):
        assert script == "run.py" and platform == "cpu", (script, platform)
        done = run_here("--platform", platform, *flags)
        return subprocess.CompletedProcess(flags, done.returncode, done.stdout, done.stderr)

    gpu_check.run_py = run_here_on
    yield
    gpu_check.run_py = run_py


def test_the_same_training_on_two_platforms_is_compared_by_its_checkpoints(
    tmp_path, trains_in_this_process
):
    device, device_xla, reference = gpu_check.same_training("cpu", tmp_path, generations=4)
    assert device == device_xla == reference and len(device) == 16
    assert {p.name for p in tmp_path.glob("runs-*")} == {
        "runs-device",
        "runs-device-xla",
        "runs-reference",
    }


def test_kernel_times_sum_the_device_events_of_a_perfetto_trace(tmp_path):
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "PjitFunction(step)", "dur": 900.0},
        {"ph": "X", "pid": 2, "name": "gemm_fusion_dot_47", "dur": 12.5},
        {"ph": "X", "pid": 2, "name": "gemm_fusion_dot_47", "dur": 7.5},
        {"ph": "X", "pid": 2, "name": "loop_convert_fusion_1", "dur": 3.0},
        {"ph": "X", "pid": 2, "name": "int8_product", "dur": 4.0},  # the kernel's two variants
        {"ph": "X", "pid": 2, "name": "int8_product__1", "dur": 6.0},
    ]
    with gzip.open(tmp_path / "t.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    times = gpu_check.kernel_times(tmp_path / "t.json.gz")
    assert times == {"gemm_fusion_dot_47": 20.0, "loop_convert_fusion_1": 3.0, "int8_product": 10.0}
    modeled = {"gemm_fusion_dot_47": 15.0, "loop_convert_fusion_1": 1.0, "int8_product": 8.0}
    lines = gpu_check.compare_kernels(times, modeled)
    assert lines[1].split() == ["gemm_fusion_dot_47", "20.0", "15.0"]
    assert lines[2].split() == ["int8_product", "10.0", "8.0"]
    assert lines[-1].split()[-2:] == ["33.0", "24.0"]


def test_each_variant_of_the_step_is_timed_beside_the_model_and_one_generation_profiled(tmp_path):
    """(c) on the CPU: a row a variant with its numbers (the kernel's tiles as they were and as
    they are, in Pallas's interpreter; XLA's products without command buffers, an option the CPU
    ignores), then the profiled generation's table (a CPU has no device events: its total only)."""
    chosen = [
        "kernel, tiles before, graphs",
        "kernel, tiles now, graphs",
        "XLA's products, no graphs",
    ]
    variants = {name: gpu_check.VARIANTS[name] for name in chosen}
    (config,) = gpu_check.QUICK_CONFIGURATIONS
    lines = gpu_check.step_variants(config, tmp_path, gpu_check.Clock(600), 0.05, variants)
    rows = {line[:36].strip(): line[36:].split() for line in lines[2:5]}
    assert list(rows) == chosen
    for compile_seconds, ms, _tokens, modeled, graphs, alone in rows.values():
        assert float(compile_seconds) > 0 and float(ms) > 0 and float(modeled) > 0
        assert graphs == "?" and int(alone.replace(",", "")) > 0  # no thunks dumped on a CPU
    # the tiles as they were: fewer, larger programs (the interpreter's loops count them)
    assert int(rows[chosen[0]][-1].replace(",", "")) < int(rows[chosen[1]][-1].replace(",", ""))
    assert lines[5] == "-- kernel, tiles now, graphs: one generation, kernel by kernel"
    assert lines[-1].split()[:3] == ["all", "kernels", "0.0"]
    assert list(tmp_path.glob("trace-0/**/perfetto_trace.json.gz"))


def test_each_candidate_of_kernels_auto_is_timed_with_its_macs_and_then_auto_chooses():
    """(p) on the CPU: a row for each of run.PRODUCT_CANDIDATES (the kernel's in Pallas's
    interpreter) with its ms and int8 MACs, then --kernels auto's own line and its time."""
    (config,) = gpu_check.QUICK_CONFIGURATIONS
    lines = gpu_check.product_candidates(config, gpu_check.Clock(600), 0.0)
    assert lines[0].startswith(f"== (p) {config.name}: --kernels auto's candidates, each timed ")
    count = len(run.PRODUCT_CANDIDATES)
    rows = {line[:36].strip(): line[36:].split() for line in lines[2 : 2 + count]}
    assert list(rows) == list(run.PRODUCT_CANDIDATES)
    assert all(float(ms) > 0 for ms, *_ in rows.values())
    assert int(rows["XLA's products"][1].replace(",", "")) > 0  # its GEMMs' MACs, counted
    chose = lines[2 + count]
    assert re.match(r"--kernels auto: products: (.*), the fastest at this run's shapes", chose)
    assert re.fullmatch(r"--kernels auto chose in [0-9.]+ s", lines[-1])


def test_each_model_is_timed_with_the_kernels_and_with_xlas_products(tmp_path):
    """(m) on the CPU, for the transformer: its step with the product kernel (in the interpreter)
    and with XLA's products, each a row with its numbers."""
    (config,) = gpu_check.QUICK_CONFIGURATIONS
    clock = gpu_check.Clock(600)
    lines = gpu_check.models_steps(config, tmp_path, clock, 0.05, ["transformer"])
    assert (
        lines[0]
        == f"== (c) {config.name}, --model transformer: the generation step compiled 2 ways"
    )
    rows = {line[:36].strip(): line[36:].split() for line in lines[2:4]}
    assert list(rows) == [gpu_check.PROFILED, "XLA's products, graphs"]
    assert all(float(ms) > 0 for _, ms, *_ in rows.values())


FAKE_NANO_EGG = """
import argparse, os
import numpy as np
parser = argparse.ArgumentParser()
for name in ("num_epochs", "validate_every", "parallel_generations_per_gpu", "tokens_per_update"):
    parser.add_argument("--" + name, type=int)
given, _ = parser.parse_known_args()
cached = os.path.join(os.path.dirname(os.path.realpath(__file__)), "cached_files")
assert np.load(os.path.join(cached, "minipile_train.npy")).size > 0
rate = given.parallel_generations_per_gpu * given.tokens_per_update / 0.5
for epoch in range(given.num_epochs):
    if epoch % given.validate_every == given.validate_every - 1:
        print("validation score", 5.25, "validation throughput is", 1.0, "validation time is", 1.0)
    if epoch % 10 == 0:
        print(f"\tgenerate time: 0.4; update time: 0.1; throughput: {rate}")
"""


def test_nano_egg_and_egg_jax_run_on_the_same_bytes_and_flags_side_by_side(tmp_path):
    """(a) with a stand-in for nano-egg's run.py (a clone of a repository holding it): both sides
    run on the corpus made here with the same flags, each row its numbers, then the ratios."""
    clone = tmp_path / "nano-egg"
    clone.mkdir()
    (clone / "run.py").write_text(FAKE_NANO_EGG)
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "run.py"], ["commit", "-q", "-m", "run.py"]):
        subprocess.run([*git, *command], check=True)
    args = gpu_check.Args(platform="cpu", nano_egg=str(clone), quick=True)
    lines = gpu_check.beside_nano_egg(args, tmp_path, gpu_check.Clock(600))
    (config,) = gpu_check.QUICK_CONFIGURATIONS
    assert lines[0].startswith(f"== (a) {config.name}: {' '.join(config.flags)} --seed 0;")
    nano, ours = lines[2].split(), lines[3].split()
    assert nano[:2] == ["nano-egg", "1,024"] and nano[3:5] == ["-", "5.2500"]  # 64 x 8 / 0.5 s
    assert ours[0] == "egg-jax" and 0 < float(ours[4]) < 8
    assert lines[4].startswith("egg-jax / nano-egg: ") and "x the tokens/s, " in lines[4]
    train, valid = (tmp_path / f"side-{split}.bin" for split in ("train", "valid"))
    assert valid.stat().st_size == gpu_check.VALID_BYTES >> 4 and train.stat().st_size > 0


def test_without_nano_egg_only_egg_jax_runs(tmp_path):
    """(a) without --nano_egg: egg-jax's row alone. The script as a GPU machine runs it: from
    elsewhere, with no PYTHONPATH to find the project."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    flags = ("--platform", "cpu", "--quick", "--parts", "a", "--out", str(tmp_path))
    result = cli(*flags, cwd=tmp_path, env=env, script="scripts/gpu_check.py")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert re.search(r"^egg-jax +[\d,]+ ", out, re.M) and "nano-egg" not in out.split("== (a)")[1]


def test_the_full_rank_part_compares_the_bits_of_the_platform_and_the_cpu(
    tmp_path, capsys, trains_in_this_process
):
    """(d): full rank on the platform and on the CPU, the same checkpoint's digest on both."""
    args = gpu_check.Args(platform="cpu", parts=("d",), quick=True, out=str(tmp_path))
    assert gpu_check.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\(d\) --rank 0 \(full rank\): .*, identical$", out, re.M)


def test_the_models_product_kernels_go_by_the_name_a_trace_gives_them():
    args = tiny_args("--n_embd", "32", "--parallel_generations_per_gpu", "64")
    mesh = bench.target_mesh("h100", 1)
    cfg = run.mesh_config(args, mesh)
    with bench.without_compilation_cache():
        traced = run.make_generation_step(cfg, mesh).trace(*bench.abstract_inputs(args, cfg, mesh))
        text = traced.lower().compile().as_text()
    costs = bench.pallas_costs(traced.jaxpr)
    modeled = gpu_check.modeled_times(text, costs)
    kernels = [k for k in hlo.gpu_kernels(text, costs) if k.kind == "pallas"]
    assert kernels and all(k.bytes and k.macs for k in kernels)  # each costed as it declares
    calls = sum(k.runs for k in kernels)  # one entry for all of them, its calls summed
    assert modeled["int8_product"] > calls * bench.ROOFLINES["h100"].launch * 1e6 * 0.99
    # none under its HLO name
    assert not [name for name in modeled if name.startswith("pallas_call")]
    # with graphs: the kernels' times and the graphs' launches, once, sum to the whole program's
    found = hlo.gpu_kernels(text, costs)
    launched = hlo.Launches(7, frozenset(k.name for k in found[::2]), {})
    modeled = gpu_check.modeled_times(text, costs, launched)
    whole = hlo.modeled_seconds(found, bench.ROOFLINES["h100"], launched) * 1e6
    assert abs(sum(modeled.values()) - whole) < 1e-6 * whole
    assert modeled[gpu_check.GRAPH_LAUNCHES] == 7 * bench.ROOFLINES["h100"].launch * 1e6


def test_the_compiled_kernel_is_compared_with_its_interpreter_case_by_case():
    shapes = ((32, 16, 16),)  # no residual (16 outputs from 32 inputs): noise x gain, 4 cases
    assert gpu_check.kernel_against_interpreter("cpu", shapes=shapes) == [
        "the product kernel on cpu against its interpreter: 4 cases, all equal"
    ]
    calls = []

    # every second call (the compiled side) is off by one
    def faulty(*operands, interpret):
        calls.append(interpret)
        options = dict(interpret=True, arithmetic=run.ARITHMETIC)
        out = kernel.product(*operands, **options)
        return out ^ 1 if len(calls) % 2 == 0 else out

    lines = gpu_check.kernel_against_interpreter("cpu", faulty, shapes)
    assert len(calls) == 8 and lines[-1].endswith("4 cases, 4 DIFFER")
    assert lines[0] == (
        "  n 32, m 16, 16 pairs, noise 0, gain 0, residual 0: 256 of 256 outputs differ, by up to 1"
    )


def test_xla_int8_products_are_compared_with_numpy_shape_by_shape():
    shapes = ((1, 16, 16, 2), (4, 32, 16, 2), (4, 32, 32, 8))
    assert gpu_check.xla_dots_against_numpy("cpu", shapes=shapes) == [
        "XLA's int8 products on cpu against numpy: 3 shapes, all equal"
    ]

    def faulty(w, x):  # 16-deep products summed twice, as Triton's were in the product kernel
        out = jnp.einsum(
            "pmk,pkn->pmn",
            w,
            jnp.clip(x, -127, 127).astype(jnp.int8),
            preferred_element_type=jnp.int32,
        )
        return out * 2 if w.shape[-1] == 16 else out

    lines = gpu_check.xla_dots_against_numpy("cpu", faulty, shapes)
    assert lines[-1] == "XLA's int8 products on cpu against numpy: 3 shapes, 2 DIFFER"
    assert lines[0].startswith("  1 x (16, 16) x (16, 2): 32 of 32 outputs differ, by up to ")
    assert lines[1].startswith("  4 x (32, 16) x (16, 2): ")


def test_upstream_gets_stand_ins_for_the_imports_it_does_not_use_where_they_are_missing(
    tmp_path, monkeypatch
):
    """A GPU image without wandb: upstream imports a stand-in that refuses to be used; datasets,
    installed here, is left as it is."""
    side_by_side = sys.modules["side_by_side"]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name)
    )
    env = side_by_side.upstream_environment(tmp_path)
    assert sorted(p.name for p in (tmp_path / "stand-ins").iterdir()) == ["wandb.py"]
    used = subprocess.run(
        [sys.executable, "-c", "import wandb; wandb.init(project='x')"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert used.returncode == 1 and "no wandb here" in used.stderr
    assert env["WANDB_MODE"] == "disabled" and env["HF_HUB_OFFLINE"] == "1"


def test_the_tile_sweep_times_every_product_of_a_generation_with_each_tile(monkeypatch):
    """(t) on the CPU (the kernel in Pallas's interpreter): the step's products read as it is
    traced, a generation making each block's five (the gates' pair, U_f, U_h, W_1, W_2) a layer
    and the head once a byte; a row a distinct product with the rule's tile and the best measured
    of those allowed (two here), and the generation's totals."""
    (config,) = gpu_check.QUICK_CONFIGURATIONS
    cfg, calls = gpu_check.product_calls(list(config.flags))
    assert sum(calls.values()) == (5 * cfg.n_layer + 1) * cfg.tokens
    monkeypatch.setattr(
        kernel, "tile_options", lambda distinct, m, widest=128: [(16, 16), (16, 32)]
    )
    lines = gpu_check.tile_sweep(config, gpu_check.Clock(600), 0.0, warps=(4,))
    rows = lines[2:-1]
    assert len(rows) == len(calls) and all(" 16x16, 4 " in row for row in rows)
    rule, best = re.match(
        r"a generation's products: ([\d.]+) ms .*, ([\d.]+) ms", lines[-1]
    ).groups()
    assert float(best) <= float(rule)
