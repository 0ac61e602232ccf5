"""A loopback server that speaks pytrio 0.2.9's wire protocol, so pytrio's own client runs offline.

pytrio's unmodified ``ServiceClient`` talks to it exactly as to the service: the control plane (JSON under
``/api``: api-key verify, SDK bootstrap, service sessions, the model list, training and sampling runs) and the
actor plane (``POST /v1/events`` with msgpack envelopes, ``GET /v1/events/{id}`` long polls, heartbeats,
``POST /v1/sampling-runs/{id}/sample``). Requests and responses are parsed and built with pytrio's own protocol
models (``pytrio.protocol``), so a pytrio upgrade that changes the protocol fails a test instead of drifting.

The work is the offline backend's (``trio_helpers.offline.service``): its model, batching sampler, losses, AdamW,
checkpoints and usage ledger, on its one compute thread. Training events of a run execute in the order they
arrive (pytrio serializes a run's submits); an event id is an idempotency key: a re-sent event is answered 409
``event_exists`` and never runs twice, and a re-sent sampling request (same ``request_id``) gets the first answer.

Faults are decided per request from the seed and what identifies the request (never from arrival order):
``fault_rate`` answers an attempt with HTTP 503, either before its work (nothing happens) or after it (the work is
done and kept; the retry finds it); ``outage_after=N`` answers 503 to everything from the N-th new request on.
pytrio retries both with its own backoff and windows (``pytrio.configure``), as on the service.

Start one with ``OfflineServer(options=...).start()`` and get pytrio's client for it with :func:`service_client`
(``trio_helpers.connect("offline")`` does both); ``python -m trio_helpers.offline.serve`` runs one standalone. A
process has one listener (a daemon thread on a free port of 127.0.0.1) for all its servers: each server, with its
own options, runs, ledger and faults, answers under its own path (its base URL ends in ``/offline-<n>``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import msgpack
from pytrio.client.training_batch import (CrossEntropyTrainingSample, GradientAccumulationTotals,
                                          PolicyTrainingSample, TrainingBatchChunk, TrainingBatchPlan,
                                          normalize_loss_fn)
from pytrio.errors.base import PyTrioError, ValidationError
from pytrio.protocol.actor.events.codec import payload_model_for_event
from pytrio.protocol.actor.events.event import (EVENT_PROTOCOL_VERSION, EventAcceptedResponse, EventEnvelope,
                                                EventError, EventFailedResponse, EventRunningResponse, EventStatus,
                                                EventSucceededResponse, EventType, EventUsage)
from pytrio.protocol.actor.events.tensor import WireTensorData
from pytrio.protocol.actor.events.trainer.forward import (TrainerForwardMetrics, TrainerForwardResult)
from pytrio.protocol.actor.events.trainer.save import TrainerCheckpointResult, TrainerSaveResult
from pytrio.protocol.actor.model_input import WireEncodedTextChunk, WireModelInput
from pytrio.protocol.actor.sampling_run.sample import (ActorSampleResponse, ActorSampleSequence, SampleRequest,
                                                       Usage as WireUsage)
from pytrio.protocol.control.actor.credentials import ActorConnectionInfo, ActorJWT
from pytrio.protocol.control.api_key.verify import APIKeyInfo
from pytrio.protocol.control.model.list import ModelInfo, ModelListResponse, ModelRunnerCapability
from pytrio.protocol.control.platform.bootstrap import SDKBootstrapResponse, SDKCompatibilityResponse
from pytrio.protocol.control.sampling_run.create import SamplingRunCreateRequest, SamplingRunCreateResponse
from pytrio.protocol.control.sampling_run.renew import SamplingRunRenewResponse
from pytrio.protocol.control.service_session.close import ServiceSessionCloseRequest
from pytrio.protocol.control.service_session.create import (ServiceSessionCreateRequest,
                                                            ServiceSessionCreateResponse)
from pytrio.protocol.control.training_run.create import TrainingRunCreateRequest, TrainingRunCreateResponse
from pytrio.protocol.control.training_run.find_by_checkpoint_uri import TrainingRunFindByCheckpointURIResponse
from pytrio.protocol.control.training_run.renew import TrainingRunRenewResponse
from pytrio.protocol.control.training_run.update import TrainingRunUpdateRequest, TrainingRunUpdateResponse
from pytrio.types import AdamParams, ModelInput, SamplingParams

from trio_helpers.offline import catalog
from trio_helpers.offline.ledger import Usage
from trio_helpers.offline.losses import resolve_loss_config
from trio_helpers.offline.model import Adapter, TinyLM
from trio_helpers.offline.service import (MAX_SEQ_LEN, URI_SCHEME, OfflineOptions, OfflineSamplingClient,
                                          OfflineServiceClient, OfflineTrainingClient, _account, _adapter_from,
                                          _load_checkpoint, _stop_spec, check_sampling_request)
from trio_helpers.offline.tokenizer import get_offline_tokenizer

# The placeholder credential of the book's own 127.0.0.1 server; the server accepts nothing else. It is never a
# key of the real service and is set in code for this server only (see service_client).
OFFLINE_API_KEY = "trio-offline-local-key"
JWT_LIFETIME = timedelta(days=1)  # pytrio renews a JWT that expires within 300 s before every request
TEMPORARY = "TEMPORARY"


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _unit(*parts: object) -> float:
    """A number in [0, 1) determined by ``parts`` (the seeded fault draws)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


