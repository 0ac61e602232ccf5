"""The in-process offline engine under event loops, concurrency and ordering.

- the sync API works inside a running event loop (Jupyter) and the async API under ``asyncio.run``;
- requests in flight wait their simulated latency concurrently; sequential calls add up (the only timing checks
  here are a lower bound that cannot flake and one ratio with generous slack);
- a training client's operations run in submission order.

Faults happen between pytrio's client and the offline server (``test_offline_server.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytrio as trio

from trio_helpers import connect
from trio_helpers.offline import service as offline_service

MODEL = "offline/tiny"
RANK = 8
PROMPT = trio.ModelInput.from_ints(list(b"Once upon a time"))


def xent_datum(text: bytes) -> trio.Datum:
    tokens = list(text)
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64)},
    )


DATA = [xent_datum(b"the quick brown fox"), xent_datum(b"jumps over 13 lazy dogs")]


def run_in_thread(fn, timeout: float = 60.0):
    """Run ``fn`` in a daemon thread so that a deadlock fails the test instead of hanging the suite."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "deadlock: the call did not return"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# --------------------------------------------------------------------------------------------- event loops
def test_sync_api_inside_a_running_event_loop(tmp_path):
    """What a Jupyter cell does: plain sync calls while the kernel's loop is running."""

    async def cell():
        asyncio.get_running_loop()  # we really are inside a running loop
        svc = connect("offline", in_process=True, latency=0.01, home=tmp_path)
        tc = svc.create_lora_training_client(MODEL, rank=RANK)
        sampler = tc.save_weights_and_get_sampling_client()
        res = sampler.sample(PROMPT, num_samples=2, sampling_params=trio.SamplingParams(max_tokens=8, seed=1)).result()
        lps = sampler.compute_logprobs(PROMPT).result()
        fb = tc.forward_backward(DATA).result()
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_weights_for_sampler("jupyter").result().path
        loaded = svc.create_sampling_client(MODEL, model_path=path)
        return res, lps, fb, loaded

    res, lps, fb, loaded = run_in_thread(lambda: asyncio.run(cell()))
    assert len(res.sequences) == 2 and lps[0] is None and np.isfinite(fb.metrics["loss_sum"])
    assert loaded.compute_logprobs(PROMPT).result() != lps


def test_async_api_under_asyncio_run(tmp_path):
    async def main():
        svc = connect("offline", in_process=True, latency=0.01, home=tmp_path)
        tc = await svc.create_lora_training_client_async(MODEL, rank=RANK)
        fb = await tc.forward_backward_async(DATA)
        opt = await tc.optim_step_async(trio.AdamParams(learning_rate=1e-2))
        fb_out, opt_out = await fb, await opt
        sampler = await tc.save_weights_and_get_sampling_client_async()
        results = await asyncio.gather(
            *[
                sampler.sample_async(PROMPT, sampling_params=trio.SamplingParams(max_tokens=6, seed=s))
                for s in range(4)
            ]
        )
        return fb_out, opt_out, results

    fb_out, opt_out, results = run_in_thread(lambda: asyncio.run(main()))
    assert np.isfinite(fb_out.metrics["loss_mean"]) and opt_out.metrics["step"] == 1.0
    assert len(results) == 4 and all(len(r.sequences) == 1 for r in results)


def test_results_do_not_depend_on_sync_or_async(tmp_path):
    svc = connect("offline", in_process=True, latency=0.0, home=tmp_path)
    sampler = svc.create_sampling_client(MODEL)
    sp = trio.SamplingParams(max_tokens=10, seed=42)
    sync = sampler.sample(PROMPT, num_samples=3, sampling_params=sp).result()
    asyn = run_in_thread(lambda: asyncio.run(sampler.sample_async(PROMPT, num_samples=3, sampling_params=sp)))
    assert sync == asyn


# ---------------------------------------------------------------------------------------------- concurrency
class _Jitter:
    """Stands in for the ``asyncio`` module inside the offline service: ``sleep`` takes the next scripted delay."""

    def __init__(self, delays):
        self._delays = iter(delays)

    def __getattr__(self, name):
        return getattr(asyncio, name)

    async def sleep(self, _seconds):
        await asyncio.sleep(max(next(self._delays, 0.0), 0.0))


