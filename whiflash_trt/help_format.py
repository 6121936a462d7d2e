"""One --help style for every console script: each option's default is shown, unless it has none or its help
text already says it."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False or default == [] or default == argparse.SUPPRESS
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"
