"""User-facing errors: the CLIs print their message and exit non-zero, without a traceback."""
from __future__ import annotations

from typing import Callable


class WhiflashError(Exception):
    """An error a user can act on (bad input, missing files); the message says what and how."""


class CheckpointError(WhiflashError):
    """A checkpoint or engine directory is missing, incomplete, corrupt, or does not match its config."""


class SpecError(WhiflashError):
    """A request's speculation setting that this engine cannot run, or that the request's mode would ignore; or a
    load setting ("device", "threads", "backend") that cannot run here.

    `params` are the settings at fault by their neutral names (runtime.plan.PARAMS: "mode", "router", "threshold",
    "catch_up", "tree_top_k", ...), the first one (`param`) the one to point at. The message is a template whose
    `{params}` field lists them and whose `{mode}`, `{router}`, ... fields name one setting; `spelled` writes every
    name as a front end spells it (a CLI flag, a request field), and str() is the neutral spelling. Text that is not
    a field goes in through `literal`."""

    def __init__(self, params: tuple[str, ...], template: str) -> None:
        self.params, self.template = params, template
        super().__init__(self.spelled(str))

    @property
    def param(self) -> str:
        return self.params[0]

    def spelled(self, spell: Callable[[str], str]) -> str:
        return self.template.format_map(_Spelling(spell, self.params))


def literal(value) -> str:
    """`value` as text that stands for itself inside a SpecError template (its braces doubled)."""
    return str(value).replace("{", "{{").replace("}", "}}")


class _Spelling(dict):
    """format_map's fields for SpecError: `params` the listed settings, any other field the setting of that name."""

    def __init__(self, spell: Callable[[str], str], params: tuple[str, ...]) -> None:
        super().__init__(params=", ".join(spell(p) for p in params))
        self.spell = spell

    def __missing__(self, name: str) -> str:
        return self.spell(name)
