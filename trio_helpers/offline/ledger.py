"""The usage ledger: what the offline service served, counted as the service would bill it.

Introduced in {ref}`offline-backend-ledger` (book/offline_backend.md). ``service.usage()``
and ``client.usage()`` (training and sampling clients) return a frozen ``Usage``; ``+`` and
``-`` combine them field by field, so "what did this cell cost" is
``service.usage() - before``. ``usage_table`` and ``print_usage`` render one or more of them
as a small table.

A service's usage counts every request it served, creating clients included; a client's
usage counts the requests made through that client's methods (so a training client's usage
includes the samplers it created with ``save_weights_and_get_sampling_client``, not the
requests of those samplers). Each request is counted once when it finishes, however often
the client retried it, under a lock per ledger, so concurrent requests never lose or double
an update.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Usage:
    """Totals of an offline service or client. All counts are >= 0.

    Requests and time (every request):
        requests: requests that reached the (simulated) service, each counted once however
            often pytrio's client re-sent it. Calls rejected by validation are never sent and
            not counted.
        retries: on the offline server (what ``connect("offline")`` serves), the attempts it
            answered 503 (a fault or an outage), which pytrio's client re-sends while its retry
            window lasts. The in-process engine (``in_process=True``) has no faults: always 0.

    Work (counted only for requests that did their work):
        samples: sequences sampled (``num_samples`` per ``sample`` call).
        prompt_tokens: prompt tokens of ``sample`` calls, once per call however many samples
            it asks for (the prompt is read once), as ``SampleResponse.input_tokens``
            reports.
        sampled_tokens: generated tokens summed over all sampled sequences
            (``SampleResponse.output_tokens``).
        logprob_tokens: prompt tokens of ``compute_logprobs`` calls.
        forward_tokens: model-input tokens of ``forward`` calls (every datum's
            ``len(model_input)``).
        forward_active_tokens: of those, the tokens with a training target, counted as
            pytrio's planner does (``total_active_tokens``: target not -100 and, for
            ``cross_entropy``, weight not 0).
        forward_backward_tokens: model-input tokens of ``forward_backward`` calls.
        forward_backward_active_tokens: of those, the tokens with a training target.
        optim_steps: ``optim_step`` calls.
        training_runs: training clients created (``create_lora_training_client`` and
            ``create_training_client_from_state*``): on the service, each is a training run.
        sampling_runs: sampling clients created (``create_sampling_client`` and each
            ``save_weights_and_get_sampling_client``).
        sampler_snapshots: ``save_weights_and_get_sampling_client`` calls.
        sampler_weights_saved: ``save_weights_for_sampler`` calls.
        states_saved: ``save_state`` calls.
    """

    requests: int = 0
    retries: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    sampled_tokens: int = 0
    logprob_tokens: int = 0
    forward_tokens: int = 0
    forward_active_tokens: int = 0
    forward_backward_tokens: int = 0
    forward_backward_active_tokens: int = 0
    optim_steps: int = 0
    training_runs: int = 0
    sampling_runs: int = 0
    sampler_snapshots: int = 0
    sampler_weights_saved: int = 0
    states_saved: int = 0

    def __add__(self, other: "Usage") -> "Usage":
        if not isinstance(other, Usage):
            return NotImplemented
        return Usage(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                        for f in fields(Usage)})

    def __sub__(self, other: "Usage") -> "Usage":
        """``later - earlier``: what was served in between; raises if a count goes < 0."""
        if not isinstance(other, Usage):
            return NotImplemented
        out = {}
        for f in fields(Usage):
            value = getattr(self, f.name) - getattr(other, f.name)
            if value < 0:
                raise ValueError(
                    f"usage difference {f.name} would be {value}: subtract the earlier "
                    "snapshot from the later one of the same service or client"
                )
            out[f.name] = value
        return Usage(**out)

    def __str__(self) -> str:
        return usage_table(self)


# (field, label) in table order; labels are at most 30 characters
ROWS = (
    ("requests", "requests"),
    ("retries", "  retries inside the client"),
    ("samples", "sampled sequences"),
    ("prompt_tokens", "sampling prompt tokens"),
    ("sampled_tokens", "sampled tokens"),
    ("logprob_tokens", "compute_logprobs tokens"),
    ("forward_tokens", "forward tokens"),
    ("forward_active_tokens", "  active (with a target)"),
    ("forward_backward_tokens", "forward_backward tokens"),
    ("forward_backward_active_tokens", "  active (with a target)"),
    ("optim_steps", "optimizer steps"),
    ("training_runs", "training runs created"),
    ("sampling_runs", "sampling clients created"),
    ("sampler_snapshots", "sampler snapshots"),
    ("sampler_weights_saved", "sampler weights saved"),
    ("states_saved", "training states saved"),
)
LABEL_WIDTH = 30
COLUMN_WIDTH = 12
MAX_COLUMNS = (92 - LABEL_WIDTH) // COLUMN_WIDTH  # 5 columns fit in 92 characters


def usage_table(usage: Usage | Mapping[str, Usage], *, all_rows: bool = False) -> str:
    """Render usage as a table of at most 92 characters per line.

    Args:
        usage: one ``Usage``, or a mapping from column title to ``Usage`` (at most 5
            columns, titles of at most 11 characters), e.g. ``{"service": s.usage(), "cell":
            diff}``.
        all_rows: also show the rows that are 0 in every column (default: hide them, except
            ``requests``).

    Returns:
        The table, lines joined by newlines, without a trailing newline.

    Raises:
        TypeError: ``usage`` is neither a ``Usage`` nor a mapping of them.
        ValueError: too many columns or a title too long to fit.
    """
    columns = {"usage": usage} if isinstance(usage, Usage) else dict(usage)
    if not columns or not all(isinstance(u, Usage) for u in columns.values()):
        raise TypeError("usage must be a Usage or a mapping of column titles to Usage, got "
                        f"{type(usage).__name__}")
    if len(columns) > MAX_COLUMNS:
        raise ValueError(f"usage_table shows at most {MAX_COLUMNS} columns, got "
                         f"{len(columns)}: split the mapping into several tables")
    for title in columns:
        if len(str(title)) >= COLUMN_WIDTH:
            raise ValueError(f"column title {title!r} is longer than {COLUMN_WIDTH - 1} "
                             "characters: use a shorter title")
    lines = ["".ljust(LABEL_WIDTH) + "".join(str(t).rjust(COLUMN_WIDTH) for t in columns)]
    for name, label in ROWS:
        values = [getattr(u, name) for u in columns.values()]
        if not all_rows and name != "requests" and not any(values):
            continue
        lines.append(label.ljust(LABEL_WIDTH)
                     + "".join(f"{v:,}".rjust(COLUMN_WIDTH) for v in values))
    return "\n".join(line.rstrip() for line in lines)


def print_usage(usage: Usage | Mapping[str, Usage], *, all_rows: bool = False) -> None:
    """Print ``usage_table(usage, all_rows=all_rows)``."""
    print(usage_table(usage, all_rows=all_rows))


class Ledger:
    """A thread-safe accumulator of ``Usage``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = {f.name: f.default for f in fields(Usage)}

    def add(self, counts: Mapping[str, float]) -> None:
        for name, value in counts.items():
            if name not in self._totals:
                raise KeyError(f"unknown usage field {name!r}")
            if value < 0:
                raise ValueError(f"usage count {name} must be >= 0, got {value}")
        with self._lock:
            for name, value in counts.items():
                self._totals[name] += value

    def snapshot(self) -> Usage:
        with self._lock:
            return Usage(**self._totals)
