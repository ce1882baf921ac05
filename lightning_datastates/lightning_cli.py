"""``DataStatesCLI``: Lightning's ``LightningCLI``, except that a bad ``init_args`` value of
:class:`~lightning_datastates.DataStatesIO` is told in one line, by the plugin's own validation
(:func:`~lightning_datastates.config.check_settings`: the setting and the fix, the closest name for a misspelt one).

Without it, jsonargparse reports such a mistake inside its report of every plugin type that ``trainer.plugins``
accepts (Precision, ClusterEnvironment, CheckpointIO, LayerSync): 77 to 97 lines, with the line that matters in the
middle, or as a traceback when the value reaches the plugin. Here the command ends with the usage line and
``error: trainer.plugins: <our message>`` (exit status 2); any other error is reported as jsonargparse reports it.

``examples/cli.py`` uses it; in a script of your own, use ``DataStatesCLI`` where you would use ``LightningCLI``
(same arguments). Needs the ``cli`` extra (jsonargparse), as ``LightningCLI`` does.
"""

from __future__ import annotations

import re
from argparse import ArgumentError
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_datastates.config import check_settings
from lightning_datastates.errors import ConfigError

#: Where the plugin sits in a ``LightningCLI`` config.
PLUGINS_KEY = "trainer.plugins"

# How jsonargparse (4.39 to 4.53) reports a problem with the plugin's init_args, inside its report of the Union of
# plugin types: a header naming our class path, then the problem, indented.
_PROBLEM = re.compile(r"Problem with given class_path '(lightning_datastates(?:\.plugin)?\.DataStatesIO)':\n")
_UNKNOWN = re.compile(r"""Option '(?P<name>\w+)' is not accepted""")
_BAD_VALUE = re.compile(r"""Parser key "(?P<name>\w+)":\s*\n\s*Expected .*?Got value: (?P<value>.*)""")


def explain_parse_error(message: str) -> str | None:
    """The plugin's own message for the ``DataStatesIO`` problem that jsonargparse's ``message`` reports (a misspelt
    setting, a value of the wrong type); None where ``message`` is about something else, or where our validation
    finds nothing wrong with what jsonargparse refused."""
    header = _PROBLEM.search(message)
    if header is None:
        return None
    body = message[header.end() :]
    unknown, bad = _UNKNOWN.match(body.lstrip()), _BAD_VALUE.match(body.lstrip())
    if unknown is not None:
        settings: dict[str, Any] = {unknown["name"]: None}
    elif bad is not None:
        settings = {bad["name"]: bad["value"].strip()}
    else:
        return None
    try:
        check_settings(settings)
    except ConfigError as exc:
        return f"{PLUGINS_KEY}: {exc}"
    return None


def check_plugin_settings(config: Any) -> None:
    """Validate the ``init_args`` of every ``DataStatesIO`` in a parsed ``LightningCLI`` config (``trainer.plugins``:
    one entry or a list), before jsonargparse instantiates them.

    Raises:
        ConfigError: as :func:`~lightning_datastates.config.check_settings`, for the first invalid setting.
    """
    trainer = getattr(config, "trainer", None)
    plugins = getattr(trainer, "plugins", None)
    for plugin in plugins if isinstance(plugins, list) else [plugins]:
        class_path = getattr(plugin, "class_path", None)
        if not isinstance(class_path, str) or not _PROBLEM.match(f"Problem with given class_path '{class_path}':\n"):
            continue
        init_args = getattr(plugin, "init_args", None)
        check_settings({} if init_args is None else dict(vars(init_args)))


class DataStatesCLI(LightningCLI):
    """``LightningCLI`` that reports a bad ``DataStatesIO`` setting with the plugin's own message (see the module
    docstring). Takes the arguments of ``LightningCLI``."""

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """Make a parser as ``LightningCLI`` does (the command's and each subcommand's), raising its errors instead of
        printing them and exiting while the arguments are parsed, so that :meth:`parse_arguments` can tell them."""
        parser = super().init_parser(**kwargs)
        self._parsers_exit_on_error = getattr(self, "_parsers_exit_on_error", [])
        self._parsers_exit_on_error.append((parser, parser.exit_on_error))
        parser.exit_on_error = False  # subcommand parsers take it from here too
        return parser

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse as ``LightningCLI`` does; a parse error about ``DataStatesIO`` ends with its own message."""
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as exc:
            self._restore_exit_on_error()
            explained = explain_parse_error(str(exc))
            if explained is None:
                parser.error(str(exc), exc)  # as jsonargparse reports it
            parser.error(explained)  # the short usage of the command, then ours as the last line
        self._restore_exit_on_error()

    def _restore_exit_on_error(self) -> None:
        for made, exit_on_error in getattr(self, "_parsers_exit_on_error", []):
            made.exit_on_error = exit_on_error

    def instantiate_classes(self) -> None:
        """Check the ``DataStatesIO`` settings (the plugin's message as the error), then instantiate as
        ``LightningCLI`` does."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        try:
            check_plugin_settings(config)
        except ConfigError as exc:
            self.parser.error(f"{PLUGINS_KEY}: {exc}")
        super().instantiate_classes()
