"""Many devices and many processes: bit-identical parameters and validation, fitness-only traffic,
no floating point in the sharded programs, one process's stop signal stopping them all."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import ROOT, TINY, checkpoint_digest, devices_env, run_here

from egg import supervisor

# the tiny run, its population given per layout, validated on 6 rows: padded to 8 on 4 devices
COMMON = [*TINY, "--validation_batch_size", "6"]
# The defaults exercise the global mean |difference| (normalised fitness), --optimizer momentum's
# replicated int16 state and --shared_pair_state; --num_perturbations 8 makes the 4 devices'
# members share noise.
SHARED_NOISE = ["--num_perturbations", "8"]


def launch(devices, flags, runs):
    """run.py on `devices` virtual CPU devices, or (None) as users start it, with no device count
    set from outside: it then splits the CPU itself (--cpu_devices). In a session of its own, so
    that a process of several (a supervisor and its child) can be killed as a node is lost."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *COMMON, "--runs_dir", str(runs), *flags],
        env=devices_env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


class RunHere:
    """run.py on this process's one device (conftest.py's), run to its end here, without an
    interpreter's start-up, and read as a process that has ended: for the layout of one device,
    started after the others so that it runs beside them."""

    def __init__(self, flags, runs):
        self.returncode, self.out, self.err = run_here(*COMMON, "--runs_dir", str(runs), *flags)

    def communicate(self, timeout=None):
        return self.out, self.err


def wait(*procs, code=0):
    """Every process's output, once all have ended well (exit `code`)."""
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=400)
        assert proc.returncode == code, err[-3000:]
        outs.append(out)
    return outs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(flags, runs, members: int = 16):
    """2 processes x 2 devices x `members` (population 64 by default), on 127.0.0.1."""
    hosts = ["--coord_addr", f"127.0.0.1:{free_port()}", "--num_procs", "2", "--proc_id"]
    each = ["--parallel_generations_per_gpu", str(members)]
    return [launch(2, [*flags, *each, *hosts, str(i)], runs) for i in (0, 1)]


def digest(runs, generation: int) -> str:
    """checkpoint_digest of a run's checkpoint (with the default --optimizer momentum's sums)."""
    (final,) = runs.glob(f"*/checkpoints/gen-{generation:08d}")
    return checkpoint_digest(final)


def records(runs):
    (path,) = runs.glob("*/metrics.jsonl")  # only process 0 writes
    lines = path.read_text().splitlines(True)
    # a line being written is skipped
    return [json.loads(line) for line in lines if line.endswith("\n")]


def validations(runs, metric: str = "bits_per_byte") -> tuple:
    """A run's validations in its records: ((generation, bits per byte, or its metric), ...)."""
    name = f"val/{metric}"
    return tuple((r["generation"], r[name]) for r in records(runs) if name in r)


def test_a_window_models_states_spread_with_the_members_on_one_device_and_two_processes(tmp_path):
    """The transformer, whose states are the keys and values it carries, with --segments 2: each
    device evaluates its members' slice of every segment's noise (4 devices in one process, the
    sharded program of the 2 processes without them, are not run)."""
    model = ["--model", "transformer", "--head_width", "4"]
    flags = [*SHARED_NOISE, "--segments", "2", "--num_epochs", "3", "--validate_every", "2", *model]
    procs = {"two": two_processes(flags, tmp_path / "two")}  # started first, to run beside "one"
    procs["one"] = [RunHere([*flags, "--parallel_generations_per_gpu", "64"], tmp_path / "one")]
    outs = {layout: wait(*group)[0] for layout, group in procs.items()}
    assert (
        "population 64 on 1 cpu device(s) in 1 process(es), 2 segment(s) a member (64 pairs"
        in outs["one"]
    )
    assert "population 64 on 4 cpu device(s) in 2 process(es)" in outs["two"]
    assert len({digest(tmp_path / layout, 3) for layout in procs}) == 1
    assert len({validations(tmp_path / layout) for layout in procs}) == 1
    assert len(validations(tmp_path / "one")) == 2


