"""pytrio's own client against the offline server (``trio_helpers.offline.server``), over 127.0.0.1.

Every call the book uses goes through pytrio 0.2.9's unmodified ``ServiceClient`` and must give the same numbers as
the in-process offline backend (``connect("offline", in_process=True)``) with the same seeds: sampled tokens and
logprobs, prompt and top-k prompt logprobs, ``compute_logprobs``, every loss, optimizer metrics, checkpoints and
the final weights.
Seeded 503 faults (before and after the work) are retried by pytrio itself and change nothing; a re-sent event is
answered 409 ``event_exists`` and runs once. A subprocess runs a plain pytrio script against
``python -m trio_helpers.offline.serve``. Each test is bounded in time (``signal.alarm``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import pytrio as trio
from pytrio.config import config as pytrio_config
from pytrio.errors.actor import ActorEventSubmitError
from pytrio.errors.control import ControlAPIError

from trio_helpers import connect
from trio_helpers.offline.server import OfflineServer, service_client
from trio_helpers.offline.service import OfflineOptions

MODEL = "offline/tiny"
RANK = 8
PROMPT = trio.ModelInput.from_ints(list(b"Once upon a time"))
HP = trio.AdamParams(learning_rate=5e-2)
# pytrio's retries in real time, shortened (the service's defaults: 1 s doubling to 30 s within 15 minutes)
FAST = dict(retry_initial_delay_seconds=0.01, retry_multiplier=1.5, retry_max_delay_seconds=0.05,
            retry_jitter_ratio=0.0, training_retry_timeout_seconds=5.0, sampling_retry_timeout_seconds=5.0,
            control_retry_timeout_seconds=5.0)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def bounded():
    """Fail a test that runs longer than 90 s instead of hanging the suite."""
    def expire(*_):
        raise TimeoutError("test exceeded 90 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(90)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def datum(tokens: list[int], policy: bool) -> trio.Datum:
    inputs = {"target_tokens": trio.types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64))}
    n = len(tokens) - 1
    if policy:
        rng = np.random.default_rng(n)
        inputs["logprobs"] = trio.types.TensorData.from_numpy(rng.uniform(-6, -1, n).astype(np.float32))
        inputs["advantages"] = trio.types.TensorData.from_numpy(rng.normal(size=n).astype(np.float32))
    else:
        inputs["weights"] = trio.types.TensorData.from_numpy((np.arange(n) % 3 != 0).astype(np.float32))
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


CE = [datum(list(b"The answer is 42."), False), datum(list(b"2 + 2 = 4"), False)]
POLICY = [datum(list(b"The answer is 42."), True), datum(list(b"2 + 2 = 4"), True)]
LOSSES = [("cross_entropy", CE, None), ("importance_sampling", POLICY, None), ("ppo", POLICY, None),
          ("cispo", POLICY, None), ("dro", POLICY, None)]


def numbers(x):
    """A pytrio result as plain nested lists and floats (paths, which name random runs, left out)."""
    if isinstance(x, trio.types.ForwardBackwardOutput):
        return [[o["logprobs"].to_numpy().tolist() for o in x.loss_fn_outputs], x.metrics]
    if isinstance(x, trio.types.SampleResponse):
        return [[(s.tokens, s.logprobs, s.stop_reason, s.text) for s in x.sequences], x.prompt_logprobs,
                [None if t is None else [tuple(p) for p in t] for t in x.topk_prompt_logprobs],
                x.input_tokens, x.output_tokens]
    if isinstance(x, (trio.types.SaveWeightsResponse, trio.types.SaveWeightsForSamplerResponse)):
        return [x.model, x.size]
    if isinstance(x, trio.types.OptimStepResponse):
        return x.metrics
    return x


def workload(svc, adapters) -> list:
    """Every call the book makes, once; ``adapters(tc)`` reads a training client's weights."""
    out = [sorted(svc.get_supported_models())]
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=2)
    first = tc.save_weights_and_get_sampling_client()
    seeded = trio.SamplingParams(max_tokens=6, seed=11)
    out.append(first.sample(PROMPT, num_samples=3, sampling_params=seeded, include_prompt_logprobs=True,
                            topk_prompt_logprobs=3).result())
    out.append(first.compute_logprobs(PROMPT).result())
    for name, data, config in LOSSES:
        fb = tc.forward_backward(data, loss_fn=name, loss_fn_config=config)  # back to back, as a pipelined loop
        opt = tc.optim_step(HP)
        out += [fb.result(), opt.result()]
    out.append(tc.forward(CE).result())
    state = tc.save_state("state").result()
    weights = tc.save_weights_for_sampler("weights").result()
    out += [state, weights]
    sampler = tc.create_sampling_client(weights.path)
    out.append(sampler.sample(PROMPT, num_samples=2, sampling_params=trio.SamplingParams(
        max_tokens=8, seed=5, temperature=0.7, top_k=20, top_p=0.9, stop=["e"])).result())
    base = svc.create_sampling_client(MODEL)
    out.append(base.sample(PROMPT, num_samples=1, sampling_params=seeded).result())
    again = svc.create_sampling_client(MODEL, model_path=weights.path)
    out.append(again.compute_logprobs(PROMPT).result())
    resumed = svc.create_training_client_from_state_with_optimizer(state.path)
    plain = svc.create_training_client_from_state(state.path)
    loaded = svc.create_lora_training_client(MODEL, rank=RANK, seed=9)
    loaded.load_state(state.path).result()
    for client in (tc, resumed, plain, loaded):
        out += [client.forward_backward(CE).result(), client.optim_step(HP).result()]
    out += [adapters(c) for c in (tc, resumed, plain, loaded)]
    return [numbers(x) for x in out]