_CHECKPOINT_URI = re.compile(re.escape(URI_SCHEME) + r'[^"\s]+')  # a checkpoint URI, whole (in text or JSON)
_LIVE: dict[str, "OfflineServer"] = {}  # base URL -> every server of this process that has not been stopped


class HTTPError(Exception):
    """Answer the request with ``status`` and a JSON body ``{"code", "message"}``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class _Run:
    """A training or sampling run as Control and the actor see it."""

    cuid: str
    kind: str  # "training" or "sampling"
    session: str
    base_model: str
    index: int
    request: object  # the create request (pytrio's protocol model)
    token: str
    state: object = None  # OfflineTrainingClient (training) or OfflineSamplingClient (sampling), built lazily
    ended: bool = False
    heartbeats: int = 0
    last_heartbeat: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Event:
    envelope: EventEnvelope
    future: Future
    executions: int = 0


class OfflineServer:
    """The loopback PyTRIO-compatible server (see the module docstring).

    Args:
        port: TCP port on 127.0.0.1 (0: a free one).
        options: the offline backend's options (``home`` for checkpoints, ``seed``,
            ``sampler_logit_precision``); its ``latency``, ``fault_rate`` and ``outage_after`` are the
            server's: each attempt of a request the ledger counts (runs created, training events, samples)
            waits ``latency`` seconds; any attempt may be answered 503.
        fault_after_share: of the faulted attempts, the share answered 503 *after* their work (the rest before).
    """

    def __init__(self, port: int = 0, options: OfflineOptions | None = None, fault_after_share: float = 0.5) -> None:
        self.options = options or OfflineOptions(latency=0.0)
        # the in-process backend supplies the compute thread, the batching sampler and the ledger
        self._backend = OfflineServiceClient(OfflineOptions(
            latency=0.0, seed=self.options.seed, home=self.options.home,
            sampler_logit_precision=self.options.sampler_logit_precision))
        self._runtime = self._backend._runtime
        self.fault_after_share = fault_after_share
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._tokens: dict[str, _Run] = {}
        self._sessions: dict[str, str] = {}  # cuid -> status
        self._events: dict[str, _Event] = {}
        self._samples: dict[str, Future] = {}  # request_id -> the response (a retried request is answered again)
        # uri -> (adapter, meta) of weights saved with visibility TEMPORARY (sampler snapshots, kept in memory)
        self._temporary: dict[str, tuple[Adapter, dict]] = {}
        self._attempts: Counter = Counter()
        self._occurrences: Counter = Counter()
        # checkpoint URIs hold random parts (pytrio's temp-sampling names, the offline run ids); a URI this server
        # wrote is known by what made it instead (training run, event index), so faults and default seeds that
        # depend on a request's content are the same in every run
        self._identities: dict[str, str] = {}
        self._new_requests = itertools.count()
        self._ids = itertools.count(1)
        self.outage = False
        self.stats: Counter = Counter()  # faults_before, faults_after, event_exists, ... (for tests and the CLI)
        # port 0: the process's one listener, shared by every server of the process, each under its own path
        self._listener = _Listener(port) if port else _shared_listener()
        self.base_url = self._listener.new_url()
        _LIVE[self.base_url] = self

    # --- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> "OfflineServer":
        """Serve (the listener's daemon thread, started once); returns self."""
        self._listener.start()
        return self

    def serve_forever(self) -> None:
        """Serve until interrupted (Ctrl-C)."""
        self._listener.start().join()

    def stop(self) -> None:
        """Stop answering: this server's path answers 404 from now on (a listener of its own shuts down)."""
        _LIVE.pop(self.base_url, None)
        if self._listener.own:
            self._listener.httpd.shutdown()
            self._listener.httpd.server_close()

    def usage(self) -> Usage:
        """What the server has served (the offline ledger's ``Usage``)."""
        return self._runtime.ledger.snapshot()

    def runs(self) -> dict[str, dict[str, object]]:
        """Every run: kind, base model, whether its session ended, heartbeats received."""
        with self._lock:
            return {r.cuid: {"kind": r.kind, "base_model": r.base_model, "ended": r.ended,
                             "heartbeats": r.heartbeats} for r in self._runs.values()}

    def executions(self) -> dict[str, int]:
        """How often each event's work ran (1 each, however often it was sent)."""
        with self._lock:
            return {eid: e.executions for eid, e in self._events.items()}

    # --- faults -----------------------------------------------------------------------------------------------
    def stable(self, text: str) -> str:
        """``text`` with every checkpoint URI this server wrote replaced by what made it (see ``_identities``):
        one pass over the text, each URI looked up whole."""
        return _CHECKPOINT_URI.sub(lambda m: self._identities.get(m[0], m[0]), text)

    def fault(self, key: tuple, new_request: bool, may_fail: bool = True) -> str | None:
        """``"before"``, ``"after"`` or None for one attempt of the request identified by ``key``.

        ``new_request``: a request the ledger counts (the calls a program makes: runs created, events, samples),
        numbered in order of arrival for ``outage_after`` (the order the ledger counts them). pytrio's own
        requests (its session, the lazy ``trainer.init_run``, renewals, polls, heartbeats) are not numbered,
        but fail like the others once an outage has begun. Each attempt of a counted request first waits the
        simulated ``latency``; pytrio's own requests do not.

        ``may_fail``: whether ``fault_rate`` applies (training events and samples, and the control calls that
        create or rebind runs). pytrio's polls, heartbeats and session calls fail only in an outage: their number
        depends on timing, so their faults would make the ledger's retries differ between runs. ``key`` holds
        what identifies the request, never a random id, so the same seed faults the same attempts.
        """
        if new_request and self.options.latency:
            time.sleep(self.options.latency)
        with self._lock:
            attempt = self._attempts[key]
            self._attempts[key] += 1
            if new_request and attempt == 0:
                n = next(self._new_requests)
                self.stats["new_requests"] += 1
                if self.options.outage_after is not None and n >= self.options.outage_after:
                    self.outage = True
            if self.outage:
                self.stats["faults_before"] += 1
                _account((self._runtime.ledger,), {"retries": 1})
                return "before"
        seed = self.options.seed
        if may_fail and self.options.fault_rate and _unit(seed, "fault", key, attempt) < self.options.fault_rate:
            when = "after" if _unit(seed, "when", key, attempt) < self.fault_after_share else "before"
            self.stats[f"faults_{when}"] += 1
            _account((self._runtime.ledger,), {"retries": 1})  # the ledger's retries: attempts answered 503
            return when
        return None

    def unavailable(self) -> HTTPError:
        """The 503 answer of a faulted attempt, saying which fault it is."""
        if self.outage:
            return HTTPError(503, "unavailable", f"offline server: simulated outage, HTTP 503 to every request from "
                                                 f"request {self.options.outage_after} on (outage_after)")
        return HTTPError(503, "unavailable", "offline server: simulated transient fault, HTTP 503")

    # --- control plane ----------------------------------------------------------------------------------------
    def _actor(self) -> ActorConnectionInfo:
        return ActorConnectionInfo(actor_cuid="actor-offline", endpoint=self.base_url, connect_mode="direct",
                                   tls_enabled=False)

    def _jwt(self, run: _Run) -> ActorJWT:
        return ActorJWT(token=run.token, expires_at=_now() + JWT_LIFETIME)

    def _new_run(self, kind: str, session: str, base_model: str, request: object) -> _Run:
        if session not in self._sessions:
            raise HTTPError(404, "control.service_session_not_found", f"no service session {session!r}")
        n = next(self._ids)
        run = _Run(cuid=f"{kind[0]}run-{n:05d}", kind=kind, session=session, base_model=base_model, index=n,
                   request=request, token=f"jwt-{kind}-{n:05d}-{os.urandom(6).hex()}")
        with self._lock:
            self._runs[run.cuid] = run
            self._tokens[run.token] = run
        _account((self._runtime.ledger,), {"requests": 1, f"{kind}_runs": 1})
        return run

    def _run(self, cuid: str, kind: str) -> _Run:
        run = self._runs.get(cuid)
        if run is None or run.kind != kind:
            raise HTTPError(404, f"control.{kind}_run_not_found", f"no {kind} run {cuid!r}")
        return run

    def control(self, method: str, path: str, query: dict, body: dict) -> dict:
        """Answer one control call (``path`` is relative to ``/api/``)."""
        m = f"{method} {path}"
        caps = ModelRunnerCapability(max_batch_size=None, max_tokens_per_request=None,
                                     max_seq_len=MAX_SEQ_LEN).model_dump()
        if m == "GET openapi/v1/api-key/verify":
            return APIKeyInfo(api_key_tid="key-offline", api_key_name="offline", user_cuid="user-offline",
                              username="offline", display_name="Offline reader", workspace_cuid="ws-offline",
                              workspace_name="offline", workspace_type="personal", expires_at=None).model_dump()
        if m == "GET sdk/bootstrap":
            version = query.get("sdk_version", [""])[0]
            return SDKBootstrapResponse(compatibility=SDKCompatibilityResponse(status="compatible",
                                                                               sdk_version=version),
                                        notices=[]).model_dump()
        if m == "GET models":
            names = catalog.model_names()
            offset, limit = int(query.get("offset", ["0"])[0]), int(query.get("limit", ["100"])[0])
            stamp = datetime(2026, 1, 1, tzinfo=timezone.utc)
            items = [ModelInfo(cuid=f"model-{i}", alias=name, model_id=name, train_available=True,
                               sample_available=True, trainer=caps, sampler=caps, context_length=MAX_SEQ_LEN,
                               created_at=stamp, updated_at=stamp)
                     for i, name in enumerate(names)][offset:offset + limit]
            return ModelListResponse(items=items, total=len(names), limit=limit, offset=offset).model_dump()
        if m == "POST openapi/v1/service-sessions":
            ServiceSessionCreateRequest.model_validate(body)
            cuid = f"session-{next(self._ids):05d}"
            with self._lock:
                self._sessions[cuid] = "ACTIVE"
            return ServiceSessionCreateResponse(service_session_cuid=cuid, workspace_cuid="ws-offline",
                                                status="ACTIVE", created_at=_now()).model_dump()
        if match := re.fullmatch(r"POST openapi/v1/service-sessions/([^/]+)/close", m):
            request = ServiceSessionCloseRequest.model_validate(body)
            with self._lock:
                self._sessions[match[1]] = request.status
                for run in self._runs.values():
                    if run.session == match[1]:
                        run.ended = True
            return {}
        if match := re.fullmatch(r"POST openapi/v1/service-sessions/([^/]+)/training-runs", m):
            request = TrainingRunCreateRequest.model_validate(body)
            base_model = request.base_model
            if request.source_checkpoint_uri:
                base_model = self._checkpoint_meta(request.source_checkpoint_uri)["base_model"]
            _check_model(base_model)
            if request.lora_rank not in range(4, 65):
                raise HTTPError(400, "validation.invalid_lora_rank",
                                f"rank must be in [4, 64]. Got {request.lora_rank}")
            run = self._new_run("training", match[1], base_model, request)
            return TrainingRunCreateResponse(
                training_run_cuid=run.cuid, service_session_cuid=run.session, workspace_cuid="ws-offline",
                status="RUNNING", run_index=run.index, model_spec_cuid=f"spec-{base_model}", model_alias=base_model,
                model_id=base_model, trainer=caps, actor=self._actor(), actor_jwt=self._jwt(run),
                created_at=_now()).model_dump()
        if m == "GET openapi/v1/training-runs/by-checkpoint-uri":
            uri = query.get("checkpoint_uri", [""])[0]
            meta = self._checkpoint_meta(uri)
            return TrainingRunFindByCheckpointURIResponse(
                base_model=meta["base_model"], lora_rank=int(meta["rank"]), seed=meta.get("seed"),
                train_mlp=True, train_attn=True, train_unembed=True).model_dump()
        if match := re.fullmatch(r"PATCH openapi/v1/service-sessions/([^/]+)/training-runs/([^/]+)", m):
            request = TrainingRunUpdateRequest.model_validate(body)
            run = self._run(match[2], "training")
            self._checkpoint_meta(request.source_checkpoint_uri)
            return TrainingRunUpdateResponse(
                source_checkpoint_uri=request.source_checkpoint_uri, restore_optimizer=request.restore_optimizer,
                trainer=caps, actor=self._actor(), actor_jwt=self._jwt(run)).model_dump()
        if match := re.fullmatch(r"POST openapi/v1/(training|sampling)-runs/([^/]+)/renew", m):
            run = self._run(match[2], match[1])
            model = TrainingRunRenewResponse if run.kind == "training" else SamplingRunRenewResponse
            return model.model_validate({f"{run.kind}_run_cuid": run.cuid, "service_session_cuid": run.session,
                                         "workspace_cuid": "ws-offline", "actor": self._actor(),
                                         "actor_jwt": self._jwt(run)}).model_dump()
        if match := re.fullmatch(r"POST openapi/v1/service-sessions/([^/]+)/sampling-runs", m):
            request = SamplingRunCreateRequest.model_validate(body)
            _check_model(request.base_model)
            if request.source_checkpoint_uri:
                meta = self._checkpoint_meta(request.source_checkpoint_uri, kind="weights")
                if meta["base_model"] != request.base_model:
                    raise HTTPError(400, "validation.checkpoint_model_mismatch",
                                    f"checkpoint {request.source_checkpoint_uri!r} was trained from "
                                    f"{meta['base_model']!r}, not {request.base_model!r}")
            run = self._new_run("sampling", match[1], request.base_model, request)
            return SamplingRunCreateResponse(
                sampling_run_cuid=run.cuid, service_session_cuid=run.session, workspace_cuid="ws-offline",
                status="RUNNING", run_index=run.index, model_spec_cuid=f"spec-{run.base_model}",
                model_alias=run.base_model, model_id=run.base_model, sampler=caps, actor=self._actor(),
                actor_jwt=self._jwt(run), created_at=_now()).model_dump()
        if m == "POST telemetry/event":
            return {}
        raise HTTPError(404, "not_found", f"the offline server does not serve {method} /api/{path}")

    def _checkpoint_meta(self, uri: str, kind: str = "state") -> dict:
        if uri in self._temporary:
            return self._temporary[uri][1]
        return _load_checkpoint(self.options.home, uri, kind=kind)["meta"]

    # --- actor plane: training events -------------------------------------------------------------------------
    def submit_event(self, envelope: EventEnvelope, fault: str | None) -> EventAcceptedResponse:
        run = self._run(envelope.metadata.run_id, "training")
        with self._lock:
            if envelope.event_id in self._events:
                self.stats["event_exists"] += 1
                raise HTTPError(409, "event_exists", f"event {envelope.event_id} was already submitted")
            event = _Event(envelope, Future())
            self._events[envelope.event_id] = event
            # the compute thread runs work in arrival order, and pytrio sends a run's events one at a time
            event.future = self._runtime._compute(lambda: self._execute(run, event))
        if fault == "after":
            raise HTTPError(503, "unavailable",
                            "offline server: simulated transient fault, HTTP 503 (after the work was accepted)")
        return EventAcceptedResponse(version=EVENT_PROTOCOL_VERSION, event_id=envelope.event_id,
                                     type=envelope.type, status=EventStatus.ACCEPTED)

    def get_event(self, event_id: str, wait: float):
        event = self._events.get(event_id)
        if event is None:
            raise HTTPError(404, "event_not_found", f"no event {event_id!r}")
        base = {"version": EVENT_PROTOCOL_VERSION, "event_id": event_id, "type": event.envelope.type}
        try:
            result, usage = event.future.result(timeout=wait)
        except FutureTimeout:
            return EventRunningResponse(**base, status=EventStatus.RUNNING)
        except Exception as exc:  # noqa: BLE001 - the event failed; the client raises EventFailedError
            code = exc.code if isinstance(exc, PyTrioError) and exc.code else f"trainer.{type(exc).__name__}"
            message = exc.message if isinstance(exc, PyTrioError) else str(exc)
            return EventFailedResponse(**base, status=EventStatus.FAILED, error=EventError(code=code, message=message),
                                       usage=EventUsage(input_tokens=0, output_tokens=0))
        return EventSucceededResponse(**base, status=EventStatus.SUCCEEDED, result=result, usage=usage)

    def _execute(self, run: _Run, event: _Event) -> tuple[dict, EventUsage]:
        """One training event's work, on the compute thread."""
        event.executions += 1
        envelope = event.envelope
        payload = payload_model_for_event(envelope.type).model_validate(envelope.payload)
        kind = envelope.type
        tc: OfflineTrainingClient | None = run.state
        if kind == EventType.TRAINER_INIT_RUN:
            base = catalog.base_weights(payload.base_model, self.options.home)
            alpha, row_scale = catalog.adapter_scales(payload.base_model)
            lora = payload.lora_config
            adapter = Adapter.fresh(base.dim, lora.rank, seed=0 if lora.seed is None else lora.seed,
                                    alpha=alpha, final_row_scale=row_scale)
            tc = OfflineTrainingClient(self._backend, payload.base_model, adapter, rank=lora.rank, seed=lora.seed)
            if payload.checkpoint_uri:
                tc._load_impl(payload.checkpoint_uri, payload.load_optimizer)
            run.state = tc
            return {}, EventUsage(input_tokens=0, output_tokens=0)
        if tc is None:
            raise ValidationError("the training run was not initialised (no trainer.init_run event)",
                                  code="validation.not_initialized")
        counts: dict[str, float] = {"requests": 1}
        if kind in (EventType.TRAINER_FORWARD, EventType.TRAINER_FORWARD_BACKWARD):
            backward = kind == EventType.TRAINER_FORWARD_BACKWARD
            plan, name = _plan(payload)
            out = tc._forward_impl(plan, name, resolve_loss_config(name, payload.loss.config), payload.auto_shift,
                                   backward)
            result = TrainerForwardResult(
                loss_fn_outputs=[{k: WireTensorData.from_numpy(v.to_numpy()) for k, v in o.items()}
                                 for o in out.loss_fn_outputs],
                metrics=TrainerForwardMetrics(**out.metrics)).model_dump()
            label = "forward_backward" if backward else "forward"
            tokens = sum(s.input_length for s in plan.chunks[0].samples)
            counts.update({f"{label}_tokens": tokens,
                           f"{label}_active_tokens": plan.totals.total_active_tokens})
            usage = EventUsage(input_tokens=tokens, output_tokens=0, train_tokens=tokens if backward else 0)
        elif kind == EventType.TRAINER_OPTIMIZE_STEP:
            result = tc._optim_impl(AdamParams(**payload.adam_params.model_dump())).model_dump()
            counts["optim_steps"] = 1
            usage = EventUsage(input_tokens=0, output_tokens=0)
        elif kind in (EventType.TRAINER_SAVE_WEIGHTS, EventType.TRAINER_SAVE_STATE):
            state = kind == EventType.TRAINER_SAVE_STATE
            if not state and payload.visibility == TEMPORARY:
                # a sampler snapshot (save_weights_and_get_sampling_client): kept in memory, as in-process
                uri = f"{URI_SCHEME}{tc.run_id}/weights/{payload.name}"
                adapter = tc._model.adapter.copy()
                meta = {"base_model": tc.base_model, "rank": tc.rank, "seed": tc.seed}
                with self._lock:
                    self._temporary[uri] = (adapter, meta)
                    self._identities[uri] = f"{run.cuid}@{envelope.metadata.index}"
                size = sum(p.nbytes for p in adapter.params().values())
                counts["sampler_snapshots"] = 1
            else:
                uri, size = tc._write("state" if state else "weights", payload.name, with_optimizer=state,
                                      overwrite=payload.overwrite or not state)
                with self._lock:
                    self._identities[uri] = f"{run.cuid}@{envelope.metadata.index}"
                counts["states_saved" if state else "sampler_weights_saved"] = 1
            result = TrainerSaveResult(checkpoint=TrainerCheckpointResult(uri=uri, model_id=tc.base_model,
                                                                          size_bytes=size)).model_dump()
            usage = EventUsage(input_tokens=0, output_tokens=0)
        elif kind == EventType.TRAINER_END_RUN:
            run.ended = True
            result, usage = {}, EventUsage(input_tokens=0, output_tokens=0)
        else:  # pragma: no cover - every EventType of pytrio 0.2.9 is handled above
            raise ValidationError(f"unsupported event type {kind.value}", code="validation.unsupported_event")
        _account((self._runtime.ledger,), counts)
        return result, usage

    # --- actor plane: sampling --------------------------------------------------------------------------------
    def sample(self, run_cuid: str, request: SampleRequest, fault: str | None) -> dict:
        run = self._run(run_cuid, "sampling")
        with self._lock:
            fut = self._samples.get(request.request_id)
            fresh = fut is None
            if fresh:
                fut = Future()
                self._samples[request.request_id] = fut
        if fresh:
            try:
                self._start_sample(run, request, fut)
            except BaseException as exc:  # noqa: BLE001 - reported through the future
                fut.set_exception(exc)
        response = fut.result()
        if fault == "after":
            raise HTTPError(503, "unavailable",
                            "offline server: simulated transient fault, HTTP 503 (after the sample was computed)")
        return response

    def _sampler(self, run: _Run) -> OfflineSamplingClient:
        with run.lock:
            if run.state is None:
                request: SamplingRunCreateRequest = run.request
                adapter = None
                uri = request.source_checkpoint_uri
                if uri in self._temporary:
                    adapter = self._temporary[uri][0]
                elif uri:
                    adapter = _adapter_from(_load_checkpoint(self.options.home, uri, kind="weights"))
                base = catalog.base_weights(run.base_model, self.options.home)
                run.state = OfflineSamplingClient(self._backend, run.base_model, TinyLM(base, adapter, frozen=True),
                                                  model_path=uri or None)
            return run.state

    def _start_sample(self, run: _Run, request: SampleRequest, fut: Future) -> None:
        sampler = self._sampler(run)
        tokens = sampler._validate_prompt(ModelInput.from_ints(_tokens(request.prompt)))
        params = dict(request.sampling_params)
        stop = params.pop("stop", None) or params.pop("stop_token_ids", None)
        sp = SamplingParams(**params, stop=stop)
        check_sampling_request(tokens, request.num_samples, sp, request.topk_prompt_logprobs)
        _stop_spec(sp.stop)
        seed = sp.seed if sp.seed is not None else self._default_seed(run, request)
        logprobs_only = (request.return_prompt_logprobs and request.num_samples == 1 and sp.max_tokens == 1
                         and request.topk_prompt_logprobs == 0)
        start, finish = sampler._sample_job(tokens, request.num_samples, sp, request.return_prompt_logprobs,
                                            request.topk_prompt_logprobs, request.return_text, seed)

        def done(job_future: Future) -> None:
            try:
                r = job_future.result()
            except BaseException as exc:  # noqa: BLE001
                fut.set_exception(exc)
                return
            counts = ({"requests": 1, "logprob_tokens": len(tokens)} if logprobs_only else
                      {"requests": 1, "samples": request.num_samples, "prompt_tokens": len(tokens),
                       "sampled_tokens": r.output_tokens})
            _account((self._runtime.ledger,), counts)
            fut.set_result(ActorSampleResponse(
                request_id=request.request_id, sampling_run=run.cuid,
                sequences=[ActorSampleSequence(tokens=s.tokens, text=s.text, logprobs=s.logprobs,
                                               stop_reason=s.stop_reason) for s in r.sequences],
                prompt_logprobs=r.prompt_logprobs or None, topk_prompt_logprobs=r.topk_prompt_logprobs or None,
                usage=WireUsage(input_tokens=r.input_tokens, output_tokens=r.output_tokens)).model_dump(mode="json"))

        self._runtime._sample_batched((start, finish)).add_done_callback(done)

    def _default_seed(self, run: _Run, request: SampleRequest) -> int:
        """A seed for a request without one, from what identifies it (content and occurrence), never from
        arrival order."""
        content = (self.stable(run.request.source_checkpoint_uri or ""), run.base_model,
                   request.prompt.model_dump(mode="json"),
                   request.sampling_params, request.num_samples)
        with self._lock:
            occurrence = self._occurrences[repr(content)]
            self._occurrences[repr(content)] += 1
        return int(_unit(self.options.seed, "sample-seed", content, occurrence) * 2 ** 62)

    # --- actor plane: heartbeats ------------------------------------------------------------------------------
    def heartbeat(self, run: _Run) -> dict:
        with self._lock:
            run.heartbeats += 1
            run.last_heartbeat = time.monotonic()
        return {}


def _check_model(name: str) -> None:
    if name not in catalog.model_names():
        raise HTTPError(400, "validation.unsupported_model",
                        f"unknown base model {name!r} on the offline backend. Offline catalog: "
                        f"{', '.join(catalog.model_names())}.")


def _tokens(model_input: WireModelInput) -> list[int]:
    tokens: list[int] = []
    for chunk in model_input.chunks:
        if not isinstance(chunk, WireEncodedTextChunk):
            raise ValidationError("the offline models read text only (no image chunks)",
                                  code="validation.unsupported_input")
        tokens.extend(chunk.tokens)
    return tokens


def _plan(payload) -> tuple[TrainingBatchPlan, str]:
    """The trainer's view of one forward payload: pytrio's own plan types, with the logical batch's totals."""
    name = normalize_loss_fn(payload.loss.type)
    samples = []
    for d in payload.data:
        model_input = ModelInput.from_ints(_tokens(d.model_input))
        if name == "cross_entropy":
            samples.append(CrossEntropyTrainingSample(model_input, tuple(d.target_ids), tuple(d.weights or ())))
        else:
            samples.append(PolicyTrainingSample(model_input, tuple(d.target_ids), tuple(d.logprobs or ()),
                                                tuple(d.advantages or ())))
    ga = payload.gradient_accumulation
    chunk = TrainingBatchChunk(loss_fn=name, samples=tuple(samples),
                               input_tokens=sum(s.input_length for s in samples))
    totals = GradientAccumulationTotals(ga.total_samples, ga.total_active_tokens, ga.total_advantage_tokens)
    return TrainingBatchPlan(chunks=(chunk,), totals=totals), name


class _QuietServer(ThreadingHTTPServer):
    """A client that drops its connection (pytrio closing its pool, a cancelled request) is not an error."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class _Listener:
    """One HTTP listener on 127.0.0.1 for one or more offline servers, each under the path of its base URL
    (``/offline-<n>``): pytrio joins its control (``/api/...``) and actor (``/v1/...``) paths to that base URL, and
    the listener finds the server in the process's registry of live servers (``_LIVE``) by that URL."""

    _ids = itertools.count(1)

    def __init__(self, port: int = 0) -> None:
        self.httpd = _QuietServer(("127.0.0.1", port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.listener = self  # type: ignore[attr-defined]
        self.own = port != 0  # a listener of its own (serve --port): it ends with its server
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def new_url(self) -> str:
        """A base URL under this listener that no server has had."""
        return f"{self.url}/offline-{next(self._ids)}"

    def start(self) -> threading.Thread:
        with self._lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self.httpd.serve_forever, name="trio-offline-server",
                                               daemon=True)
                self.thread.start()
        return self.thread

    def route(self, path: str) -> tuple["OfflineServer | None", str]:
        """The server a request path is for, and the path below its prefix."""
        prefix, _, rest = path.partition("/")[2].partition("/")
        return _LIVE.get(f"{self.url}/{prefix}"), "/" + rest


_SHARED: _Listener | None = None
_SHARED_LOCK = threading.Lock()


def _shared_listener() -> _Listener:
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = _Listener()
        return _SHARED


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as pytrio's httpx pools connections
    disable_nagle_algorithm = True  # headers and body go out in two writes: without it, ~40 ms delayed ACKs

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet by default
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_PATCH(self) -> None:  # noqa: N802
        self._handle("PATCH")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, data: object) -> None:
        self._send(status, json.dumps(data, default=str).encode(), "application/json")

    def _msgpack(self, model) -> None:
        data = model.model_dump(mode="python", exclude_none=True)
        for key in ("type", "status"):
            data[key] = getattr(model, key).value
        self._send(200, msgpack.packb(data, use_bin_type=True), "application/msgpack")

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        srv, path = self.server.listener.route(url.path)  # type: ignore[attr-defined]
        query = parse_qs(url.query)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            if srv is None:
                raise HTTPError(404, "not_found", f"no offline server at {url.path}")
            if path.startswith("/api/"):
                if self.headers.get("X-API-Key") != OFFLINE_API_KEY:
                    raise HTTPError(401, "auth.invalid_api_key", "this offline server accepts only its own key")
                body = json.loads(raw) if raw else {}
                counted = (method == "PATCH" or method == "POST" and path.endswith(("/training-runs",
                                                                                    "/sampling-runs")))
                fault = None if path == "/api/telemetry/event" else srv.fault(
                    ("control", method, path, srv.stable(raw.decode())), new_request=counted, may_fail=counted)
                if fault:  # control calls fail before their work: a created-then-503 run would be a duplicate
                    raise srv.unavailable()
                self._json(200, srv.control(method, path[len("/api/"):], query, body))
                return
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            run = srv._tokens.get(token)
            if run is None:
                raise HTTPError(401, "auth.invalid_token", "unknown actor token")
            if method == "POST" and path == "/v1/events":
                envelope = EventEnvelope.model_validate(msgpack.unpackb(raw, raw=False))
                fault = srv.fault(("event", envelope.metadata.run_id, envelope.metadata.index),
                                  new_request=envelope.type != EventType.TRAINER_INIT_RUN)
                if fault == "before":
                    raise srv.unavailable()
                self._msgpack(srv.submit_event(envelope, fault))
            elif method == "GET" and (m := re.fullmatch(r"/v1/events/([^/]+)", path)):
                if srv.fault(("poll", m[1]), new_request=False, may_fail=False):
                    raise srv.unavailable()
                prefer = re.search(r"wait=(\d+)", self.headers.get("Prefer") or "")
                # answer before the client's own timeout (which is the same number of seconds)
                wait = 0.8 * int(prefer[1]) if prefer else 0.0
                self._msgpack(srv.get_event(m[1], wait))
            elif method == "POST" and path == "/v1/client/heartbeat":
                if srv.fault(("heartbeat", run.cuid), new_request=False, may_fail=False):
                    raise srv.unavailable()
                self._json(200, srv.heartbeat(run))
            elif method == "POST" and (m := re.fullmatch(r"/v1/sampling-runs/([^/]+)/sample", path)):
                request = SampleRequest.model_validate(json.loads(raw))
                # what the request asks for, without pytrio's random request id: identical requests share the
                # key, and each attempt draws the next number of its sequence (the same total, whatever the order)
                key = ("sample", m[1], hashlib.sha256(raw.replace(request.request_id.encode(), b"")).hexdigest())
                fault = srv.fault(key, new_request=True)
                if fault == "before":
                    raise srv.unavailable()
                self._json(200, srv.sample(m[1], request, fault))
            else:
                raise HTTPError(404, "not_found", f"the offline server does not serve {method} {path}")
        except HTTPError as e:
            self._json(e.status, {"code": e.code, "message": e.message})
        except PyTrioError as e:
            self._json(400, {"code": e.code or "validation.error", "message": e.message})
        except (ValueError, TypeError) as e:
            self._json(400, {"code": "validation.invalid_request", "message": str(e)})


# --- pytrio's client for the in-process server ---------------------------------------------------------------
_CLIENT_HOME_LOCK = threading.Lock()


def open_runs() -> list[str]:
    """The runs of this process's offline servers whose service session has not ended, as ``"cuid (kind)"``:
    what a notebook leaves alive (``tests/conftest.py`` asks after each chapter's last cell). A server in a
    simulated outage (``outage_after``) is left out: it refuses the request that would close the session too,
    as a service that is down would."""
    return [f"{cuid} ({run['kind']})" for server in list(_LIVE.values()) if not server.outage
            for cuid, run in server.runs().items() if not run["ended"]]


def server_of(client) -> OfflineServer | None:
    """The offline server in this process that a pytrio client (``ServiceClient``, ``TrainingClient`` or
    ``SamplingClient``) talks to, found by its base URL; None for anything else (the real service's clients, the
    in-process ones, a server in another process)."""
    runtime = getattr(client, "_runtime", None)  # pytrio 0.2.9: a client's runtime holds its configuration
    url = getattr(getattr(runtime, "configuration", None), "base_url", None)
    return _LIVE.get(str(url).rstrip("/")) if url is not None else None


def sampler_model(client) -> TinyLM:
    """The offline model behind a sampling client, for the offline-only measures that read whole distributions
    (``trio_helpers.distillation.exact_reverse_kl_offline``): an in-process ``OfflineSamplingClient``'s own, or,
    for pytrio's ``SamplingClient`` of an offline server in this process, that sampling run's model on the server.

    Raises:
        TypeError: ``client`` is neither (a client of the real service, or of a server in another process).
    """
    if isinstance(client, OfflineSamplingClient):
        return client._model
    cuid = getattr(client, "sampling_run_cuid", None)
    server = server_of(client)
    if server is None or cuid not in server._runs:
        raise TypeError(f"a {type(client).__name__} that is not served by the offline backend in this process; "
                        "its whole next-token distributions cannot be read")
    return server._sampler(server._runs[cuid])._model


def dead_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then released): connecting to it fails at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokenizer_environment(root: Path) -> dict[str, str]:
    """Write the offline tokenizer under every offline model name into a private ModelScope cache at ``root``.

    Returns the environment under which pytrio's ``get_tokenizer(model)`` (ModelScope's
    ``AutoTokenizer.from_pretrained(model, local_files_only=True)``) finds it there, and a miss goes to a dead
    127.0.0.1 port (fails in seconds) instead of the internet.
    """
    tokenizer = get_offline_tokenizer()
    for name in catalog.model_names():
        target = root / "models" / name.replace("/", "--") / "snapshots" / "master"  # modelscope_hub's layout
        if not (target / "tokenizer.json").exists():
            tokenizer.save_pretrained(str(target))
    return {"MODELSCOPE_CACHE": str(root), "MODELSCOPE_ENDPOINT": f"http://127.0.0.1:{dead_port()}"}


