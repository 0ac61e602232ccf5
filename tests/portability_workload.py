"""The fixed workload of tests/test_portability.py: run in a subprocess, prints one JSON object of digests.

``python tests/portability_workload.py small``: a small model fitted from scratch, a short GRPO run on the book's
student (metrics and final weights), a ``compute_logprobs``, and a ``forward_backward``'s loss and gradients.
``python tests/portability_workload.py book``: the book's two models fitted from scratch into an empty cache
(``TRIO_OFFLINE_CACHE`` must name one).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from dataclasses import replace

import numpy as np


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.float64).tobytes())
    return h.hexdigest()[:16]


def small() -> dict[str, str]:
    import pytrio as trio
    from pytrio.types import Datum, TensorData

    from trio_helpers import connect
    from trio_helpers.data import load_gsm8k
    from trio_helpers.grpo import GRPOConfig, run_grpo
    from trio_helpers.offline import catalog, fit

    out: dict[str, str] = {}
    records = load_gsm8k("train", source="offline")
    service = connect("offline", latency=0.0, home=tempfile.mkdtemp(), in_process=True)
    config = GRPOConfig(steps=2, batch_size=2, group_size=4, max_tokens=96, seed=0, lr_schedule="cosine")
    result = run_grpo(service, records[:16], config)
    rows = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in result.history]
    out["grpo_metrics"] = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    tc = result.training_client
    adapter = tc._model.adapter
    out["grpo_weights"] = digest(adapter.A, adapter.B, adapter.C)

    sampler = tc.save_weights_and_get_sampling_client()
    prompt = sampler.get_tokenizer().encode("Question: 12 * 7 = ?\nAnswer: 84", add_special_tokens=False)
    logprobs = sampler.compute_logprobs(trio.ModelInput.from_ints(prompt)).result()[1:]
    out["compute_logprobs"] = digest(np.array(logprobs))

    completion = sampler.sample(trio.ModelInput.from_ints(prompt), num_samples=2,
                                sampling_params=trio.SamplingParams(max_tokens=24, seed=5)).result()
    data = []
    for i, seq in enumerate(completion.sequences):
        tokens = prompt + list(seq.tokens)
        n, pad = len(tokens), [0.0] * (len(prompt) - 1)
        data.append(Datum(
            model_input=trio.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
                "logprobs": TensorData.from_numpy(np.array(pad + list(seq.logprobs)) - 0.1),
                "advantages": TensorData.from_numpy(np.array(pad + [1.0 - 2 * i] * (n - len(prompt)))),
            }))
    fb = tc.forward_backward(data, loss_fn="ppo").result()
    out["forward_backward"] = digest(np.array([fb.metrics["loss_sum"]]), *(tc._grads[k] for k in ("A", "B", "C")))

    # last: the small fit patches the corpus (nothing else runs after it in this process)
    fit._corpus_records = lambda: (records[:24], [])
    fit.EPOCHS = {"student": 2, "teacher": 1}
    weights = fit.fit_base(replace(catalog.STUDENT, dim=16, table_size=1 << 12), verbose=False)
    out["fit_small"] = fit.weights_digest(weights)[:16]
    return out


def book() -> dict[str, str]:
    from trio_helpers.offline import fit

    if any(fit.cache_dir().glob("*.npz")):
        raise SystemExit(f"TRIO_OFFLINE_CACHE={fit.cache_dir()} is not empty: the book models would be loaded, "
                         "not fitted")
    return {spec.role: fit.weights_digest(fit.load_or_fit(spec)) for spec in (fit.STUDENT, fit.TEACHER, fit.TOOL)}


if __name__ == "__main__":
    print(json.dumps({"small": small, "book": book}[sys.argv[1]]()))
