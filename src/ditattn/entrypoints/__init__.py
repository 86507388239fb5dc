"""The entry points: the top layer, the only one that knows about commands.

Each command is a module with ``run(cfg: RunConfig) -> int`` (the exit status), callable from
Python as well as from the CLI:

* :mod:`.generate` — ``ditattn generate``;
* :mod:`.plan` — ``ditattn plan``;
* :mod:`.backends` — ``ditattn backends``;
* :mod:`.serve` — ``ditattn serve``;
* :mod:`.ranks` — running a command on ``--num-gpus N`` ranks;
* :mod:`.cli` — argparse: the flags (:mod:`.flags`), ``--config FILE.yaml`` and the ``Command``
  table that maps each subcommand to its flags, its config sections and its ``run``.

Dependencies point down: entry points → server → pipelines → runconfig → models → distributed →
attention / platforms → settings, errors.  Nothing below this package imports it, ``argparse`` or
an argparse ``Namespace`` (tests/cli/test_architecture.py checks both).

A new subcommand (e.g. ``compare``): a module here with ``run(cfg) -> int``; its settings as a
section of :class:`~ditattn.runconfig.RunConfig` (a frozen dataclass of checked fields, named like
its flags) when the existing ones do not cover them; a flag-group function in :mod:`.flags`; one
``Command`` row in :data:`.cli.COMMANDS`.
"""
