"""Offline stand-ins for ``pytrio.ServiceClient``, ``TrainingClient`` and ``SamplingClient``.

Same method names, signatures and return types as pytrio 0.2.9 (a test compares them with ``inspect.signature``);
inputs and outputs are pytrio's own types; validation is pytrio's own (``plan_training_batch`` for training data, the
sampling client's checks for prompts and ``max_tokens``). Work runs on a private event loop in a background thread,
like pytrio's runtime, so the sync API works inside Jupyter's running loop and the async API under any loop.

Every request waits a simulated network latency (concurrently, like real requests in flight)
and then runs its numpy computation on one worker thread (the "accelerator"), where the
sampling requests in flight are batched (see ``_Runtime._sampling_engine``); a training
client's operations run in submission order. Creating a training or sampling client is a
request too (a control call, as on the service), and
``save_weights_and_get_sampling_client`` is two: a training event that snapshots the
weights, then a control call for the sampler.

These clients have no transport: no faults, retries or outages. Those happen on the wire, between pytrio's own
client and the offline server (``trio_helpers.offline.server``), which is what ``connect("offline")`` returns;
``connect("offline", in_process=True)`` refuses ``fault_rate`` and ``outage_after``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pytrio.client.training_batch import normalize_loss_fn, plan_training_batch
from pytrio.errors.base import ValidationError
from pytrio.model.limits import TrainingLimits
from pytrio.types import (
    AdamParams,
    APIFuture,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SampleSequence,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)

from trio_helpers.offline import catalog
from trio_helpers.offline.ledger import Ledger, Usage
from trio_helpers.offline.losses import adamw_step, resolve_loss_config, run_batch
from trio_helpers.offline.model import (Adapter, SampleJob, TinyLM, log_softmax, sequence_features, sequence_rows,
                                         step_sample_jobs)
from trio_helpers.offline.precision import check_precision, sampler_model
from trio_helpers.offline.tokenizer import ENDOFTEXT_ID, IM_END_ID, VOCAB_SIZE, get_offline_tokenizer

URI_SCHEME = "trio-offline://"
MAX_SEQ_LEN = 8192
TRAINING_LIMITS = TrainingLimits(max_batch_size=None, max_tokens_per_request=None, max_seq_len=MAX_SEQ_LEN)


def default_home() -> Path:
    """Where checkpoints live: ``$TRIO_OFFLINE_HOME`` or ``~/.cache/trio_helpers``."""
    return Path(os.environ.get("TRIO_OFFLINE_HOME") or Path.home() / ".cache" / "trio_helpers")


@dataclass
class OfflineOptions:
    """Knobs of the offline service (all passed through ``trio_helpers.connect(..., **options)``).

    Attributes:
        latency: simulated seconds each request spends "on the network" (sampling, logprobs,
            training and control calls alike). Concurrent requests wait concurrently,
            sequential ones add up.
        fault_rate: the offline server's (``trio_helpers.offline.server``): probability that an
            attempt of a request is answered HTTP 503, before or after its work; pytrio's client
            retries it.
        outage_after: the offline server's: from this request on (0-based, as the ledger counts
            requests) every attempt is answered 503, until pytrio's retry window runs out and its
            error surfaces.
        seed: seeds the server's faults and the default sampling seeds.
        sampler_logit_precision: None (default: the sampler computes exactly like the
            trainer), or ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"float8_e4m3"``:
            every logit the sampler computes (sampling, sample and prompt logprobs,
            ``compute_logprobs``) is rounded to that format's mantissa, so that sampler and
            trainer logprobs differ as an inference engine's and a trainer's do
            (``trio_helpers.offline.precision``).
        home: directory for checkpoints (fitted base models are cached separately, under
            ``$TRIO_OFFLINE_CACHE``).
    """

    latency: float = 0.01
    fault_rate: float = 0.0
    outage_after: int | None = None
    seed: int = 0
    sampler_logit_precision: str | None = None
    home: Path = field(default_factory=default_home)

    def __post_init__(self) -> None:
        if not _is_real(self.latency) or not 0 <= self.latency < math.inf:
            raise ValueError(
                f"latency must be a finite number of seconds >= 0, got {self.latency!r}"
            )
        if not _is_real(self.fault_rate) or not 0.0 <= self.fault_rate < 1.0:
            raise ValueError(
                f"fault_rate must be in [0, 1), got {self.fault_rate!r}; for a service "
                "that stays down use outage_after=<request index> instead"
            )
        outage = self.outage_after
        if outage is not None and (isinstance(outage, bool) or not isinstance(outage, int)
                                   or outage < 0):
            raise ValueError(
                f"outage_after must be None or an int >= 0 (the first failing request), "
                f"got {outage!r}"
            )
        check_precision(self.sampler_logit_precision)
        self.home = Path(self.home)


def _is_real(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and not math.isnan(value))


class _Runtime:
    """A private event loop thread (requests) plus one compute thread (the simulated accelerator)."""

    def __init__(self, options: OfflineOptions) -> None:
        self.options = options
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="trio-offline-loop", daemon=True)
        self.thread.start()
        self.compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trio-offline-compute")
        self.ledger = Ledger()
        self.request_counter = itertools.count()  # the default sampling seed stream
        # continuous batching of sampling requests (see _sampling_engine)
        self._batch_lock = threading.Lock()
        self._batch_arrivals: list = []
        self._other_waiting = 0  # compute work other than sampling, submitted and not started

    def _compute(self, fn) -> Future:
        """Run ``fn`` on the compute thread (FIFO with everything else it runs)."""
        with self._batch_lock:
            self._other_waiting += 1

        def run():
            with self._batch_lock:
                self._other_waiting -= 1
            return fn()

        return self.compute.submit(run)

    def _sample_batched(self, job_spec) -> Future:
        """Queue a sampling job ``(start, finish)`` for the engine: ``start()`` returns a
        :class:`~trio_helpers.offline.model.SampleJob`, ``finish(job)`` the response."""
        fut: Future = Future()
        with self._batch_lock:
            self._batch_arrivals.append((job_spec, fut))
        # one engine call per arrival, in the compute queue's order: the first runs the batch and later ones
        # find their job taken (and return at once) or take the arrivals a busy batch turned away
        self.compute.submit(self._sampling_engine)
        return fut

    def _sampling_engine(self) -> None:
        """Continuous batching, as inference servers do it: every step is one forward pass over the active
        sequences of all running sampling requests; requests that arrived join at the next step and finished
        ones leave. Results do not depend on the company a request keeps (each job draws its own random
        numbers; the forward pass is batch-invariant), only its finishing time does. When other compute work
        (a training request) is waiting, the running batch takes no newcomers, so that work runs next."""
        running: list = []
        while True:
            with self._batch_lock:
                take = not running or self._other_waiting == 0
                arrivals, self._batch_arrivals = (self._batch_arrivals, []) if take else ([], self._batch_arrivals)
            for (start, finish), fut in arrivals:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    running.append((start(), finish, fut))
                except BaseException as exc:  # noqa: BLE001 - reported through the request's future
                    fut.set_exception(exc)
            if not running:
                return
            try:
                step_sample_jobs([job for job, _, _ in running])
            except BaseException as exc:  # noqa: BLE001
                for _, _, fut in running:
                    fut.set_exception(exc)
                return
            still = []
            for job, finish, fut in running:
                if not job.done:
                    still.append((job, finish, fut))
                    continue
                try:
                    fut.set_result(finish(job))
                except BaseException as exc:  # noqa: BLE001
                    fut.set_exception(exc)
            running = still

    def submit(self, fn, *, after: Future | None = None, ledgers: tuple[Ledger, ...] = (),
               work: dict[str, int] | None = None, bill=None, batched=None) -> Future:
        """Send one request: on the loop, wait its latency, run, account.

        Args:
            fn: the work, run once on the compute thread.
            batched: instead of ``fn``, a sampling job ``(start, finish)`` for the batching
                engine.
            after: a training client's previous request; this one starts when that one ends.
            ledgers: the ledgers of the clients the request is made through (the service's
                own ledger always counts it).
            work: usage counts of the work, counted only if ``fn`` returns.
            bill: ``bill(result)`` returns further counts that depend on the result.
        """
        ledgers = (self.ledger, *ledgers)

        async def request():
            if after is not None:
                try:
                    await asyncio.wrap_future(after)
                except BaseException:  # noqa: BLE001 - ordering only; the earlier failure was reported there
                    pass
            if self.options.latency > 0:
                await asyncio.sleep(self.options.latency)
            counts = {"requests": 1}
            try:
                result = await asyncio.wrap_future(
                    self._sample_batched(batched) if batched is not None else self._compute(fn))
            except BaseException:
                _account(ledgers, counts)  # it reached the service; its work failed there
                raise
            counts.update(work or {})
            if bill is not None:
                counts.update(bill(result))
            _account(ledgers, counts)
            return result

        return asyncio.run_coroutine_threadsafe(request(), self.loop)


def _account(ledgers: tuple[Ledger, ...], counts: dict[str, float]) -> None:
    for ledger in ledgers:
        ledger.add(counts)


def _unknown_model_error(name: str) -> ValidationError:
    return ValidationError(
        f"unknown base model {name!r} on the offline backend. Offline catalog: {', '.join(catalog.model_names())}. "
        "Use one of these names, or run on the real service (TRIO_BACKEND=remote) for other models.",
        code="validation.unsupported_model",
        details={"base_model": name, "supported_models": catalog.model_names()},
    )


def _check_model(name: str) -> str:
    if not isinstance(name, str) or name not in catalog.model_names():
        raise _unknown_model_error(str(name))
    return name


class OfflineServiceClient:
    """Offline twin of ``pytrio.ServiceClient`` (create one with ``trio_helpers.connect("offline")``)."""

    def __init__(self, options: OfflineOptions | None = None) -> None:
        self.options = options or OfflineOptions()
        self._runtime = _Runtime(self.options)
        self.backend = "offline"

    def __repr__(self) -> str:
        return f"OfflineServiceClient(latency={self.options.latency})"

    def usage(self) -> Usage:
        """What this service has served so far (``trio_helpers.offline.ledger.Usage``)."""
        return self._runtime.ledger.snapshot()

    def _control(self, build, kind: str, via: tuple[Ledger, ...] = ()) -> Future:
        """A control call creating a ``kind`` ("training" or "sampling") run: one request, then ``build``.

        ``via``: the ledgers of the client the call is made through, if any.
        """
        return self._runtime.submit(build, ledgers=via, work={f"{kind}_runs": 1})

    # --- catalog -------------------------------------------------------------------------------------------
    def get_supported_models(self) -> list[str]:
        """Model names the offline backend serves."""
        return catalog.model_names()

    # --- training clients ------------------------------------------------------------------------------------
    def _lora_request(self, base_model, rank, seed) -> Future:
        if rank not in range(4, 65):
            raise ValidationError(f"rank must be in [4, 64]. Got {rank}",
                                  code="validation.invalid_lora_rank")
        _check_model(base_model)

        def build() -> OfflineTrainingClient:
            base = catalog.base_weights(base_model, self.options.home)
            alpha, row_scale = catalog.adapter_scales(base_model)
            adapter = Adapter.fresh(base.dim, rank, seed=0 if seed is None else seed,
                                    alpha=alpha, final_row_scale=row_scale)
            return OfflineTrainingClient(self, base_model, adapter, rank=rank, seed=seed)

        return self._control(build, "training")

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> "OfflineTrainingClient":
        return self._lora_request(base_model, rank, seed).result()

    async def create_lora_training_client_async(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> "OfflineTrainingClient":
        return await asyncio.wrap_future(self._lora_request(base_model, rank, seed))

    def create_training_client_from_state(self, path: str) -> "OfflineTrainingClient":
        return self._from_state(path, with_optimizer=False).result()

    async def create_training_client_from_state_async(self, path: str) -> "OfflineTrainingClient":
        return await asyncio.wrap_future(self._from_state(path, False))

    def create_training_client_from_state_with_optimizer(self, path: str) -> "OfflineTrainingClient":
        return self._from_state(path, with_optimizer=True).result()

    async def create_training_client_from_state_with_optimizer_async(self, path: str) -> "OfflineTrainingClient":
        return await asyncio.wrap_future(self._from_state(path, True))

    def _from_state(self, path: str, with_optimizer: bool) -> Future:
        ckpt = _load_checkpoint(self.options.home, path, kind="state")
        meta = ckpt["meta"]

        def build() -> OfflineTrainingClient:
            catalog.base_weights(meta["base_model"], self.options.home)
            client = OfflineTrainingClient(self, meta["base_model"], _adapter_from(ckpt),
                                           rank=int(meta["rank"]), seed=meta.get("seed"))
            if with_optimizer:
                client._adam = _unpack_adam(ckpt)
            return client

        return self._control(build, "training")

    # --- sampling clients ------------------------------------------------------------------------------------
    def _sampling_request(self, base_model: str, model_path: str | None,
                          via: tuple[Ledger, ...] = ()) -> Future:
        _check_model(base_model)
        adapter = None
        if model_path is not None:
            ckpt = _load_checkpoint(self.options.home, model_path, kind="weights")
            if ckpt["meta"]["base_model"] != base_model:
                raise ValidationError(
                    f"checkpoint {model_path!r} was trained from {ckpt['meta']['base_model']!r}, not {base_model!r}: "
                    "pass the base model the weights were trained from.",
                    code="validation.checkpoint_model_mismatch",
                )
            adapter = _adapter_from(ckpt)

        def build() -> OfflineSamplingClient:
            base = catalog.base_weights(base_model, self.options.home)
            return OfflineSamplingClient(self, base_model, TinyLM(base, adapter, frozen=True),
                                         model_path=model_path)

        return self._control(build, "sampling", via)

    def create_sampling_client(
        self, base_model: str, model_path: str | None = None
    ) -> "OfflineSamplingClient":
        return self._sampling_request(base_model, model_path).result()

    async def create_sampling_client_async(
        self, base_model: str, model_path: str | None = None
    ) -> "OfflineSamplingClient":
        return await asyncio.wrap_future(self._sampling_request(base_model, model_path))


# --- checkpoints -----------------------------------------------------------------------------------------------
def _checkpoint_file(home: Path, uri: str) -> Path:
    if not isinstance(uri, str) or not uri.startswith(URI_SCHEME):
        raise ValidationError(
            f"{uri!r} is not an offline checkpoint path; offline paths look like "
            f"'{URI_SCHEME}<run>/weights/<name>' or '{URI_SCHEME}<run>/state/<name>' (as returned by "
            "save_weights_for_sampler / save_state).",
            code="validation.invalid_checkpoint_path",
        )
    rel = uri[len(URI_SCHEME):]
    parts = rel.split("/")
    if len(parts) != 3 or parts[1] not in ("weights", "state") or not all(parts) or ".." in parts:
        raise ValidationError(
            f"malformed offline checkpoint path {uri!r}: expected '{URI_SCHEME}<run>/weights|state/<name>'.",
            code="validation.invalid_checkpoint_path",
        )
    return home / "checkpoints" / parts[0] / parts[1] / f"{parts[2]}.npz"


def _load_checkpoint(home: Path, uri: str, kind: str) -> dict:
    path = _checkpoint_file(home, uri)
    if kind == "state" and "/weights/" in uri:
        raise ValidationError(
            f"{uri!r} holds sampler weights only; training state (with optimizer) comes from save_state(...).path.",
            code="validation.invalid_checkpoint_path",
        )
    if not path.exists():
        raise ValidationError(
            f"no offline checkpoint at {uri!r} (looked in the offline home {path.parent.parent.parent.name}/). "
            "Check the path returned by save_weights_for_sampler/save_state, and that TRIO_OFFLINE_HOME matches.",
            code="validation.checkpoint_not_found",
        )
    with np.load(path, allow_pickle=False) as z:
        out = {k: z[k] for k in z.files}
    out["meta"] = json.loads(str(out.pop("meta_json")))
    return out


ADAPTER_PARAMS = ("A", "B", "C")


def _adapter_from(ckpt: dict) -> Adapter:
    meta = ckpt["meta"]
    return Adapter(A=ckpt["A"].copy(), B=ckpt["B"].copy(), C=ckpt["C"].copy(), scale=float(meta["scale"]),
                   c_scale=float(meta["c_scale"]))


def _unpack_adam(ckpt: dict) -> dict:
    state: dict = {}
    if "adam_step" in ckpt:
        state["step"] = int(ckpt["adam_step"])
        for name in ADAPTER_PARAMS:
            state[("m", name)] = ckpt[f"adam_m_{name}"].copy()
            state[("v", name)] = ckpt[f"adam_v_{name}"].copy()
    return state


def _logprob_tensor(logprobs: np.ndarray) -> TensorData:
    """A float32 ``TensorData`` of per-token logprobs, built without pydantic's validation.

    ``TensorData``'s validator tries ``import torch`` on every construction. On the compute thread that matters:
    without torch installed each try takes Python's import lock for the name, and if a garbage collection during it
    finalizes an earlier pytrio client (its session close runs on that client's event loop, which imports too), the
    two threads wait for each other (the test suite hung so with the loopback server). The fields are those
    ``TensorData.from_numpy`` sets, so the value is the same.
    """
    array = np.asarray(logprobs, dtype=np.float32)
    return TensorData.model_construct(data=array.reshape(-1).tolist(), dtype="float32", shape=list(array.shape))


class OfflineTrainingClient:
    """Offline twin of ``pytrio.TrainingClient``: a LoRA adapter on a frozen offline base model."""

    def __init__(self, service: OfflineServiceClient, base_model: str, adapter: Adapter, rank: int, seed) -> None:
        self._service = service
        self._runtime = service._runtime
        self.model_id = base_model
        self.base_model = base_model
        self.rank = rank
        self.seed = seed
        self.run_id = f"run-{uuid.uuid4().hex[:8]}"
        self._model = TinyLM(catalog.base_weights(base_model, service.options.home), adapter)
        self._grads: dict[str, np.ndarray] | None = None
        self._adam: dict = {}
        self._tail: Future | None = None
        self._started = False  # set by the first queued operation; load_state* must come before it (as in pytrio)
        self._order = threading.Lock()
        self._ledger = Ledger()

    def usage(self) -> Usage:
        """What this training client's requests used (``offline.ledger.Usage``)."""
        return self._ledger.snapshot()

    def __repr__(self) -> str:
        return f"OfflineTrainingClient(base_model={self.base_model!r}, rank={self.rank}, run={self.run_id!r})"

    # ordering: every operation of one training client runs after the previous one, like the service's queue
    def _submit(self, fn, work: dict[str, int] | None = None) -> APIFuture:
        return APIFuture(self._submit_future(fn, work))

    def _submit_future(self, fn, work: dict[str, int] | None = None) -> Future:
        with self._order:
            fut = self._runtime.submit(fn, after=self._tail, ledgers=(self._ledger,), work=work)
            self._tail = fut
            self._started = True
        return fut

    def _check_not_started(self) -> None:
        # pytrio binds the checkpoint at trainer initialisation, so it refuses load_state once any operation ran
        if self._started:
            raise ValidationError(
                "load_state cannot be called after training has started. "
                "Call load_state before the first training operation.",
                code="validation.already_initialized",
            )

    def get_tokenizer(self) -> object:
        return get_offline_tokenizer()

    # --- forward / backward ------------------------------------------------------------------------------
    def _plan(self, data, loss_fn, loss_fn_config, auto_shift):
        if not isinstance(data, list):
            raise TypeError(f"data must be a list of pytrio.Datum, got {type(data).__name__}")
        for i, d in enumerate(data):
            if not isinstance(d, Datum):
                raise TypeError(f"data[{i}] must be a pytrio.Datum, got {type(d).__name__}")
        plan = plan_training_batch(
            data, loss_fn=loss_fn, auto_shift=auto_shift, limits=TRAINING_LIMITS, tokenizer_vocab_size=VOCAB_SIZE
        )
        name = normalize_loss_fn(loss_fn)
        return plan, name, resolve_loss_config(name, loss_fn_config)

    def _forward_impl(self, plan, name, cfg, auto_shift, backward: bool) -> ForwardBackwardOutput:
        result = run_batch(self._model, plan, name, cfg, auto_shift, backward)
        if backward:
            if self._grads is None:
                self._grads = result.grads
            else:
                for k, g in result.grads.items():
                    self._grads[k] += g
        return ForwardBackwardOutput(
            loss_fn_outputs=[
                {"logprobs": _logprob_tensor(lp)} for lp in result.per_sample_logprobs
            ],
            metrics={
                "loss_sum": result.loss_sum,
                "loss_mean": result.loss_sum / result.token_count if result.token_count else 0.0,
                "token_count": result.token_count,
            },
        )

    def forward(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        plan, name, cfg = self._plan(data, loss_fn, loss_fn_config, auto_shift)
        work = _token_counts(data, plan, "forward")
        return self._submit(lambda: self._forward_impl(plan, name, cfg, auto_shift, False), work)

    async def forward_async(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        return self.forward(data, loss_fn, loss_fn_config, auto_shift)

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        plan, name, cfg = self._plan(data, loss_fn, loss_fn_config, auto_shift)
        work = _token_counts(data, plan, "forward_backward")
        return self._submit(lambda: self._forward_impl(plan, name, cfg, auto_shift, True), work)

    async def forward_backward_async(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward(data, loss_fn, loss_fn_config, auto_shift)

    # --- optimizer ---------------------------------------------------------------------------------------
    def _optim_impl(self, hp: AdamParams) -> OptimStepResponse:
        grads = self._grads or {k: np.zeros_like(v) for k, v in self._model.adapter.params().items()}
        metrics = adamw_step(self._model.adapter.params(), grads, self._adam, hp)
        self._grads = None
        return OptimStepResponse(metrics=metrics)

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        if not isinstance(adam_params, AdamParams):
            raise TypeError(f"adam_params must be a pytrio.AdamParams, got {type(adam_params).__name__}")
        return self._submit(lambda: self._optim_impl(adam_params), {"optim_steps": 1})

    async def optim_step_async(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        return self.optim_step(adam_params)

    # --- checkpoints -------------------------------------------------------------------------------------
    def _write(self, kind: str, name: str, with_optimizer: bool, overwrite: bool) -> tuple[str, int]:
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise ValueError(f"checkpoint name must be a non-empty string without '/', got {name!r}")
        uri = f"{URI_SCHEME}{self.run_id}/{kind}/{name}"
        path = _checkpoint_file(self._service.options.home, uri)
        if path.exists() and not overwrite:
            raise ValidationError(
                f"checkpoint {uri!r} already exists; pass overwrite=True or choose another name.",
                code="validation.checkpoint_exists",
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        a = self._model.adapter
        meta = {"base_model": self.base_model, "rank": self.rank, "scale": a.scale, "c_scale": a.c_scale,
                "seed": self.seed, "kind": kind}
        arrays = {**a.params(), "meta_json": np.array(json.dumps(meta))}
        if with_optimizer and self._adam:
            arrays["adam_step"] = np.array(self._adam["step"])
            for n in ADAPTER_PARAMS:
                arrays[f"adam_m_{n}"] = self._adam[("m", n)]
                arrays[f"adam_v_{n}"] = self._adam[("v", n)]
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
        return uri, path.stat().st_size

    def save_weights_for_sampler(
        self, name: str, ttl_seconds: int | None = None
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        def save():
            uri, size = self._write("weights", name, with_optimizer=False, overwrite=True)
            return SaveWeightsForSamplerResponse(path=uri, model=self.base_model, size=size)

        return self._submit(save, {"sampler_weights_saved": 1})

    async def save_weights_for_sampler_async(
        self, name: str, ttl_seconds: int | None = None
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        return self.save_weights_for_sampler(name, ttl_seconds)

    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture[SaveWeightsResponse]:
        def save():
            uri, size = self._write("state", name, with_optimizer=True, overwrite=overwrite)
            return SaveWeightsResponse(path=uri, model=self.base_model, size=size)

        return self._submit(save, {"states_saved": 1})

    async def save_state_async(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture[SaveWeightsResponse]:
        return self.save_state(name, ttl_seconds, overwrite)

    def _load_impl(self, path: str, with_optimizer: bool) -> dict[str, object]:
        ckpt = _load_checkpoint(self._service.options.home, path, kind="state")
        if ckpt["meta"]["base_model"] != self.base_model or int(ckpt["meta"]["rank"]) != self.rank:
            raise ValidationError(
                f"checkpoint {path!r} is for {ckpt['meta']['base_model']!r} rank {ckpt['meta']['rank']}, but this "
                f"client trains {self.base_model!r} rank {self.rank}.",
                code="validation.checkpoint_model_mismatch",
            )
        self._model.adapter = _adapter_from(ckpt)
        self._grads = None
        self._adam = _unpack_adam(ckpt) if with_optimizer else {}
        return {"path": path, "optimizer_loaded": with_optimizer}

    def load_state(self, path: str) -> APIFuture[dict[str, object]]:
        self._check_not_started()
        _checkpoint_file(self._service.options.home, path)
        return self._submit(lambda: self._load_impl(path, False))

    async def load_state_async(self, path: str) -> APIFuture[dict[str, object]]:
        return self.load_state(path)

    def load_state_with_optimizer(self, path: str) -> APIFuture[dict[str, object]]:
        self._check_not_started()
        _checkpoint_file(self._service.options.home, path)
        return self._submit(lambda: self._load_impl(path, True))

    async def load_state_with_optimizer_async(self, path: str) -> APIFuture[dict[str, object]]:
        return self.load_state_with_optimizer(path)

    # --- samplers ----------------------------------------------------------------------------------------
    def _snapshot_sampler(self, snapshot: Adapter) -> Future:
        def build() -> OfflineSamplingClient:
            model = TinyLM(self._model.base, snapshot, frozen=True)
            return OfflineSamplingClient(self._service, self.base_model, model)

        return self._service._control(build, "sampling", (self._ledger,))

    def save_weights_and_get_sampling_client(self) -> "OfflineSamplingClient":
        """Snapshot the current adapter into a new sampler (later training leaves it alone).

        Two requests, as in pytrio: a training event saving the weights, then a control
        call.
        """
        snapshot = self._submit_future(lambda: self._model.adapter.copy(), {"sampler_snapshots": 1}).result()
        return self._snapshot_sampler(snapshot).result()

    async def save_weights_and_get_sampling_client_async(self) -> "OfflineSamplingClient":
        copy = self._submit_future(lambda: self._model.adapter.copy(), {"sampler_snapshots": 1})
        snapshot = await asyncio.wrap_future(copy)
        return await asyncio.wrap_future(self._snapshot_sampler(snapshot))

    def create_sampling_client(self, model_path: str) -> "OfflineSamplingClient":
        return self._service._sampling_request(self.base_model, model_path,
                                               (self._ledger,)).result()

    async def create_sampling_client_async(self, model_path: str) -> "OfflineSamplingClient":
        fut = self._service._sampling_request(self.base_model, model_path, (self._ledger,))
        return await asyncio.wrap_future(fut)


def _stop_spec(stop) -> tuple[frozenset[int], tuple[bytes, ...]]:
    ids = {IM_END_ID, ENDOFTEXT_ID}  # the model's end-of-turn tokens always stop, as on the service
    strings: list[bytes] = []
    if stop is None:
        pass
    elif isinstance(stop, str):
        strings.append(stop.encode())
    else:
        for item in stop:
            if isinstance(item, bool):
                raise TypeError("SamplingParams.stop items must be str or int token ids, got bool")
            if isinstance(item, int):
                if not 0 <= item < VOCAB_SIZE:
                    raise ValidationError(
                        f"stop token id {item} is outside the vocabulary [0, {VOCAB_SIZE})",
                        code="validation.invalid_sampling_request",
                    )
                ids.add(item)
            else:
                strings.append(str(item).encode())
    return frozenset(ids), tuple(s for s in strings if s)


class OfflineSamplingClient:
    """Offline twin of ``pytrio.SamplingClient``: samples from a frozen snapshot of weights."""

    def __init__(self, service: OfflineServiceClient, base_model: str, model: TinyLM, model_path: str | None = None):
        self._service = service
        self._runtime = service._runtime
        self.model_id = base_model
        self.base_model = base_model
        self.model_path = model_path
        # an inference engine's numerics, if the service asks for them (off by default)
        self._model = sampler_model(model, service.options.sampler_logit_precision)
        self._ledger = Ledger()

    def usage(self) -> Usage:
        """What this sampling client's requests used (``offline.ledger.Usage``)."""
        return self._ledger.snapshot()

    def __repr__(self) -> str:
        return f"OfflineSamplingClient(base_model={self.base_model!r}, model_path={self.model_path!r})"

    def get_tokenizer(self) -> object:
        return get_offline_tokenizer()

    @staticmethod
    def _validate_prompt(prompt: ModelInput) -> list[int]:
        if not isinstance(prompt, ModelInput):
            raise TypeError(
                f"prompt must be a pytrio.ModelInput (e.g. ModelInput.from_ints(tokens)), got {type(prompt).__name__}"
            )
        if prompt.is_empty:
            raise ValidationError("prompt cannot be empty", code="validation.empty_prompt")
        tokens = prompt.to_ints()
        bad = [t for t in tokens if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise ValidationError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {VOCAB_SIZE})",
                code="validation.token_id_out_of_range",
            )
        return tokens

    def _default_seed(self) -> int:
        """The next seed of the service's stream, drawn when a request is submitted (not
        when it runs), so that retries and timing never reorder it."""
        return next(self._runtime.request_counter) + 1_000_003 * self._service.options.seed

    def _sample_job(self, tokens, num_samples, sp: SamplingParams, include_prompt_logprobs,
                    topk, return_text, seed: int):
        """The request as a batching-engine job: ``(start, finish)``."""

        def start() -> SampleJob:
            ids, strings = _stop_spec(sp.stop)
            return SampleJob(
                self._model, tokens, num_samples, int(sp.max_tokens),
                np.random.default_rng([int(seed), 0x5A4D]),
                temperature=float(sp.temperature), top_k=int(sp.top_k), top_p=float(sp.top_p),
                stop_token_ids=ids, stop_strings=strings,
            )

        def finish(job: SampleJob) -> SampleResponse:
            return self._response(tokens, job.out, include_prompt_logprobs, topk, return_text)

        return start, finish

    def _response(self, tokens, comps, include_prompt_logprobs, topk, return_text) -> SampleResponse:
        tok = get_offline_tokenizer() if return_text else None
        prompt_lp: list[float | None] = []
        topk_lp: list[list[tuple[int, float]] | None] = []
        if include_prompt_logprobs or topk > 0:
            all_lp = self._prompt_logprobs(tokens)
            if include_prompt_logprobs:
                prompt_lp = [None] + [float(all_lp[i - 1, tokens[i]]) for i in range(1, len(tokens))]
            if topk > 0:
                top = np.argsort(-all_lp, axis=-1, kind="stable")[:, :topk]
                topk_lp = [None] + [
                    [(int(t), float(all_lp[i - 1, t])) for t in top[i - 1]] for i in range(1, len(tokens))
                ]
        return SampleResponse(
            sequences=[
                SampleSequence(
                    stop_reason=c.stop_reason,
                    tokens=c.tokens,
                    text=tok.decode(c.tokens, skip_special_tokens=True) if tok else None,
                    logprobs=c.logprobs,
                )
                for c in comps
            ],
            prompt_logprobs=prompt_lp,
            topk_prompt_logprobs=topk_lp,
            input_tokens=len(tokens),
            output_tokens=sum(len(c.tokens) for c in comps),
        )

    def _prompt_logprobs(self, tokens: list[int]) -> np.ndarray:
        keys, _ = sequence_features(tokens)
        _, logp = self._model.logprobs_all(keys[:-1]) if len(tokens) > 1 else (None, np.zeros((0, VOCAB_SIZE)))
        return logp

    def _submit_sample(self, prompt, num_samples, sampling_params, include_prompt_logprobs, topk, return_text):
        tokens = self._validate_prompt(prompt)
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a pytrio.SamplingParams, got {type(sampling_params).__name__}")
        check_sampling_request(tokens, num_samples, sampling_params, topk)
        _stop_spec(sampling_params.stop)
        seed = sampling_params.seed
        if seed is None:
            seed = self._default_seed()
        fut = self._runtime.submit(
            None, batched=self._sample_job(tokens, num_samples, sampling_params,
                                           include_prompt_logprobs, topk, return_text, seed),
            ledgers=(self._ledger,),
            work={"samples": num_samples, "prompt_tokens": len(tokens)},
            bill=_sampled_tokens,
        )
        return APIFuture(fut)

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = SamplingParams(),
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> APIFuture[SampleResponse]:
        return self._submit_sample(
            prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs, return_text
        )

    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = SamplingParams(),
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> SampleResponse:
        return await self._submit_sample(
            prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs, return_text
        )

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        tokens = self._validate_prompt(prompt)

        def run() -> list[float | None]:
            if len(tokens) < 2:
                return [None]
            keys = sequence_rows(tokens[:-1])  # the contexts of tokens[1:]
            _, shifted, norm = self._model.log_softmax_parts(keys)  # log_softmax = shifted - norm
            nxt = np.asarray(tokens[1:])
            return [None] + (shifted[np.arange(len(nxt)), nxt] - norm[:, 0]).tolist()

        return APIFuture(self._runtime.submit(
            run, ledgers=(self._ledger,),
            work={"logprob_tokens": len(tokens)},
        ))

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        return await self.compute_logprobs(prompt)


def _sampled_tokens(response: SampleResponse) -> dict[str, int]:
    return {"sampled_tokens": sum(len(seq.tokens) for seq in response.sequences)}


def _token_counts(data: list[Datum], plan, kind: str) -> dict[str, int]:
    """Model-input tokens of a training call, and the active ones (as pytrio's planner)."""
    return {f"{kind}_tokens": sum(d.model_input.length for d in data),
            f"{kind}_active_tokens": int(plan.totals.total_active_tokens)}


def check_sampling_request(tokens: list[int], num_samples: int, sampling_params: SamplingParams, topk: int) -> None:
    """The offline backend's checks of a sampling request (in-process and on the offline server alike).

    Raises:
        ValidationError: ``max_tokens`` not positive, ``num_samples`` or ``topk`` out of range, a prompt plus
            ``max_tokens`` beyond ``MAX_SEQ_LEN``, or a temperature, top-p or top-k that no sampler accepts.
    """
    if sampling_params.max_tokens is None or sampling_params.max_tokens <= 0:
        raise ValidationError(
            "sampling_params.max_tokens must be greater than 0", code="validation.invalid_sampling_request"
        )
    if num_samples < 1 or topk_prompt_logprobs_invalid(topk):
        raise ValidationError(
            f"num_samples must be >= 1 and topk_prompt_logprobs >= 0 (got {num_samples}, {topk})",
            code="validation.invalid_sampling_request",
        )
    if len(tokens) + sampling_params.max_tokens > MAX_SEQ_LEN:
        raise ValidationError(
            f"prompt ({len(tokens)} tokens) + sampling_params.max_tokens ({sampling_params.max_tokens}) exceeds "
            f"the model's max_seq_len {MAX_SEQ_LEN}; lower max_tokens",
            code="validation.invalid_sampling_request",
        )
    if not all(math.isfinite(v) for v in (sampling_params.temperature, sampling_params.top_p)) \
            or sampling_params.temperature < 0 or not 0 < sampling_params.top_p <= 1 \
            or sampling_params.top_k == 0:
        raise ValidationError(
            "invalid sampling parameters: need a finite temperature >= 0, 0 < top_p <= 1 and top_k = -1 or >= 1 "
            f"(got temperature={sampling_params.temperature}, top_p={sampling_params.top_p}, "
            f"top_k={sampling_params.top_k})",
            code="validation.invalid_sampling_request",
        )


def topk_prompt_logprobs_invalid(topk: int) -> bool:
    return not isinstance(topk, int) or topk < 0
