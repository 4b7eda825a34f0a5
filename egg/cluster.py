"""Devices, processes and signals: the platform and the CPU split chosen before JAX starts, the
processes of a run joined, one mesh over every device, arrays between the host and the mesh, the
memory a program may use, and the stop signals every process must agree on."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import jax
import numpy as np
import tyro

from egg import UserError
from egg.flags import Facts, check_range, flag


@dataclass(frozen=True)
class Flags:
    platform: Annotated[
        Literal["", "cpu", "cuda", "rocm", "tpu"],
        Facts(carried=False),
        tyro.conf.arg(help_behavior_hint="(default: JAX's choice: its accelerator, else the CPU)"),
    ] = ""
    """JAX platform to run on"""
    coord_addr: Annotated[str, *flag(carried=False)] = ""
    """address:port of process 0's coordinator, for a multi-host run started by hand"""
    num_procs: Annotated[int, *flag("[1, inf)", carried=False)] = 1
    """number of processes of a multi-host run started by hand"""
    proc_id: Annotated[int, *flag("[0, inf)", carried=False)] = 0
    """index of this process in a multi-host run started by hand (below --num_procs)"""
    heartbeat_timeout: Annotated[int, *flag("[2, inf)")] = 30
    """several processes: seconds without a heartbeat after which a process counts as lost, and the
    others stop (exit code 75) with its name, the newest checkpoint and the command that resumes.
    Heartbeats come from a thread of JAX's own, so a process that is slow but alive (compiling,
    validating, saving) keeps sending them"""
    cpu_devices: Annotated[int, *flag("[0, inf)", why="0: one per core", carried=False)] = 0
    """on the CPU: the JAX devices this host is split into, each evaluating its share of the
    population on its own (0: one per core, fewer where the share would not hold whole groups; 1
    with --rank 0 or several processes; 1: one device, whose products XLA spreads over the
    cores). The CPU still counts as one device of --parallel_generations_per_gpu: the population,
    and every result, stay the same. Left at 1 when XLA_FLAGS or JAX_NUM_CPU_DEVICES set the device
    count (each device then counts as one)"""


# ------------------------------------------------------------------------------------------------
# The platform and the processes, set before JAX starts.


class QuietPluginErrors(logging.Filter):
    """Drops JAX's traceback of an accelerator plugin that cannot start on this machine (jax[cuda12]
    on a machine with no NVIDIA GPU logs ~10 lines of it, then uses the CPU): JAX's own choice of
    platform stands, without the noise. Kept where an NVIDIA device is present: there it tells why
    the GPU is not used. The last reason is kept for a --platform that cannot start."""

    seen: list[str] = []  # the reasons plugins gave, last last

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Jax plugin configuration error"):
            return True
        if record.exc_info and record.exc_info[1] is not None:
            QuietPluginErrors.seen.append(
                f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
            )
        return Path("/dev/nvidiactl").exists()


def select_platform(platform: str) -> None:
    """--platform if given (else JAX_PLATFORMS, else JAX's choice: its accelerator, the CPU when
    none is visible)."""
    if platform:
        jax.config.update("jax_platforms", platform)
    logging.getLogger("jax._src.xla_bridge").addFilter(QuietPluginErrors())