async def workload_async(svc, adapters) -> list:
    """The ``_async`` variants of the same calls (a shorter workload)."""
    tc = await svc.create_lora_training_client_async(MODEL, rank=RANK, seed=2)
    sampler = await tc.save_weights_and_get_sampling_client_async()
    seeded = trio.SamplingParams(max_tokens=6, seed=11)
    out = [await sampler.sample_async(PROMPT, num_samples=3, sampling_params=seeded, include_prompt_logprobs=True,
                                      topk_prompt_logprobs=3),
           await sampler.compute_logprobs_async(PROMPT)]
    fb = await tc.forward_backward_async(CE)
    opt = await tc.optim_step_async(HP)
    out += [await fb, await opt, await (await tc.forward_async(CE))]
    state = await (await tc.save_state_async("state-async"))
    weights = await (await tc.save_weights_for_sampler_async("weights-async"))
    other = await svc.create_sampling_client_async(MODEL, model_path=weights.path)
    out.append(await other.sample_async(PROMPT, sampling_params=seeded))
    resumed = await svc.create_training_client_from_state_with_optimizer_async(state.path)
    out += [await (await resumed.forward_backward_async(CE)), await (await resumed.optim_step_async(HP))]
    out += [adapters(c) for c in (tc, resumed)]
    return [numbers(x) for x in out]


def server_adapter(server: OfflineServer):
    """Weights of a pytrio training client, read on the server (by its run id)."""
    def read(tc) -> list:
        tc_state = server._runs[tc._training_run_cuid].state
        return [v.tolist() for v in tc_state._model.adapter.params().values()]
    return read


def local_adapter(tc) -> list:
    return [v.tolist() for v in tc._model.adapter.params().values()]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("offline-home")


@pytest.fixture(scope="module")
def server(home) -> OfflineServer:
    # never stopped: pytrio closes its service session when a client is collected, possibly at interpreter exit
    return OfflineServer(options=OfflineOptions(latency=0.0, home=home)).start()


@pytest.fixture(scope="module")
def reference(home) -> list:
    local = connect("offline", in_process=True, latency=0.0, home=home)
    return workload(local, local_adapter)


def test_every_call_matches_the_in_process_backend(server, reference):
    svc = service_client(server, **FAST)
    assert isinstance(svc, trio.ServiceClient)
    assert workload(svc, server_adapter(server)) == reference
    assert set(server.executions().values()) == {1}


def test_async_variants_match(server, home):
    local = connect("offline", in_process=True, latency=0.0, home=home)
    expected = asyncio.run(workload_async(local, local_adapter))
    svc = service_client(server, **FAST)
    assert asyncio.run(workload_async(svc, server_adapter(server))) == expected


def test_faults_before_and_after_the_work_change_nothing(home, reference):
    faulty = OfflineServer(options=OfflineOptions(latency=0.0, home=home, fault_rate=0.25, seed=3)).start()
    svc = service_client(faulty, **FAST)
    assert workload(svc, server_adapter(faulty)) == reference
    stats = faulty.stats
    assert stats["faults_before"] > 0 and stats["faults_after"] > 0, stats
    assert stats["event_exists"] > 0, stats  # a submit answered 503 after its work was re-sent: 409, not re-run
    assert set(faulty.executions().values()) == {1}


