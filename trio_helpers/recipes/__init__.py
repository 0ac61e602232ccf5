"""Command-line recipes: the book's training loops as scripts (``python -m trio_helpers.recipes.<name>``).

Each recipe parses the tutorials' flags into the same config the chapters use and calls the same function, so a
recipe and its chapter cannot drift apart.

Introduced in: chapter 04 (notebooks/04_grpo_sync).
"""
