"""The command line (egg/flags.py): upstream's flag names (--fast_fitness for --shaping among them),
the --algorithm upstream preset, --help, every flag's range or choices in its Facts, variants
tried and not adopted refused, and the forms W&B sweep agents pass."""

import dataclasses
import math

import pytest
import yaml
from helpers import ROOT

import run
from egg import command, flags


def test_upstream_flag_names_parse():
    args = run.parse_args(
        [
            "--parallel_generations_per_gpu",
            "64",
            "--num_epochs",
            "3",
            "--alpha",
            "0.5",
            "--sigma_shift",
            "3",
            "--no-use_clt",
            "--no-fast_fitness",
            "--alpha_decay_timestep",
            "7",
            "--n_layer",
            "2",
            "--n_embd",
            "16",
            "--noise_reuse",
            "0",
            "--tokens_per_update",
            "9",
            "--num_perturbations",
            "8",
            "--group_size",
            "4",
            "--validate_every",
            "2",
            "--validation_batch_size",
            "8",
            "--seed",
            "5",
            "--rank",
            "2",
            "--data",
            "x",
            "--valid_data",
            "y",
        ]
    )
    assert (args.use_clt, args.noise_reuse, args.rank) == (False, 0, 2)
    assert (args.corpus.data, args.corpus.valid_data, args.parallel_generations_per_gpu) == (
        "x",
        "y",
        64,
    )


def test_algorithm_upstream_sets_upstreams_values_of_flags_not_given():
    ours = run.parse_args([])
    preset = flags.upstream_preset(run.Args)
    assert set(preset) == {"alpha_floor", "sigma_shift", "segments", "optimizer", "shaping"} | {
        "shared_pair_state",
        "init_std",
        "max_step",
        "residual_shift",
    }
    changed = {k for k, v in preset.items() if flags.value(ours, k) != v}
    assert changed == set(preset)  # each entry is a default that differs
    upstream = run.parse_args(["--algorithm", "upstream"])
    assert {k: flags.value(upstream, k) for k in preset} == preset
    assert (
        flags.replace(upstream, algorithm="egg", **{k: flags.value(ours, k) for k in changed})
        == ours
    )
    for given in (["--use_clt"], ["--use-clt=True"], ["--use_clt", "true"]):
        assert run.parse_args(["--algorithm", "upstream", *given]).use_clt is True, given
    # runs apart: the name records upstream's sigma_shift and the preset
    assert (
        run.default_run_name(upstream)
        == run.default_run_name(dataclasses.replace(ours, sigma_shift=4)) + "-upstream"
    )
    both = run.parse_args(
        ["--algorithm", "upstream", "--no-fast_fitness", "--optimizer", "momentum"]
    )
    assert (both.shaping, both.optimizer, both.sigma_shift) == ("normalised", "momentum", 4)