def test_latency_delays_each_request_the_ledger_counts_and_nothing_else(home, monkeypatch):
    """``latency`` is the in-process backend's: each request a program makes waits it (runs created, training
    events, samples), not pytrio's own session, init_run, poll and heartbeat requests."""
    import types

    import trio_helpers.offline.server as server_module

    slept = []
    monkeypatch.setattr(server_module, "time", types.SimpleNamespace(sleep=slept.append, monotonic=time.monotonic))
    slow = OfflineServer(options=OfflineOptions(latency=0.25, home=home)).start()
    svc = service_client(slow, **FAST)
    tc = svc.create_lora_training_client("offline/tiny", rank=8, seed=0)
    sampler = tc.save_weights_and_get_sampling_client()
    sampler.sample(trio.ModelInput.from_ints([1, 2, 3]), num_samples=2,
                   sampling_params=trio.SamplingParams(max_tokens=3, seed=0)).result()
    # a training run, a save_weights event, a sampling run and a sample; pytrio sent more requests than that
    assert slow.stats["new_requests"] == 4 and slept == [0.25] * 4
    assert sum(slow._attempts.values()) > 8  # the session, init_run, polls, ...: every request the server saw


def test_an_outage_surfaces_pytrio_errors_within_the_window(home):
    # requests are numbered as the ledger counts them (pytrio's session and init_run are not numbered)
    down = OfflineServer(options=OfflineOptions(latency=0.0, home=home, outage_after=2)).start()
    short = {**FAST, "training_retry_timeout_seconds": 0.5, "control_retry_timeout_seconds": 0.5}
    svc = service_client(down, **short)  # session create: not numbered
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=2)  # request 0
    tc.forward_backward(CE).result()  # init_run (not numbered), then request 1
    started = time.monotonic()
    with pytest.raises(ActorEventSubmitError) as failed:
        tc.optim_step(HP).result()  # request 2: the outage begins
    assert failed.value.status_code == 503
    with pytest.raises(ControlAPIError):
        svc.create_sampling_client(MODEL)
    assert time.monotonic() - started < 10


def test_heartbeats_reach_the_server(server):
    svc = service_client(server, **FAST, actor_heartbeat_interval_seconds=1.0)
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=1)
    tc.forward(CE).result()  # the run starts (and heartbeats) at its first operation
    time.sleep(1.6)
    assert server.runs()[tc._training_run_cuid]["heartbeats"] >= 2


def test_pytrio_configuration_is_restored(server, tmp_path):
    before = pytrio_config.configuration.model_copy(deep=True)
    key = pytrio_config.auth_state.api_key
    svc = service_client(server, **FAST)
    assert pytrio_config.configuration == before
    assert pytrio_config.auth_state.api_key == key
    private = Path(svc._runtime.configuration.home)
    assert private != Path(before.home) and svc._runtime.configuration.base_url == server.base_url
    assert not (private / ".pytrio").exists()  # nothing written under the client's home either