def test_a_reward_run_is_the_same_on_one_device_four_and_two_processes(tmp_path):
    """The reward objective scored on the host (each process scores its own members' completions:
    only their fitness crosses) at a temperature (each pair's draws its own, wherever it runs): 1
    device, 4 devices and 2 processes x 2 devices give the same parameters and validations."""
    reward = ["--objective", "reward", "--task", "addition", "--reward", "egg.tasks:match_reward"]
    reward += ["--completion_bytes", "3", "--completion_temperature", "1"]
    flags = [*reward, "--shaping", "standardised", "--num_epochs", "3", "--validate_every", "2"]
    procs = {"two": two_processes(flags, tmp_path / "two")}  # started first, to run beside "one"
    procs["four"] = [launch(4, [*flags, "--parallel_generations_per_gpu", "16"], tmp_path / "four")]
    procs["one"] = [RunHere([*flags, "--parallel_generations_per_gpu", "64"], tmp_path / "one")]
    outs = {layout: wait(*group)[0] for layout, group in procs.items()}
    assert "population 64 on 4 cpu device(s) in 2 process(es)" in outs["two"]
    assert "scored on the host" in outs["one"]
    assert len({digest(tmp_path / layout, 3) for layout in procs}) == 1
    found = {validations(tmp_path / layout, "reward") for layout in procs}
    assert len(found) == 1 and len(next(iter(found))) == 2


FAILS_ON_ONE = """
import jax

CALLS = []


def flaky(prompts, completions, answer, **kwargs):
    CALLS.append(len(prompts))
    if jax.process_index() == 1 and len(CALLS) == 2:
        raise ValueError("process 1's second call")
    return [float(c == a) for c, a in zip(completions, answer)]
"""


def test_a_reward_failing_on_one_process_stops_every_process_in_the_same_line(tmp_path):
    """Process 1's reward raises at generation 2: both processes end with exit 65 and the same
    line, which names it; the newest checkpoint (generation 1) stays whole."""
    reward = tmp_path / "flaky.py"
    reward.write_text(FAILS_ON_ONE)
    flags = ["--objective", "reward", "--task", "addition", "--reward", f"{reward}:flaky"]
    flags += ["--completion_bytes", "3", "--num_epochs", "3", "--save_every", "1"]
    procs = two_processes(flags, tmp_path / "two")
    said = []
    for proc in procs:
        _, err = proc.communicate(timeout=400)
        assert proc.returncode == 65, err[-3000:]
        said.append(err.strip().splitlines()[-1])
    assert said[0] == said[1] and "(ValueError: process 1's second call)" in said[0], said
    (folder,) = (tmp_path / "two").glob("*/checkpoints")
    assert sorted(p.name for p in folder.glob("gen-*")) == ["gen-00000001"]


def test_a_cpu_split_into_devices_trains_the_same_population_bit_for_bit(tmp_path):
    """Each device evaluates its slice of every pair's noise (--num_perturbations: repeated
    ones)."""
    flags = [
        *SHARED_NOISE,
        "--num_epochs",
        "3",
        "--validate_every",
        "2",
        "--parallel_generations_per_gpu",
        "64",
    ]
    procs = {
        "four": [launch(None, [*flags, "--cpu_devices", "4"], tmp_path / "four")],
        "auto": [launch(None, flags, tmp_path / "auto")],
    }
    procs["one"] = [RunHere(flags, tmp_path / "one")]
    outs = {layout: wait(*group)[0] for layout, group in procs.items()}
    assert "population 64 on 1 cpu device(s) in 1 process(es)" in outs["one"]
    assert (
        "population 64 on 4 cpu device(s) (one CPU split into 4) in 1 process(es)" in outs["four"]
    )
    # the default: one device per core, as many as split 64 members into groups of 4 and blocks of 8
    cores = len(os.sched_getaffinity(0))
    auto = max(s for s in (1, 2, 4, 8) if s <= cores)
    split = f" (one CPU split into {auto})" if auto > 1 else ""
    assert f"population 64 on {auto} cpu device(s){split} in 1 process(es)" in outs["auto"]
    assert len({digest(tmp_path / layout, 3) for layout in procs}) == 1
    validation = {validations(tmp_path / layout) for layout in procs}
    assert len(validation) == 1 and len(next(iter(validation))) == 2
    # a split that leaves a device part of a group is refused with one line, before anything runs
    _, bad = launch(None, [*flags, "--cpu_devices", "3"], tmp_path / "bad").communicate(timeout=400)
    lines = bad.strip().splitlines()
    assert (
        len(lines) == 1
        and "--cpu_devices 3 must split --parallel_generations_per_gpu 64" in lines[0]
    )
    assert not (tmp_path / "bad").exists()