def test_help_spells_flags_with_underscores_and_both_spellings_parse(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in (
        "--num_epochs",
        "--parallel_generations_per_gpu",
        "--no_use_clt",
        "--valid_data PATH",
    ):
        assert flag in text, flag
    assert "--num-epochs" not in text and "{None}" not in text
    (line,) = [x for x in text.splitlines() if "--valid_data PATH" in x]
    assert (
        "a separate validation file or folder (default: minipile's validation split, else" in line
    )
    assert "--shaping STR" in text and "--optimizer STR" in text
    hints = {
        name: next(
            m.help_behavior_hint for m in hint.__metadata__ if hasattr(m, "help_behavior_hint")
        )
        for name, (_, hint) in flags.hints_of(run.Args).items()
        if name in ("shaping", "optimizer")
    }
    assert hints["shaping"]("normalised") == (
        "(default: normalised; one of: sign, normalised, standardised; upstream: sign; "
        "--fast_fitness: sign, --no-fast_fitness: normalised)"
    )
    assert (
        hints["optimizer"]("momentum")
        == "(default: momentum; one of: ztest, momentum; upstream: ztest)"
    )
    dashes = run.parse_args(
        ["--num-epochs", "5", "--no-use-clt", "--parallel-generations-per-gpu=8"]
    )
    underscores = run.parse_args(
        ["--num_epochs", "5", "--no-use_clt", "--parallel_generations_per_gpu=8"]
    )
    assert dashes == underscores and (dashes.num_epochs, dashes.use_clt) == (5, False)


def outside(end: float, is_open: bool, step: int, kind: type):
    """A value just outside one end of a range: the end itself if it is excluded, else one step
    (an int flag) or half a unit (a float flag) beyond it."""
    return kind(end) if is_open else kind(end + step * (1 if kind is int else 0.5))


def range_cases() -> list[tuple[list[str], str]]:
    """For every flag with a range (its Facts in run.py): a value just outside each finite end,
    and the refusal that names the flag, its range and the value."""
    cases, defaults = [], run.Args()
    for name, facts in flags.facts_of(run.Args).items():
        kind = type(flags.value(defaults, name))
        for end, is_open, step in ((facts.low, facts.open[0], -1), (facts.high, facts.open[1], 1)):
            if math.isfinite(end):
                value = outside(end, is_open, step, kind)
                why = f" ({facts.why})" if facts.why else ""
                cases.append(
                    (
                        [f"--{name}", str(value)],
                        f"--{name} must be {facts.allowed()}{why}, got {value}",
                    )
                )
    return cases


def test_the_ranges_cover_the_flags_whose_values_are_bounded():
    """Every int or float flag that has a bound has it in its Facts (one place), and the cases
    above reach both kinds of end."""
    ranged = {name for name, facts in flags.facts_of(run.Args).items() if facts.ranged()}
    unbounded = {"presence_penalty", "sample_replica"}  # any value means something
    numbers = {
        name
        for name in flags.hints_of(run.Args)
        if type(flags.value(run.Args(), name)) in (int, float)
    }
    assert numbers - ranged == unbounded
    messages = [message for _, message in range_cases()]
    assert any("positive" in m for m in messages) and any("in (0, 0.5)" in m for m in messages)


def agent_command(sweep: dict, values: dict) -> list[str]:
    """The command line a W&B agent runs for one configuration, built with wandb's own code."""
    from wandb.sdk.launch.sweeps import utils

    variables = utils.create_sweep_command_args(
        {"args": {k: {"value": v} for k, v in values.items()}}
    )
    variables.update(env=[], interpreter=[], program=[])
    command = []
    for chunk in utils.create_sweep_command(list(sweep["command"])):
        command += variables[chunk[2:-1]] if chunk.startswith("${") else [chunk]
    return command


def grid(sweep: dict) -> list[dict]:
    """Every point of a sweep's grid: {parameter: value}."""
    points = [{}]
    for name, spec in sweep["parameters"].items():
        points = [{**p, name: v} for p in points for v in spec.get("values", [spec.get("value")])]
    return points


@pytest.mark.parametrize("file", ["sweep.yaml", "sweep_upstream.yaml"])
def test_every_sweep_point_reaches_the_script_as_a_valid_configuration(file):
    sweep = yaml.safe_load((ROOT / file).read_text())
    fields = set(flags.hints_of(run.Args))
    names = fields | set(flags.aliases(run.Args))  # upstream's sweep names --fast_fitness
    assert set(sweep["parameters"]) <= names, set(sweep["parameters"]) - names
    for point in grid(sweep):
        args = run.parse_args(agent_command(sweep, point))
        run.check_args(args)
        assert (
            args.record.track is True
            and args.parallel_generations_per_gpu == point["parallel_generations_per_gpu"]
        )
        if point.get("algorithm") == "upstream":  # upstream's algorithm, as the file says
            assert all(
                flags.value(args, k) == v for k, v in flags.upstream_preset(run.Args).items()
            )
        else:  # egg-jax's defaults for every flag the file does not set
            defaults = run.Args()
            assert all(
                flags.value(args, k) == flags.value(defaults, k) for k in fields - set(point)
            )


def test_sweep_booleans_reach_the_script():
    sweep = yaml.safe_load((ROOT / "sweep_upstream.yaml").read_text())
    values = {k: v.get("value", v.get("values", [None])[0]) for k, v in sweep["parameters"].items()}
    values.update(use_clt=False, fast_fitness=False)
    command = agent_command(sweep, values)
    args = run.parse_args(command)
    print("agent command:", " ".join(command))
    assert args.use_clt is False and args.shaping == "normalised"
    # the upstream macro drops false booleans, so the defaults (True) would silently win
    upstream = agent_command(dict(sweep, command=["${args_no_boolean_flags}"]), values)
    assert run.parse_args(upstream).use_clt is True


@pytest.mark.parametrize(
    "argv, clt, fast, track",
    [
        (["--use_clt=False", "--fast_fitness=true"], False, True, False),
        (["--use_clt", "False", "--track", "--fast_fitness", "True"], False, True, True),
        (["--no-use_clt", "--no-fast_fitness", "--track=True"], False, False, True),
        (["--use-clt", "--fast-fitness=False"], True, False, False),
        (["--fast_fitness", "--track"], True, True, True),
        (["--shaping", "sign", "--no_use_clt"], False, True, False),
    ],
)
def test_boolean_forms(argv, clt, fast, track):
    """Booleans in every form, and nano-egg's --fast_fitness in each: --shaping sign, or (False)
    normalised."""
    args = run.parse_args(argv)
    shaping = "sign" if fast else "normalised"
    assert (args.use_clt, args.shaping, args.record.track) == (clt, shaping, track)


def test_boolean_with_a_bad_value_is_refused():
    with pytest.raises(run.UserError, match="True or False"):
        run.parse_args(["--use_clt=maybe"])
    with pytest.raises(run.UserError, match="--fast_fitness takes True or False"):
        run.parse_args(["--fast_fitness=maybe"])


def test_a_choice_outside_its_table_is_refused_naming_the_entries():
    """--model, --shaping and --optimizer take an entry of MODELS, SHAPINGS and RULES, listed in
    --help and in the refusal; a variant tried and not adopted is refused naming the last commit
    that has it."""
    with pytest.raises(
        run.UserError, match="--model must be one of egg, mingru, transformer, got gpt"
    ):
        run.check_args(run.parse_args(["--model", "gpt"]))
    with pytest.raises(
        run.UserError, match="--shaping must be one of sign, normalised, standardised, got rank"
    ):
        run.check_args(run.parse_args(["--shaping", "rank"]))
    with pytest.raises(run.UserError, match="--optimizer must be one of ztest, momentum, got sgd"):
        run.check_args(run.parse_args(["--optimizer", "sgd"]))
    for argv in (
        ["--optimizer", "adam"],
        ["--mlp_relu"],
        ["--no-mlp_relu"],
        ["--scale_shift", "3"],
    ):
        with pytest.raises(
            run.UserError, match=f"tried and not adopted .* after commit {command.RETIRED_AFTER}"
        ):
            run.parse_args(argv)
