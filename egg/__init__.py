"""The tools beside run.py: everything a training run needs that is not the algorithm. Each tool's
flags are a group of its own (a Flags dataclass), which run.Args gathers under the module's name.

    flags.py        what each flag allows (Facts), the command line's forms, the upstream preset
    files.py        files written whole or not at all; a folder owned by one run (a lock)
    corpus.py       training bytes: minipile, stdlib, files and folders, cached; the baselines
    tasks.py        the reward objective's tasks: prompts (built-in, files, datasets), rewards as
                    TRL's, the in-step scorers, worked examples to read
    checkpoints.py  checkpoint folders: written atomically, kept, read back and checked
    resume.py       which checkpoint a run continues, checked against what the run says it is
    cluster.py      devices, processes, memory and stop signals: the mesh, host copies, the CPU
                    split
    supervisor.py   a several-process run's launcher: a lost process said in one line, no orphan
    record.py       metrics.jsonl and Weights & Biases; a run's folders; what it says; asides that
                    fail
    diagnostics.py  the int8 activations' and parameters' health (--log_every, --debug)
    pbt.py          replicas' settings and population-based training: exploit and explore
    sampling.py     text drawn from a model's log2-probabilities, byte by byte
    command.py      the command line: flags as given, retired variants, the checks, how it ends
    kernel.py       the GPU product kernel (Pallas): it tiles the products run.py's arithmetic
                    defines; on Pallas's Triton backend, or (through it) Mosaic GPU's:
    mosaic.py       the products alone on Mosaic GPU: TMA-staged chunks, a wgmma group in flight
    autotune.py     --kernels auto: the fastest of the candidates computing the products, timed
                    on the device, kept by device kind, JAX version and shapes
    hlo.py          a compiled program's text read once: collectives, kernels and their cost

Nothing here imports run.py, and nothing here reads run.py's objects: each function takes plain
values or a small structure of its own module. The dependencies point from run.py (and the
scripts) to this package.
"""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""