def test_concurrent_requests_overlap_their_latency(tmp_path):
    latency = 0.2
    svc = connect("offline", in_process=True, latency=latency, home=tmp_path)
    sampler = svc.create_sampling_client(MODEL)
    sp = trio.SamplingParams(max_tokens=4, seed=0)
    sampler.sample(PROMPT, sampling_params=sp).result()  # warm-up (tokenizer, caches)

    async def one():
        t0 = time.perf_counter()
        await sampler.sample_async(PROMPT, sampling_params=sp)
        return time.perf_counter() - t0

    async def eight():
        t0 = time.perf_counter()
        await asyncio.gather(*[sampler.sample_async(PROMPT, sampling_params=sp) for _ in range(8)])
        return time.perf_counter() - t0

    single = run_in_thread(lambda: asyncio.run(one()))
    concurrent = run_in_thread(lambda: asyncio.run(eight()))
    t0 = time.perf_counter()
    for _ in range(8):
        sampler.sample(PROMPT, sampling_params=sp).result()
    sequential = time.perf_counter() - t0

    assert single >= latency
    assert sequential >= 8 * latency  # every sync call waits its own latency: a lower bound, cannot flake
    assert concurrent / (8 * single) < 0.5  # ideal ~1/8; generous slack for a loaded machine


def test_training_ops_run_in_submission_order(tmp_path, monkeypatch):
    """forward_backward, optim_step and forward submitted back to back (no waiting) behave as if awaited."""
    hp = trio.AdamParams(learning_rate=5e-2)

    def back_to_back(latency):
        svc = connect("offline", in_process=True, latency=latency, home=tmp_path)
        tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=4)
        futures = []
        for _ in range(3):
            futures.append(tc.forward_backward(DATA))
            futures.append(tc.optim_step(hp))
        futures.append(tc.forward(DATA))
        return tc, [f.result() for f in futures]

    def awaited():
        svc = connect("offline", in_process=True, latency=0.0, home=tmp_path)
        tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=4)
        outs = []
        for _ in range(3):
            outs.append(tc.forward_backward(DATA).result())
            outs.append(tc.optim_step(hp).result())
        outs.append(tc.forward(DATA).result())
        return tc, outs

    ref_tc, ref = awaited()
    for latency in (0.0, 0.02):
        tc, outs = back_to_back(latency)
        np.testing.assert_array_equal(tc._model.adapter.B, ref_tc._model.adapter.B)
        assert [o.metrics for o in outs] == [o.metrics for o in ref]

    # network jitter: every request is faster than the one before it, so without the service's ordering guarantee
    # later operations would overtake earlier ones
    # (8 requests: creating the training client, then the 7 operations)
    delays = [0.08 - 0.01 * i for i in range(8)]
    monkeypatch.setattr(offline_service, "asyncio", _Jitter(delays))
    tc, outs = back_to_back(0.02)
    np.testing.assert_array_equal(tc._model.adapter.B, ref_tc._model.adapter.B)
    assert [o.metrics for o in outs] == [o.metrics for o in ref]
    # the losses went down step after step, so later operations really saw earlier updates
    losses = [ref[i].metrics["loss_mean"] for i in (0, 2, 4, 6)]
    assert losses == sorted(losses, reverse=True)


def test_async_training_ops_keep_submission_order(tmp_path):
    async def main():
        svc = connect("offline", in_process=True, latency=0.02, home=tmp_path)
        tc = await svc.create_lora_training_client_async(MODEL, rank=RANK, seed=4)
        fb = await tc.forward_backward_async(DATA)
        opt = await tc.optim_step_async(trio.AdamParams(learning_rate=5e-2))
        fwd = await tc.forward_async(DATA)
        # await in reverse order: the results must still reflect submission order
        after, _, before = await fwd, await opt, await fb
        return before.metrics["loss_mean"], after.metrics["loss_mean"]

    before, after = run_in_thread(lambda: asyncio.run(main()))
    assert after < before