_CLIENT_HOME: Path | None = None


def service_client(server: OfflineServer, **pytrio_options) -> "pytrio.ServiceClient":  # noqa: F821
    """pytrio's own ``ServiceClient``, connected to the offline ``server``.

    The client gets a private temporary ``home`` (nothing is read from or written to ``~/.pytrio``), telemetry
    off, the placeholder key :data:`OFFLINE_API_KEY` (for this 127.0.0.1 server only) and ``pytrio_options``
    (any ``pytrio.configure`` keyword, e.g. shorter retry windows). pytrio copies its process-wide configuration
    when a ``ServiceClient`` is created, so afterwards that configuration, the credential pytrio found and the
    telemetry switch are put back as they were: a later real-service client is unaffected.

    The tokenizer: ``MODELSCOPE_CACHE`` and ``MODELSCOPE_ENDPOINT`` are set for the process (see
    :func:`tokenizer_environment`), since pytrio loads a model's tokenizer whenever a client first needs it.
    """
    import pytrio
    from pytrio.config import config as pytrio_config
    from pytrio.observability import api as observability

    global _CLIENT_HOME
    with _CLIENT_HOME_LOCK:
        if _CLIENT_HOME is None:
            _CLIENT_HOME = Path(tempfile.mkdtemp(prefix="trio-offline-client-"))
            os.environ.update(tokenizer_environment(_CLIENT_HOME / "modelscope"))
    saved = pytrio_config.configuration.model_copy(deep=True)
    saved_key, saved_error = pytrio_config.auth_state.api_key, pytrio_config.auth_state.config_error
    saved_telemetry = observability._enabled  # pytrio has no getter for it
    try:
        # `home` first: configure(home=...) resets base_url and reloads the login of that (empty) home
        pytrio.configure(home=str(_CLIENT_HOME), base_url=server.base_url, **pytrio_options)
        pytrio.configure_observability(enabled=False)
        return pytrio.ServiceClient(api_key=OFFLINE_API_KEY)
    finally:
        for name in type(saved).model_fields:
            setattr(pytrio_config.configuration, name, getattr(saved, name))
        pytrio_config.auth_state.api_key, pytrio_config.auth_state.config_error = saved_key, saved_error
        pytrio.configure_observability(enabled=saved_telemetry)
