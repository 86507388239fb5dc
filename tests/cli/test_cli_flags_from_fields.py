"""The command-line flags of RunConfig fields are generated from the fields: one description each."""

import argparse
import dataclasses

import pytest

from ditattn.entrypoints import flags
from ditattn.entrypoints.cli import build_parser
from ditattn.runconfig import SECTIONS, RunConfig

# compare's own flags ("comparison" group: --prompt -> prompts, --seed -> seeds, its --output-path and --fps with
# their meaning there) are written by hand
HAND_WRITTEN_GROUP = "comparison"


def _subparsers():
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _field_flag_actions():
    keys = RunConfig.keys()
    for name, sp in _subparsers().items():
        own = {id(a) for g in sp._action_groups if g.title == HAND_WRITTEN_GROUP for a in g._group_actions}
        for action in sp._actions:
            if keys.get(action.dest) is None or id(action) in own:
                continue
            yield name, action


def test_every_field_flag_takes_its_help_from_the_field():
    seen = set()
    for name, action in _field_flag_actions():
        if action.option_strings == ["--no-save-output"]:  # the negation of --save-output
            continue
        if action.option_strings:  # a positional (backends NAME) has none
            expected = flags.FLAG_NAMES.get(action.dest, "--" + action.dest.replace("_", "-"))
            assert action.option_strings == [expected], (name, action.option_strings)
        assert action.help == flags.field_help(action.dest), f"{name} --{action.dest}: help is not the field's"
        seen.add(action.dest)
    # the generated flags cover the sections the commands read
    for section in ("model", "sampling", "attention", "parallel", "output", "server", "simulation"):
        missing = {f.name for f in dataclasses.fields(SECTIONS[section])} - seen
        assert not missing, f"{section} fields without a flag: {sorted(missing)}"


def test_a_command_lists_only_flags_it_accepts():
    """A command's --help lists no flag whose setting the command then refuses ("does not apply here"):
    calibrate-cache runs in one process and has no parallelism flags."""
    from ditattn.entrypoints.cli import COMMANDS

    keys = RunConfig.keys()
    for cmd in COMMANDS:
        accepted = RunConfig.keys(cmd.accept)
        listed = {a.dest for a in _subparsers()[cmd.name]._actions if a.option_strings and a.dest in keys}
        assert not listed - set(accepted), (cmd.name, sorted(listed - set(accepted)))


def test_field_help_is_the_field_metadata_with_the_default():
    assert flags.field_help("vae_tiling").endswith("(default false)")
    assert flags.field_help("port").endswith("(default 30000)")
    f = next(f for f in dataclasses.fields(SECTIONS["model"]) if f.name == "device")
    assert flags.field_help("device") == f.metadata["help"]


@pytest.mark.parametrize(
    "argv,key,value",
    [
        (["--vae-tiling"], "vae_tiling", True),
        (["--vae-tiling", "false"], "vae_tiling", False),
        (["--local-files-only"], "local_files_only", True),
        (["--enable-torch-compile", "true"], "enable_torch_compile", True),
        (["--no-save-output"], "save_output", False),
        (
            ["--lora-path", "a.safetensors", "--lora-path", "transformer_2=b.safetensors:0.5"],
            "lora_path",
            ["a.safetensors", "transformer_2=b.safetensors:0.5"],
        ),
        (["--dtype", "bfloat16"], "dtype", "bfloat16"),
        (["--num-inference-steps", "3"], "num_inference_steps", 3),
    ],
)
def test_converted_flags_parse_as_before(argv, key, value):
    ns = build_parser().parse_args(["generate", *argv])
    assert getattr(ns, key) == value


@pytest.mark.parametrize(
    "argv", [["--dtype", "float64"], ["--offload", "all"], ["--num-inference-steps", "0"], ["--vae-tiling", "maybe"]]
)
def test_bad_values_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", *argv])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_attention_backend_help_says_what_happens(capsys):
    """The help calls --attention-backend strict for the DiT and names the platform substitutions; on the
    CPU (no FlashAttention kernel) fa runs torch_sdpa as a recorded substitution, a backend the CPU cannot
    run and the platform does not substitute is refused, and a sparse backend leaves cross-attention to a
    dense one."""
    import json

    from ditattn.cli import main

    text = flags.field_help("attention_backend")
    assert "strict" in text and "fa runs torch_sdpa" in text and "cross-attention" in text
    plan = ["plan", "--model-path", "ditattn:tiny-wan", "--device", "cpu", "--json"]
    assert main([*plan, "--attention-backend", "fa"]) == 0
    dit = [
        row
        for c in json.loads(capsys.readouterr().out)["components"]
        if c["name"] == "transformer"
        for row in c["layers"]
    ]
    assert dit and all(
        row["backend"] == "torch_sdpa" and row["source"] == "cli" and "fa -> torch_sdpa" in row["fallback_reason"]
        for row in dit
    )
    assert main([*plan, "--attention-backend", "torch_cudnn_sdpa"]) == 2
    assert "cannot serve transformer" in capsys.readouterr().err
    assert main([*plan, "--attention-backend", "video_sparse_attn"]) == 0
    dit = [
        row
        for c in json.loads(capsys.readouterr().out)["components"]
        if c["name"] == "transformer"
        for row in c["layers"]
    ]
    assert {row["role"]: row["backend"] for row in dit} == {"self": "video_sparse_attn", "cross": "torch_sdpa"}


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_is_accepted_before_and_after_the_command(where):
    """``ditattn -v generate`` and ``ditattn generate -v`` (and ``--verbose``) are the same setting, on every
    command; one definition of the option (flags.verbose_flag)."""
    from ditattn.entrypoints.cli import COMMANDS

    for cmd in COMMANDS:
        for opt in ("-v", "--verbose"):
            argv = [opt, cmd.name] if where == "before" else [cmd.name, opt]
            assert vars(build_parser().parse_args(argv)).get("verbose") is True, (cmd.name, argv)
        assert "verbose" not in vars(build_parser().parse_args([cmd.name])), cmd.name


@pytest.mark.parametrize(
    "argv, value", [(["--lora-fuse"], True), (["--lora-fuse", "true"], True), (["--lora-fuse", "false"], False)]
)
def test_tri_state_bool_flag_takes_the_bare_form(argv, value):
    """``--lora-fuse`` (unset: the command's own default) takes the bare form like every other boolean flag."""
    ns = build_parser().parse_args(["generate", "--lora-path", "a.safetensors", *argv])
    assert ns.lora_fuse is value
    given = {k: v for k, v in vars(ns).items() if k != "command"}
    assert (
        RunConfig.from_mapping(
            given, accept=("model", "sampling", "attention", "cache", "parallel", "output")
        ).model.lora_fuse
        is value
    )
    assert "lora_fuse" not in vars(build_parser().parse_args(["generate"]))


def test_model_path_help_lists_every_builtin_model_and_override_help_every_role():
    from ditattn.models.builtin import BUILTIN_MODELS

    text = flags.field_help("model_path")
    assert all(name in text for name in BUILTIN_MODELS), text
    assert ".self/.cross/.cross_image" in flags.field_help("component_attention_backends")
