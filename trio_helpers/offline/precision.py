"""Sampler numerics that differ from the trainer's, as an inference engine's do.

Introduced in {ref}`offline-backend-precision` (book/offline_backend.md). On the service the
sampler is an inference engine and the trainer a training framework: different kernels,
often a lower precision (bfloat16 logits are common), so the logprobs returned with samples
(``SampleSequence.logprobs``) differ slightly from the trainer's logprobs of the same tokens
(``forward`` / ``forward_backward`` outputs), and importance ratios computed from the two
are not exactly 1 even for on-policy data. The offline backend computes both in float64 from
the same code, so they agree up to the float32 in which ``forward`` returns its logprobs
(about 1e-7), unless ``OfflineOptions(sampler_logit_precision=...)`` is set: then every
logit the *sampler*
computes is rounded to that format's mantissa before the softmax. That covers sampling, the
logprobs returned with samples, prompt logprobs and ``compute_logprobs``, which pytrio
serves with a one-token sampling request (so on the service it is computed by the inference
engine too). The trainer is never rounded.

Only the mantissa is modelled (round to nearest, ties to even); the exponent range and
subnormals of the formats are not, since logits are far from their limits.
"""

from __future__ import annotations

import numpy as np

from trio_helpers.offline.model import TinyLM

# explicit mantissa bits of each format the option accepts, from finest to coarsest
MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7, "float8_e4m3": 3}


def check_precision(value: object) -> None:
    """Raise a one-line ``ValueError`` unless ``value`` is None or a MANTISSA_BITS name."""
    if value is not None and value not in MANTISSA_BITS:
        raise ValueError(
            f"sampler_logit_precision must be None (the sampler computes like the trainer) "
            f"or one of {', '.join(MANTISSA_BITS)}, got {value!r}"
        )


def round_mantissa(x: np.ndarray, bits: int) -> np.ndarray:
    """``x`` rounded to ``bits`` explicit mantissa bits (ties to even), as float64."""
    # x = m * 2**e with |m| in [0.5, 1)
    mantissa, exponent = np.frexp(np.asarray(x, dtype=np.float64))
    scale = float(2 ** (bits + 1))  # the implicit leading bit plus the explicit ones
    return np.ldexp(np.round(mantissa * scale) / scale, exponent)


class RoundedLogitsLM(TinyLM):
    """A sampler's model: the same weights, logits rounded to a lower precision."""

    def __init__(self, model: TinyLM, precision: str) -> None:
        check_precision(precision)
        super().__init__(model.base, model.adapter)
        self.precision = precision
        self.bits = MANTISSA_BITS[precision]

    def forward(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h, z = super().forward(keys)
        return h, round_mantissa(z, self.bits)


def sampler_model(model: TinyLM, precision: str | None) -> TinyLM:
    """The model a sampling client computes with (``model`` itself if precision is None)."""
    return model if precision is None else RoundedLogitsLM(model, precision)
