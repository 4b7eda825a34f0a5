"""scripts/gpu_check.py's CPU part: the same training compared bit for bit, a device trace read
kernel by kernel, and one profiled generation beside the cost model."""

import gzip
import importlib.util
import json
import sys

import jax.numpy as jnp
from helpers import ROOT, tiny_args

import bench
import run
from egg import hlo, kernel

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_the_same_training_on_two_platforms_is_compared_by_its_checkpoints(tmp_path):
    device, device_xla, reference = gpu_check.same_training("cpu", tmp_path)
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


def test_one_generation_is_profiled_beside_the_cost_model_of_its_kernels(tmp_path):
    flags = "--n_embd 8 --n_layer 1 --parallel_generations_per_gpu 16 --group_size 4".split()
    measured, modeled = gpu_check.profile_generation(flags, "cpu", tmp_path)
    assert list(tmp_path.glob("trace-0/**/perfetto_trace.json.gz"))
    assert measured == {}  # a CPU has no device events; a GPU's kernels are listed by name
    assert modeled and all(us > 0 for us in modeled.values())


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


def test_the_compiled_kernel_is_compared_with_its_interpreter_case_by_case():
    shapes = ((32, 16, 16),)  # no residual (16 outputs from 32 inputs): noise x gain, 4 cases
    assert gpu_check.kernel_against_interpreter("cpu", shapes=shapes) == [
        "the product kernel on cpu against its interpreter: 4 cases, all equal"
    ]
    calls = []

    # every second call (the compiled side) is off by one
    def faulty(*operands, x_layered, interpret):
        calls.append(interpret)
        options = dict(x_layered=x_layered, interpret=True, arithmetic=run.ARITHMETIC)
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