def test_a_signal_to_one_process_stops_all_after_the_same_generation_and_resumes_exactly(tmp_path):
    """2 processes x 2 devices with --segments 2 (each device evaluates its members' slice of every
    segment's noise; --num_perturbations 8: the devices' members share noise), one process stopped
    by a signal after a few generations, then resumed for two more: its parameters and validations
    are those of 1 device and of 4 devices in one process that ran as many generations at once."""
    flags = [*SHARED_NOISE, "--segments", "2", "--validate_every", "2", "--save_every", "0"]
    procs = two_processes([*flags, "--num_epochs", "100000"], tmp_path / "two")
    deadline = time.time() + 240
    while not (
        list((tmp_path / "two").glob("*/metrics.jsonl")) and len(records(tmp_path / "two")) >= 3
    ):
        assert time.time() < deadline, "no third record within 240 s"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)  # the process that neither logs nor writes
    outs = wait(*procs, code=128 + signal.SIGTERM)  # stopped, to be resumed: both say so
    stopped = [line for out in outs for line in out.splitlines() if "stopped by signal" in line]
    generation = int(stopped[0].split("after generation ")[1].split(":")[0])
    assert [s.split(" stopped")[1] for s in stopped] == [stopped[0].split(" stopped")[1]] * 2
    assert sorted(s.split(" stopped")[0] for s in stopped) == ["process 0", "process 1"]
    assert records(tmp_path / "two")[-1]["generation"] == generation
    # process 0, which received no signal, does not claim the run ended at --num_epochs
    assert not [out for out in outs if "after 100000 generations" in out]
    longer = [*flags, "--num_epochs", str(generation + 2)]
    resumed = two_processes([*longer, "--resume", "auto"], tmp_path / "two")
    four = launch(4, [*longer, "--parallel_generations_per_gpu", "16"], tmp_path / "four")
    one = RunHere([*longer, "--parallel_generations_per_gpu", "64"], tmp_path / "one")
    outs = dict(zip(("two", "four", "one"), wait(resumed[0], four, one), strict=True))
    wait(resumed[1])
    assert "resuming from" in outs["two"] and f"at generation {generation}" in outs["two"]
    assert "population 64 on 4 cpu device(s) in 2 process(es)" in outs["two"]
    assert "population 64 on 4 cpu device(s) in 1 process(es)" in outs["four"]
    assert (
        "population 64 on 1 cpu device(s) in 1 process(es), 2 segment(s) a member (64 pairs"
        in outs["one"]
    )
    assert len({digest(tmp_path / layout, generation + 2) for layout in outs}) == 1
    found = {layout: validations(tmp_path / layout) for layout in outs}
    print(found)
    # every second generation's and the last's
    every = sorted({*range(2, generation + 3, 2), generation + 2})
    assert len(set(found.values())) == 1 and [g for g, _ in found["one"]] == every


