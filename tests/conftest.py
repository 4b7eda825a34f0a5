"""The tests target the CPU (one device, several of them as several virtual CPU devices) and write
only under scratch folders, removed at the end: the compilation cache they share (so that the many
runs of the same tiny configurations compile once, whichever test and process compiles first) and
the corpus cache (so that the standard library is concatenated once). A session fixture checks that
the repository is left as it was found. Under pytest-xdist (-n 2) the workers inherit the
compilation cache of the process that started them, which removes it at the end; each worker has its
own scratch folder for the rest and makes these checks itself. --cost FOLDER says where the time
goes (tests/cost.py)."""

import os
import shutil
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

SCRATCH = Path(tempfile.mkdtemp(prefix="egg-jax-tests-"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# one CPU device unless a test asks for more: run.py would otherwise split the CPU into one device
# per core (--cpu_devices), which test_cluster.py tests on its own
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
    ).strip()
# the tests' tiny programs spend more time compiling than running: LLVM's optimisations off (a
# third less time on the compile-bound tests) and XLA:CPU's older fusion code generator (a 16D-1L
# step compiles in 3.5-4.4 s, not 5.1-6.0); integer results do not depend on either (the pinned
# hashes).
# The second is XLA:CPU's alone, and gone from JAX 0.12's XLA: the CUDA plugin, and XLA from 0.12
# on, stop the process at a flag they do not know (scripts/gpu_check.py runs these tests with
# JAX_PLATFORMS=cuda)
OLD_FUSION = Version(metadata.version("jaxlib")) < Version("0.12")
os.environ["EGG_TEST_FAST_COMPILE"] = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false"
    if os.environ["JAX_PLATFORMS"] == "cpu" and OLD_FUSION
    else ""
)
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + os.environ["EGG_TEST_FAST_COMPILE"]
# a worker: its parent's
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(SCRATCH / "jax_cache"))
# every program, however fast it compiles (run.py's own threshold is 0.5 s): most of a tiny run's
# programs compile in less, and a second run of its configuration, here or in a subprocess, then
# reads them all from the cache (1.3-1.7 s a run in this process, not 2.0-2.5)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ["EGG_TEST_CORPORA"] = str(SCRATCH / "corpora")  # the tests' --dir_path

ROOT = Path(__file__).resolve().parent.parent


def repository_state() -> tuple[str, list[str]]:
    """What git sees as changed or untracked, and every file under runs/ and cached_files/."""
    status = ""
    if (ROOT / ".git").exists():
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout
    outputs = sorted(
        str(p) for folder in ("runs", "cached_files") for p in (ROOT / folder).rglob("*")
    )
    return status, outputs


@pytest.fixture(scope="session", autouse=True)
def repository_untouched():
    before = repository_state()
    yield
    assert repository_state() == before, "the tests wrote into the repository"


@pytest.fixture(autouse=True)
def programs_traced_afresh_around_a_patch(request):
    """run.py makes each jitted program once per configuration in a process (make_generation_step,
    make_reader, ...): a test that patches what those programs trace (run.matmul, kernel.product,
    a table's entry) gets its own, and leaves none traced with its patch behind."""
    patches = "monkeypatch" in request.fixturenames
    if patches:
        forget_programs()
    yield
    if patches:
        forget_programs()


def forget_programs():
    import run

    for made in vars(run).values():
        if hasattr(made, "cache_clear"):
            made.cache_clear()


def pytest_addoption(parser):
    parser.addoption(
        "--cost",
        metavar="FOLDER",
        help="each test's CPU seconds (its process's, its subprocesses') and JAX's tracing, "
        "lowering and compiling seconds, a JSON line a test under FOLDER, summed at the end "
        "(tests/cost.py)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = item.config.getoption("cost")
    if not folder:
        yield
        return
    import cost

    with cost.measured(folder, item.nodeid):
        yield


def pytest_terminal_summary(terminalreporter, config):
    if config.getoption("cost") and not hasattr(config, "workerinput"):  # the run's own process
        import cost

        for line in cost.summary(config.getoption("cost")):
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(SCRATCH, ignore_errors=True)
