"""tests/cost.py (pytest --cost): a test's CPU in its process and its subprocesses, and JAX's
compiles, as getrusage and jax.monitoring report them, summed by file."""

import subprocess
import sys

import cost
import jax
import jax.numpy as jnp
import numpy as np

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"


def test_a_tests_subprocesses_and_compiles_are_counted_and_summed_by_file(tmp_path):
    with cost.measured(str(tmp_path), "tests/test_a.py::test_one"):
        subprocess.run([sys.executable, "-c", BURN], check=True)
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7, dtype=jnp.int32)).block_until_ready()
    with cost.measured(str(tmp_path), "tests/test_b.py::test_two"):
        np.ones(10).sum()
    lines = cost.summary(str(tmp_path))
    assert lines[0].split() == "CPU s self children trace lower compile compiles (seconds)".split()
    total, one, two = lines[1].split(), lines[2].split(), lines[3].split()
    assert total[-3:] == ["all", "2", "tests"] and one[-1] == "tests/test_a.py"
    assert 0.3 <= float(one[2]) < 5 and float(two[2]) == 0  # the subprocess's CPU, its test's
    assert int(one[6]) >= 1 and int(two[6]) == 0  # the jitted program, compiled
    assert abs(float(total[0]) - float(one[0]) - float(two[0])) < 0.15  # each rounded to 0.1 s
    assert lines[4] == "the 15 costliest tests:" and lines[5].endswith("tests/test_a.py::test_one")
