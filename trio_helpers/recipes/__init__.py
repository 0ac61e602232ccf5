"""Command-line recipes: the book's training loops as scripts (``python -m trio_helpers.recipes.<name>``).

Each recipe parses the tutorials' flags into the same config the chapters use and calls the same function, so a
recipe and its chapter cannot drift apart.

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""


import argparse


def int_at_least(low: int):
    """An argparse ``type`` accepting integers >= ``low``, with an error message naming the bound.

    Shared by the recipes (``python -m trio_helpers.recipes.grpo`` / ``.evaluate``).
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse
