"""trio_helpers: the small helper package of the PyTRIO RL book.

Import what a chapter introduces from its module, e.g. ``from trio_helpers.grading import grade_answer``.
``import trio_helpers`` stays cheap: it imports neither transformers nor datasets nor pytrio.
"""

__all__ = ["connect"]


def connect(backend=None, **options):
    """Return a PyTRIO service client (real or offline); see :func:`trio_helpers.backend.connect`."""
    from trio_helpers.backend import connect as _connect

    return _connect(backend, **options)
