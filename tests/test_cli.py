"""``gptspeed.cli``: the ``gptspeed`` command's subcommands, each a typed function's flags."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

from gptspeed import cli, options


@pytest.mark.parametrize(
    "argv, function, option_classes",
    [
        (["prepare", "src", "--out", "o"], "gptspeed.data.prepare:prepare", ["PrepareOptions"]),
        (["sample", "--run", "r"], "gptspeed.sample:sample_text", ["SampleOptions", "DeviceOptions"]),
        (["eval", "--run", "r"], "gptspeed.eval:evaluate_run", ["EvalOptions", "DeviceOptions"]),
    ],
)
def test_every_option_not_given_is_its_functions_default(argv, function, option_classes):
    """prepare, sample and eval: every option of the command is a keyword argument of its function, and
    the value the command passes when the flag is not given is that argument's default (both declared
    once, in gptspeed.options)."""
    module, name = function.split(":")
    signature = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    fields = [f for cls in option_classes for f in dataclasses.fields(getattr(options, cls))]
    parsed = vars(cli.build_parser(argv[0]).parse_args(argv))
    for f in fields:
        assert f.name in signature, f.name
        assert parsed[f.name] == signature[f.name].default == f.default, f.name