def test_an_unmodified_pytrio_script_runs_against_the_standalone_server(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRIO_OFFLINE_HOME": str(tmp_path)}
    serve = subprocess.Popen([sys.executable, "-m", "trio_helpers.offline.serve", "--seed", "1",
                              "--fault-rate", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=tmp_path)
    try:
        exports = {}
        for line in serve.stdout:
            if line.startswith("#"):
                break
            name, _, value = line.removeprefix("export ").strip().partition("=")
            exports[name] = value
        assert exports["PYTRIO_BASE_URL"].startswith("http://127.0.0.1:")
        script = textwrap.dedent(f"""
            import numpy as np
            import pytrio as trio
            trio.configure(**{FAST!r})
            svc = trio.ServiceClient()
            tc = svc.create_lora_training_client({MODEL!r}, rank={RANK}, seed=2)
            tok = tc.get_tokenizer()
            ids = tok.encode("The answer")
            target = trio.types.TensorData.from_numpy(np.array(ids[1:], dtype=np.int64))
            data = [trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={{"target_tokens": target}})]
            print(tc.forward_backward(data).result().metrics["loss_sum"])
            tc.optim_step(trio.AdamParams(learning_rate=0.05)).result()
            sc = tc.save_weights_and_get_sampling_client()
            print(sc.sample(trio.ModelInput.from_ints(tok.encode("Once")), num_samples=1,
                            sampling_params=trio.SamplingParams(max_tokens=4, seed=3)).result().sequences[0].tokens)
        """)
        client_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTRIO_")}
        run = subprocess.run([sys.executable, "-c", script], env={**client_env, **exports}, capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        loss, tokens = run.stdout.split("\n")[:2]
        assert float(loss) > 0 and len(eval(tokens)) == 4
    finally:
        serve.terminate()
        serve.wait(timeout=10)


def test_dropping_the_clients_ends_the_runs(server):
    """pytrio 0.2.9 has no ``TrainingClient.close()`` and never sends ``trainer.end_run``: a run ends when the
    last reference to its ``ServiceClient`` (and the clients derived from it) goes, and pytrio closes the service
    session; until then heartbeats keep the run alive."""
    import gc

    svc = service_client(server, **FAST, actor_heartbeat_interval_seconds=1.0)
    tc = svc.create_lora_training_client(MODEL, rank=RANK, seed=1)
    tc.forward(CE).result()
    cuid = tc._training_run_cuid
    assert not server.runs()[cuid]["ended"]
    del tc
    gc.collect()
    beats = server.runs()[cuid]["heartbeats"]
    time.sleep(1.5)
    assert server.runs()[cuid]["heartbeats"] == beats  # the training client's heartbeat stopped with it
    assert not server.runs()[cuid]["ended"]  # the ServiceClient still holds the session
    del svc
    gc.collect()
    assert server.runs()[cuid]["ended"]


def test_forward_outputs_are_built_without_pydantic_validation_on_the_compute_thread():
    """TensorData's validator tries `import torch` every time; on the compute thread such a try held the import lock
    while a garbage-collected client's finalizer, run there, waited for its event loop, which needed the lock (the
    suite hung). The compute thread builds the same value with model_construct."""
    import numpy as np
    from pytrio.types import TensorData

    from trio_helpers.offline.service import _logprob_tensor

    values = np.array([-0.5, -1.25, 0.0, -3.0e-7])
    built, validated = _logprob_tensor(values), TensorData.from_numpy(values.astype(np.float32))
    assert built == validated and built.model_dump() == validated.model_dump()
    assert _logprob_tensor(np.zeros(0)).model_dump() == TensorData.from_numpy(np.zeros(0, np.float32)).model_dump()


def test_the_exact_reverse_kl_reads_the_servers_models(server, home):
    """The offline-only exact KL (chapter 6) takes pytrio's sampling clients of an offline server too: the same
    numbers as with the in-process clients; a client that no offline backend serves is refused."""
    from trio_helpers.distillation import exact_reverse_kl_offline
    from trio_helpers.offline.server import sampler_model

    teacher_model = "Qwen/Qwen3.6-27B"
    local = connect("offline", in_process=True, latency=0.0, home=home)
    svc = service_client(server, **FAST)
    prompts = [PROMPT, trio.ModelInput.from_ints(list(b"The answer is"))]
    kl = {name: exact_reverse_kl_offline(s.create_sampling_client(MODEL), s.create_sampling_client(teacher_model),
                                         prompts, max_tokens=6, samples=2)
          for name, s in (("local", local), ("server", svc))}
    np.testing.assert_equal(kl["server"], kl["local"])  # (nan where a split has no position, in both)
    assert kl["local"]["tokens"] > 0
    with pytest.raises(TypeError, match="not served by the offline backend"):
        sampler_model(object())


def test_end_sessions_ends_the_runs_of_every_client_connect_returned(tmp_path):
    """What every chapter's last cell does: the sessions end (and with them their runs) although variables still
    hold the clients; a second call, and clients of the in-process engine, are left alone."""
    from trio_helpers.backend import end_sessions
    from trio_helpers.offline.server import open_runs, server_of

    first = connect("offline", latency=0.0, home=tmp_path)
    second = connect("offline", latency=0.0, home=tmp_path)
    local = connect("offline", latency=0.0, home=tmp_path, in_process=True)
    clients = [first.create_lora_training_client("offline/tiny", rank=8, seed=0), second.create_sampling_client(
        "offline/tiny")]
    mine = [f"{cuid} ({run['kind']})" for svc in (first, second) for cuid, run in server_of(svc).runs().items()]
    assert len(mine) == 2 and set(mine) <= set(open_runs())
    end_sessions()
    assert not set(mine) & set(open_runs())
    assert all(run["ended"] for svc in (first, second) for run in server_of(svc).runs().values())
    end_sessions()  # nothing left to end
    local.create_lora_training_client("offline/tiny", rank=8, seed=0)  # the in-process client still works
    assert clients  # (the clients were held throughout)


def test_the_servers_of_a_process_share_one_listener(home):
    """Each server keeps its own options, runs and ledger under its own path; stopping one leaves the others."""
    from trio_helpers.backend import usage_of
    from trio_helpers.offline.server import server_of

    first = connect("offline", latency=0.0, seed=1, home=home)
    second = connect("offline", latency=0.0, seed=2, home=home)
    a, b = server_of(first), server_of(second)
    assert a is not b and a._listener is b._listener and a.base_url != b.base_url
    assert a.base_url.rsplit("/", 1)[0] == b.base_url.rsplit("/", 1)[0]  # one port
    first.create_sampling_client(MODEL)
    assert (usage_of(first).sampling_runs, usage_of(second).sampling_runs) == (1, 0)
    a.stop()
    second.create_sampling_client(MODEL)
    assert usage_of(second).sampling_runs == 1
    with pytest.raises(ControlAPIError) as gone:  # the stopped server's path answers 404, not retried
        first.create_sampling_client(MODEL)
    assert gone.value.status_code == 404