SHARDED = """
import jax, numpy as np, run
from egg import cluster, flags, hlo
args = flags.replace(run.Args(), n_embd=8, n_layer=1, parallel_generations_per_gpu=256,
                     group_size=4, tokens_per_update=8, shaping="sign" if {fast} else "normalised")
mesh = cluster.population_mesh(run.POP)
cfg = run.make_config(args, mesh.size)
params, rule_state, states = jax.eval_shape(lambda: run.init_run(cfg, run.replicas_of(args)))
batch = jax.ShapeDtypeStruct((cfg.population // 4, 9), np.uint8)
inputs = run.replica_inputs(cfg, run.replicas_of(args), 0)
step = run.make_generation_step(cfg, mesh).lower(
    params, rule_state, states, batch, np.int32(0), *inputs
)
evaluate = run.make_evaluate(cfg, mesh).lower(params, jax.ShapeDtypeStruct((8, 17), np.uint8))
programs = {{"step": step.compile().as_text(), "evaluate": evaluate.compile().as_text()}}
for name, text in programs.items():
    print("floats", name, [t for t in ("f16", "bf16", "f32", "f64") if t in text])
for op, size in hlo.collective_traffic(programs["step"]):
    print(op, size)
print("segments", cfg.segments)
print("params", run.num_parameters(cfg))
"""