def enable_compilation_cache(dir_path: str) -> None:
    """Keep compiled programs in <dir_path>/jax_cache (unless JAX_COMPILATION_CACHE_DIR says
    otherwise), so a second run of the same configuration starts without compiling: those that
    took 0.5 s or more to compile (unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says
    otherwise)."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(Path(dir_path) / "jax_cache"))
    if not os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


CACHE_WRITE_FAILED = "Error writing persistent compilation cache entry"  # JAX's warning's start


@contextmanager
def compilation_cache_watched(log=print):
    """Within: JAX's warnings of compilation cache entries it could not write (a full disk, a
    quota) said once, in one line; the cache then left alone for the rest of the run (programs
    compile anew next time), and the entries JAX left empty removed."""
    previous, said, started = warnings.showwarning, [], time.time()

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if not text.startswith(CACHE_WRITE_FAILED):
            return previous(message, category, filename, lineno, file, line)
        # "... entry for 'NAME': OSError: [Errno 28] No space left on device": NAME's entries
        # written since the run started hold what JAX could write of this one, which is no entry
        folder = Path(jax.config.jax_compilation_cache_dir or ".")
        name = text.partition("'")[2].partition("'")[0]
        for entry in folder.glob(f"{name}-*-cache"):
            if entry.is_file() and entry.stat().st_mtime >= started:
                entry.unlink(missing_ok=True)
        if not said:
            said.append(text)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", math.inf)
            reason = text.rpartition("] ")[2] if "] " in text else text.rpartition(": ")[2]
            log(
                f"warning: cannot write the compilation cache in {folder} ({reason}): programs "
                "compile anew next time"
            )

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def prepare(
    hosts: Flags, platform: str, members: int, unit: int, full_rank: bool, cache: str
) -> int:
    """Before JAX starts: the platform (`platform`, else --platform, else JAX's choice), the CPU
    split (returned: --cpu_devices as used, split_cpu) for these members per device, which a
    device's share must hold in multiples of `unit`, and the compilation cache in the folder
    `cache`."""
    enable_compilation_cache(cache)
    platform = platform or hosts.platform
    select_platform(platform)
    check_range(Flags, "cpu_devices", hosts.cpu_devices)
    one = several_processes(hosts) or full_rank
    return split_cpu(hosts.cpu_devices, platform, members, unit, one)


def several_processes(hosts: Flags) -> bool:
    """Whether this process is one of several: given by hand, or a SLURM job of several tasks."""
    return (
        bool(hosts.coord_addr)
        or hosts.num_procs > 1
        or int(os.environ.get("SLURM_NTASKS", "1")) > 1
    )


def init_distributed(hosts: Flags) -> None:
    """Join a multi-process run: given by --coord_addr / --num_procs / --proc_id, or detected by
    jax.distributed itself (SLURM with several tasks, and the other clusters it knows). A process
    silent for --heartbeat_timeout seconds counts as lost, and JAX terminates every other one (the
    supervisor turns that into one line)."""
    if not several_processes(hosts):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # for CPU devices; else unused
    timeout = dict(heartbeat_timeout_seconds=hosts.heartbeat_timeout)
    if hosts.coord_addr or hosts.num_procs > 1:
        jax.distributed.initialize(hosts.coord_addr, hosts.num_procs, hosts.proc_id, **timeout)
    else:
        jax.distributed.initialize(**timeout)


def cpu_share_fits(members: int, unit: int, shards: int) -> bool:
    """Whether each of `shards` devices' share of the members per device is a whole number of units
    (the run's: whole pairs, groups and blocks of distinct noises)."""
    return members > 0 and unit > 0 and members % shards == 0 and (members // shards) % unit == 0


def split_cpu(given: int, platform: str, members: int, unit: int, one: bool) -> int:
    """The JAX devices the host's CPU is split into (--cpu_devices as used; 1: not split), set
    before JAX starts. XLA spreads each product of a single CPU device over the cores, which for
    this model's small int8 products costs more than it gains (docs/design.org, "Many devices and
    hosts"). Not split: on another platform; where XLA_FLAGS or JAX_NUM_CPU_DEVICES set the device
    count; with `one` (several processes, which must split alike, or full-rank noise, whose every
    device builds all of it) unless given. Once JAX runs in this process its CPU devices stay as
    the first call split them."""
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    forced = forced or "JAX_NUM_CPU_DEVICES" in os.environ
    if (platform or os.environ.get("JAX_PLATFORMS") or "cpu") != "cpu" or forced:
        if given > 1:
            where = (
                "XLA_FLAGS or JAX_NUM_CPU_DEVICES set the device count"
                if forced
                else "not on the CPU"
            )
            raise UserError(f"--cpu_devices {given}: {where}; leave --cpu_devices out")
        return 1
    if given and not cpu_share_fits(members, unit, given):
        raise UserError(
            f"--cpu_devices {given} must split --parallel_generations_per_gpu {members} into equal "
            f"shares, each a multiple of {unit} (whole groups of --group_size and of "
            "--num_perturbations)"
        )
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    fits = [s for s in range(1, cores + 1) if cpu_share_fits(members, unit, s)]
    shards = given or (1 if one else max(fits, default=1))
    try:
        jax.config.update("jax_num_cpu_devices", shards)
    except RuntimeError:  # JAX already runs in this process
        running = len(jax.devices("cpu"))
        if given and given != running:
            raise UserError(
                f"--cpu_devices {given}: JAX already runs on {running} CPU device(s)"
            ) from None
        shards = running
    return shards


# ------------------------------------------------------------------------------------------------
# The mesh and arrays on it.


def population_mesh(axis: str, devices=None) -> jax.sharding.Mesh:
    """A 1-D mesh named `axis` over every device of every process (or the given ones). The first
    call starts JAX's platform: one that cannot start (a --platform this machine lacks) is refused
    in one line."""
    if devices is None:
        try:
            devices = jax.devices()
        # JAX asserts where a plugin failed to start
        except (RuntimeError, AssertionError) as error:
            reason = (QuietPluginErrors.seen or [str(error) or "no device"])[-1].splitlines()[0]
            raise UserError(
                f"JAX cannot start platform {jax.config.jax_platforms}: {reason}"
            ) from None
    return jax.sharding.Mesh(np.array(devices), (axis,))


def global_array(x: np.ndarray, mesh, spec) -> jax.Array:
    """A host array, the same on every process, as a global array with the given sharding."""
    x = np.asarray(x)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def host_copy(x: jax.Array) -> np.ndarray:
    """The whole of a global array on the host (a collective if it spans processes)."""
    if x.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def local_copy(x: jax.Array, axis: int) -> np.ndarray:
    """This process's part of an array sharded over the population on `axis` (no communication)."""
    shards = sorted(x.addressable_shards, key=lambda shard: shard.index[axis].start or 0)
    return np.concatenate([np.asarray(shard.data) for shard in shards], axis=axis)


# ------------------------------------------------------------------------------------------------
# Memory.


def peak_rss() -> float:
    """This process's peak resident set size, GiB."""
    import resource  # POSIX only

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_memory() -> tuple[float, str]:
    """Peak device memory on an accelerator, else this process's peak RSS: (GiB, what)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30, "device memory"
    return peak_rss(), "RSS"


def host_memory_left() -> float:
    """Bytes the host can still give (MemAvailable of /proc/meminfo; infinite if unknown)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return math.inf
    return next(
        (int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")),
        math.inf,
    )


def memory_left(mesh) -> tuple[float, int]:
    """(bytes free, devices sharing them) for a compiled program's temporaries: on an accelerator
    one device's (its allocator's limit less what it holds), on the CPU the host's for all of
    them."""
    stats = mesh.local_devices[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), 1
    return host_memory_left(), len(mesh.local_devices)


def check_memory(mesh, temporaries: float, population: int, unit: int) -> None:
    """Refuse a compiled step whose temporaries (MiB a device) exceed the memory left (memory_left)
    before it first runs, naming about the largest --parallel_generations_per_gpu, a multiple of
    `unit`, that fits with a tenth of what is left to spare: temporaries grow with the population
    nearly in proportion."""
    left, sharing = memory_left(mesh)
    need = temporaries * 2**20 * sharing
    if need <= left:
        return
    fits = int(population * 0.9 * left / need) // unit * unit
    advice = (
        f"--parallel_generations_per_gpu {fits} or less"
        if fits
        else "a smaller model (no population fits)"
    )
    where = "the host" if mesh.devices.flat[0].platform == "cpu" else "a device"
    raise UserError(
        f"population {population}: the generation step needs {need / 2**30:.1f} GiB of "
        f"temporaries, more than the {left / 2**30:.1f} GiB free on {where}; use {advice}"
    )


# ------------------------------------------------------------------------------------------------
# Stop signals.


EXIT_STOPPED = 128  # a run a stop signal ended exits 128 + its number: 130 (SIGINT), 143 (SIGTERM)
SUPERVISED = "EGG_JAX_SUPERVISED"  # the supervisor's PID, in the environment of the process it runs
ECHO_SECONDS = 2.0  # a supervised child's same signal again within this is an echo (StopSignal)


class Stopped(BaseException):
    """A stop signal ended the run where it had nothing to save (`where` says when: main says it in
    one line and exits EXIT_STOPPED + the signal's number)."""

    def __init__(self, signum: int, where: str = ""):
        super().__init__(signum, where)
        self.signum, self.where = signum, where

    def say(self) -> int:
        """Say it in one line; the exit code."""
        print(f"stopped by {signal.Signals(self.signum).name} {self.where}", file=sys.stderr)
        return EXIT_STOPPED + self.signum


EARLY: list[int] = []  # stop signals received before a StopSignal took them (early_stops)


@contextmanager
def early_stops():
    """SIGINT and SIGTERM from the command line's start until a run's StopSignal takes them: each
    raises Stopped at once (nothing is saved yet) and is recorded, so that one whose exception is
    lost still stops the run: raised while Python runs a garbage-collection callback (JAX has
    one), an exception is dropped, and the run would go on. The StopSignal entered next starts
    with it received. While entered, Python's report of such a dropped Stopped (a traceback,
    "Exception ignored in ...") is not printed: the stop it carried is recorded where it was
    raised, and the run ends in its one line all the same."""

    def handle(signum, frame):
        EARLY.append(signum)
        raise Stopped(signum, "before the run started: nothing saved")

    def unraisable(report):  # Python's hook for an exception it cannot raise
        if not isinstance(report.exc_value, Stopped):
            hook(report)

    EARLY.clear()
    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield
    finally:
        EARLY.clear()  # its signals were this span's: a StopSignal made after it has received none
        sys.unraisablehook = hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class StopSignal:
    """SIGINT and SIGTERM, while entered: a request to stop, which the loop honours after the
    generation in flight, saving it first. Compiling, a generation, a validation or a checkpoint is
    never interrupted (an exception inside JAX's compiler can crash the process). Only within
    interruptible(), where nothing can be left half-done, does a signal raise Stopped at once. A
    second signal ends the process at once, by that signal. `alone`: the run has this process alone
    (processes of a run of several stop together, after a generation: stop_requested). In a
    supervisor's child the same signal again within ECHO_SECONDS is the first's echo, not a second:
    a terminal's Ctrl-C or SLURM's signal reaches the child itself and through its supervisor."""

    def __init__(self, alone: bool = True):
        self.received = EARLY[-1] if EARLY else None  # one whose exception was lost (early_stops)
        self.previous, self.raising, self.alone = {}, False, alone
        self.echoes, self.at = SUPERVISED in os.environ, 0.0

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous.setdefault(sig, signal.signal(sig, self.handle))
        return self

    def again(self) -> None:
        """Take the signals back once the processes have joined: jax.distributed installs a SIGTERM
        handler of its own (its preemption notifier)."""
        self.__enter__()

    def handle(self, signum, frame):
        name, echo = signal.Signals(signum).name, time.monotonic() - self.at < ECHO_SECONDS
        if self.received is not None and self.echoes and signum == self.received and echo:
            return
        if self.received is not None:  # the second: at once, as the signal itself would
            os.write(2, f"\n{name} again: stopping at once\n".encode())
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received, self.at = signum, time.monotonic()
        if self.raising:
            raise Stopped(signum)
        os.write(2, f"\n{name}: stopping safely, what ran saved ({name} again: at once)\n".encode())

    @contextmanager
    def interruptible(self, where: str):
        """Within: a signal raises Stopped at once (reading data: nothing of the run's own is
        written), in a run of this process alone."""
        self.raising = self.alone
        try:
            self.check(where)
            yield
        except Stopped as stopped:
            raise Stopped(stopped.signum, where) from None
        finally:
            self.raising = False

    def check(self, where: str) -> None:
        """Raise Stopped if a signal came, in a run of this process alone; `where` says when."""
        if self.received is not None and self.alone:
            raise Stopped(self.received, where)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def stopped_code(stop: StopSignal) -> int:
    """The exit code of a run stopped by a signal: this process's, or SIGTERM's where another
    process of the run received it."""
    return EXIT_STOPPED + (stop.received or signal.SIGTERM)


def ignore_stop_signals() -> None:
    """As the process exits, its run ended: a stop signal would only interrupt JAX's exit
    handlers."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def stop_requested(stop: StopSignal) -> bool:
    """Whether any process received a stop signal: all processes must stop at the same generation
    (a one-byte gather, only in multi-process runs: a sync point)."""
    if jax.process_count() == 1:
        return stop.received is not None
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([stop.received is not None], np.int8))
    return bool(np.max(flags))


REFUSAL_BYTES = 1024  # the longest refusal a process shares with the others (UTF-8, cut there)


@contextmanager
def refused_together(kind: type = UserError):
    """Within: this process's refusal (a UserError, or the `kind` given) is held to the block's end,
    where every process of the run learns every one's (a gather of REFUSAL_BYTES each: a sync
    point) and raises the first as a `kind`: a run one process refuses (process 0 alone owns the
    folders) ends in the same line, exit 2, on every process, within seconds; a reward that fails
    on one process's completions, alike. A run of one process: its refusal, as it comes."""
    refusal = None
    try:
        yield
    except kind as error:
        if jax.process_count() == 1:
            raise
        refusal = error
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    said = str(refusal).encode()[: REFUSAL_BYTES - 1] if refusal is not None else b""
    mine = np.zeros(REFUSAL_BYTES, np.uint8)
    mine[: len(said)] = np.frombuffer(said, np.uint8)
    for row in np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, REFUSAL_BYTES):
        text = bytes(row).rstrip(b"\0").decode(errors="replace")
        if text:
            raise kind(text)


@contextmanager
def awaiting_jax_verdict(heartbeat_timeout: int, own: tuple = (UserError,)):
    """In a run of several processes, an error inside a generation is most often a collective whose
    peer died (gloo: "connection reset by peer"): before raising it, wait for JAX to name the lost
    process, which it does by terminating this one within the heartbeat timeout (the supervisor
    reports it). An error that JAX does not follow up is raised as it was; one of the kinds `own`
    (the run's own: every process raises it together) at once."""
    try:
        yield
    except own:
        raise
    except Exception:
        if jax.process_count() > 1:
            time.sleep(heartbeat_timeout + 10)
        raise
