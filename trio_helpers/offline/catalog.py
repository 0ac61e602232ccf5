"""The offline model catalog: which base models exist offline and where their frozen weights come from.

- ``Qwen/Qwen3.5-4B`` (alias ``offline/student``): the student/policy model of the book's RL chapters.
- ``Qwen/Qwen3.6-27B`` (alias ``offline/teacher``): a larger, sharper model used as the distillation teacher.
- ``Qwen/Qwen3.5-9B`` (alias ``offline/tool``): chapter 12's tool-calling model, the student fitted further on the
  same solutions written as calculator episodes (Qwen3's ``<tool_call>`` and ``<tool_response>`` format). A separate
  model, so that the student and the teacher, and every other chapter's outputs, stay as they were. The name is a
  real Qwen3.5 chat model (its chat template renders tool calls the same way); whether a given PyTRIO deployment
  serves it is for ``service.get_server_capabilities()`` to say.
- ``offline/tiny``: random weights, no fitting; instant, for unit tests of the API contract.

The names of real models are reused so that a snippet runs unchanged offline and on the service; the offline
models are of course tiny stand-ins (see ``book/offline_backend.md``). Fitted base weights are computed on first
use by :mod:`trio_helpers.offline.fit` and cached on disk.
"""

from __future__ import annotations

import threading
from pathlib import Path

from trio_helpers.offline.fit import STUDENT, TEACHER, TOOL, ModelSpec, load_or_fit  # noqa: F401 - re-exported
from trio_helpers.offline.model import BaseWeights

TINY = ModelSpec("offline/tiny", "tiny", dim=16, table_size=1 << 12, lora_alpha=32.0, final_row_scale=32.0)

_SPECS = {
    STUDENT.name: STUDENT,
    "offline/student": STUDENT,
    TEACHER.name: TEACHER,
    "offline/teacher": TEACHER,
    TOOL.name: TOOL,
    "offline/tool": TOOL,
    TINY.name: TINY,  # last: the dry run's stand-in teacher (trio_helpers.recipes.print_dry_run)
}

# sha256 of the fitted E, W and b (float64 bytes, trio_helpers.offline.fit.weights_digest) behind the book's
# committed outputs: the same on every computer (the arithmetic is exact, see trio_helpers/offline/exact.py).
# tests/test_offline_fit.py and tests/test_portability.py compare. Change them only together with re-executing every
# chapter (make notebooks).
BOOK_WEIGHTS = {
    "student": "a6df842b605de8d088a82b1249bdbfc92f8db4de44e6837526961127977f34f6",
    "teacher": "094aa2c5c63abc3d4cb8a8a7419b02b56e627c5b3746c588cbb597ec810ed3b6",
    "tool": "0306ffcb7d30ed0521e302c307f0e2212a63b7858d7cf304186bd5c0f1f5cf68",
}

_LOADED: dict[str, BaseWeights] = {}
_LOCK = threading.Lock()


def model_names() -> list[str]:
    """All names the offline backend accepts as ``base_model``."""
    return list(_SPECS)


def spec(name: str) -> ModelSpec:
    return _SPECS[name]


def adapter_scales(name: str) -> tuple[float, float]:
    """``(lora_alpha, final_row_scale)`` of a model's adapter."""
    return _SPECS[name].lora_alpha, _SPECS[name].final_row_scale


def base_weights(name: str, home: Path | None = None) -> BaseWeights:
    """The frozen base weights of ``name`` (fitted and cached on first use; the same object afterwards).

    ``home`` is accepted for symmetry with checkpoints but unused: fitted weights live in the model cache
    (:func:`trio_helpers.offline.fit.cache_dir`), keyed by a hash of what determines them.
    """
    s = _SPECS[name]
    key = s.name
    with _LOCK:
        if key not in _LOADED:
            if s.role == "tiny":
                _LOADED[key] = BaseWeights.random(s.dim, s.table_size, seed=0, name=s.name)
            else:
                _LOADED[key] = load_or_fit(s)
        return _LOADED[key]