def test_only_fitness_crosses_devices_and_the_sharded_programs_have_no_float():
    env = devices_env(4)
    procs = {
        fast: subprocess.Popen(
            [sys.executable, "-c", SHARDED.format(fast=fast)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for fast in (True, False)
    }
    for fast, proc in procs.items():
        (out,) = wait(proc)
        lines = [
            line.split(maxsplit=2) if line.startswith("floats") else line.split()
            for line in out.strip().splitlines()
        ]
        params = int(lines.pop()[1])
        segments = int(lines.pop()[1])
        floats = [line for line in lines if line[0] == "floats"]
        assert floats == [["floats", "step", "[]"], ["floats", "evaluate", "[]"]], floats
        collectives = [(line[0], int(line[1])) for line in lines if line[0] != "floats"]
        print("fast" if fast else "normalised", collectives, "parameters", params)
        gathers = [size for op, size in collectives if op == "all-gather"]
        # an int8 score per pair and segment, 1024 members
        assert segments == 8 and gathers == [512 * segments]
        others = [(op, size) for op, size in collectives if op != "all-gather"]
        # the two int32 sums of the exact mean |difference| (XLA may combine them into one)
        assert {op for op, _ in others} <= {"all-reduce"} and sum(
            size for _, size in others
        ) == 12 * (not fast)
        assert max(size for _, size in collectives) < params


def alive(pid: int) -> bool:
    """Whether a process exists and is no zombie (a killed child whose parent died may stay one
    where PID 1 reaps nobody)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return found


# another run's claim on a folder (egg/files.py's, as run.py takes it), held until its stdin closes
OWNER = (
    "import sys; from pathlib import Path; from egg import files; "
    "held = files.own(Path(sys.argv[1]), 'runs', '--run_name'); print('owned', flush=True); "
    "sys.stdin.read()"
)


def test_a_refusal_of_one_process_is_every_processs_in_the_same_line(tmp_path):
    """Process 0 alone owns the run's folders: with them owned by another run (its claim held by a
    process that does nothing else: test_faults.py refuses a second run beside a training one),
    both processes of a run of two end with exit 2 and the same one line, within seconds of each
    other."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path / "r")],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout.readline() == "owned\n"
    procs = two_processes(["--run_name", "r", "--num_epochs", "2"], tmp_path)
    ended = []
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        ended.append((proc.returncode, err.strip().splitlines()[-1:], time.time()))
    owner.communicate(timeout=30)  # its stdin closed: it ends, and its claim with it
    refusal = f"error: {tmp_path / 'r'} is in use by another run (host "
    assert [code for code, _, _ in ended] == [2, 2], ended
    assert ended[0][1] == ended[1][1] and ended[0][1][0].startswith(refusal), ended
    assert abs(ended[0][2] - ended[1][2]) < 10


def test_the_supervisor_passes_a_childs_stderr_through_as_it_comes_but_a_fatal_jax_account():
    """A JAX error about the coordinator that is not fatal is passed on in its place once the child
    shows it goes on (a progress bar's update); JAX's account of a lost process, cut into a
    progress bar's line and running to the child's end, is held for the supervisor's one line."""
    jax_error = "E1126 10:00:00.000000   12 coordination_service_agent.cc:42] coordinator: slow"
    fatal = [
        jax_error,
        "The tasks have crashed.",
        "F1126 10:00:01.000000   12 client.h:80] " + supervisor.JAX_TERMINATES,
        "*** Check failure stack trace: ***",
        "    @     0x7f37f9040634  absl::LogMessage::SendToLog()",
    ]
    said = ["first line\n", jax_error + "\n", "\r 50%|bar|\n", "second line\n", "\r 60%|bar|"]
    said += ["\n".join(fatal) + "\n"]
    script = f"import sys; sys.stderr.write({''.join(said)!r})"
    relay = (
        "import subprocess, sys; from egg import supervisor; "
        f"child = subprocess.Popen([sys.executable, '-c', {script!r}], stderr=subprocess.PIPE); "
        "held = supervisor.relay_stderr(child); child.wait(); print(held)"
    )
    done = subprocess.run([sys.executable, "-c", relay], cwd=ROOT, capture_output=True)
    shown = ["first line", jax_error, "\r 50%|bar|", "second line", "\r 60%|bar|"]
    assert done.stderr.decode().split("\n") == [*shown, ""], done.stderr
    assert done.stdout.decode().strip() == repr(fatal)


def test_a_fatal_jax_account_is_held_to_the_childs_end_however_slowly_it_dies():
    """Once JAX says it terminates the child, the account is held though the child is silent for
    longer than HOLD_SECONDS (a loaded machine) and its training thread updates the progress bar
    before JAX ends it: the supervisor then says it in one line, not the raw log."""
    fatal = [
        "E1126 10:00:00.000000   12 coordination_service_agent.cc:42] heartbeat timeout",
        "F1126 10:00:01.000000   12 client.h:80] " + supervisor.JAX_TERMINATES,
    ]
    script = (
        "import sys, time; w = sys.stderr.write; w('first line\\n'); "
        f"w({chr(10).join(fatal) + chr(10)!r}); sys.stderr.flush(); time.sleep(1); "
        "w('\\r 70%|bar|'); sys.stderr.flush(); time.sleep(1); w('@ 0x7f3 abort()\\n')"
    )
    relay = (
        "import subprocess, sys; from egg import supervisor; supervisor.HOLD_SECONDS = 0.2; "
        f"child = subprocess.Popen([sys.executable, '-c', {script!r}], stderr=subprocess.PIPE); "
        "held = supervisor.relay_stderr(child); child.wait(); print(held)"
    )
    done = subprocess.run([sys.executable, "-c", relay], cwd=ROOT, capture_output=True)
    assert done.stderr.decode() == "first line\n", done.stderr
    assert done.stdout.decode().strip() == repr([*fatal, "\r 70%|bar|@ 0x7f3 abort()"])


def test_a_lost_process_ends_the_others_in_one_line_and_the_run_resumes_on_another_layout(tmp_path):
    """2 processes x 2 devices, --heartbeat_timeout 5: process 1's launcher (its supervisor) alone
    is SIGKILLed once a checkpoint of generation 8 exists, as a scheduler or a user kills the PID it
    started. Its child, which trains, must die with it at once (no orphan holding a device).
    Process 0 must end within the timeout and a few seconds, exit 75, and say in one line which
    process was lost, the newest complete checkpoint and the command that resumes; no C++ stack
    trace, no Python traceback. The run then continues from that checkpoint as 1 process on 1
    device, and ends bit-identical to one never interrupted, run on 1 device from the start."""
    flags = [
        "--run_name",
        "r",
        "--save_every",
        "4",
        "--heartbeat_timeout",
        "5",
        "--num_epochs",
        "100000",
    ]
    procs = two_processes(flags, tmp_path / "lost")
    checkpoints = tmp_path / "lost" / "r" / "checkpoints"
    deadline = time.time() + 240
    while not (checkpoints / "gen-00000008").exists():
        assert time.time() < deadline and procs[0].poll() is None, (
            "no checkpoint of generation 8 in 240 s"
        )
        time.sleep(0.05)
    (child,) = children_of(procs[1].pid)
    os.kill(procs[1].pid, signal.SIGKILL)
    lost_at = time.time()
    while alive(child):
        assert time.time() < lost_at + 5, "the launcher's child outlived it"
        time.sleep(0.05)
    _, err = procs[0].communicate(timeout=120)
    seconds = time.time() - lost_at
    procs[1].communicate(timeout=30)
    saved = sorted(p.name for p in checkpoints.glob("gen-*"))
    (line,) = [x for x in err.splitlines() if "error:" in x]
    print(
        f"process 0 ended {seconds:.1f} s after process 1 was killed, "
        f"exit {procs[0].returncode}: {line}"
    )
    assert procs[0].returncode == 75 and seconds < 5 + 10
    assert "Check failure" not in err and "Traceback" not in err and err.rstrip().endswith(line)
    assert line.startswith("error: process 1 stopped answering (JAX ended this one at ")
    assert (
        f"the newest complete checkpoint is {checkpoints / saved[-1]}; resume with: python run.py "
        in line
    )
    assert (
        line.endswith(f"--resume {checkpoints.parent}")
        and (tmp_path / "lost" / "r" / "process-0-lost.log").exists()
    )
    newest = int(saved[-1].split("-")[1])
    longer = ["--run_name", "r", "--num_epochs", str(newest + 4), "--parallel_generations_per_gpu"]
    resumed = RunHere([*longer, "64", "--resume", "auto"], tmp_path / "lost")
    reference = RunHere([*longer, "64"], tmp_path / "reference")  # the same program, compiled
    out = wait(resumed, reference)[0]
    assert f"resuming from {checkpoints / saved[-1]} at generation {newest}" in out
    assert "population 64 on 1 cpu device(s) in 1 process(es)" in out
    hashes = [digest(tmp_path / layout, newest + 4) for layout in ("lost", "reference")]
    print(f"resumed on 1 device {hashes[0]}, never interrupted on 1 device {hashes[1]}")
    assert hashes[0] == hashes[1]


SLOW_BUT_ALIVE = """
import ctypes, sys, numpy as np, jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), heartbeat_timeout_seconds=2)
from jax.experimental import multihost_utils
multihost_utils.process_allgather(np.array([1]))
if jax.process_index() == 1:  # the interpreter held for over three timeouts: C's sleep called
    ctypes.PyDLL(None).sleep(7)  # through PyDLL, which keeps the GIL (and spends no CPU)
print(int(multihost_utils.process_allgather(np.array([jax.process_index()])).sum()))
"""


def test_a_process_busy_in_python_is_not_taken_for_lost():
    """JAX's heartbeats come from a thread of its own: a process that holds the interpreter for
    7 s (as a long validation or compilation may) is not taken for lost at a 2 s timeout."""
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SLOW_BUT_ALIVE, address, str(i)],
            env=devices_env(1),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    assert [out.strip().splitlines()[-1] for out in wait(*procs)] == ["1", "1"]


def test_the_lost_process_is_named_from_jaxs_log():
    on_the_coordinator = (
        "E1125 coordination_service.cc:1520] ... UNAVAILABLE: Task 2 heartbeat timeout. This"
    )
    elsewhere = (
        "The following tasks are unhealthy (stopped sending heartbeats):\n3\n"
        "The tasks have crashed."
    )
    assert supervisor.lost_processes(on_the_coordinator) == "process 2"
    assert supervisor.lost_processes(elsewhere + "\n" + elsewhere) == "process 3"
    assert (
        supervisor.lost_processes("Failed to reach the coordination service")
        == "process 0, the coordinator,"
    )
