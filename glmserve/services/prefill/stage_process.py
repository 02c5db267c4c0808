"""One LayerSplit stage process (``python -m glmserve.services.prefill.main ... --stage-index K
--stage-addresses A0,A1,...``): what it builds and serves.

Every stage of a replica is given the same addresses (one per stage, in order; its own is
``--host:--port``) and the same split (``--layer-split``, else the planner's for that many stages,
which every stage computes alike), and prints the plan when it starts. Each loads only its layers'
weights and holds only their KV. Stage 0, the head, serves ``glmserve.prefill.v1.Prefill`` to
decode workers (`StagedPrefill`) under ``--worker-id``; every stage serves
``glmserve.prefill.v1.Stage``. Block events go to the kvstore index under the stage's own holder
id (`stage_worker_id`), so the index counts a block held by the replica once every stage holds it;
with ``--kvstore`` each stage also uses the host tier for its slice of every block (`HostTierLink`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import grpc

from glmserve.kv.block_index import stage_worker_id
from glmserve.kv.transfer import make_backend
from glmserve.model.config import GlmConfig
from glmserve.model.layer_split import LayerSplitPlan, parse_layer_split, plan_layer_split
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc, stage_pb2, stage_pb2_grpc
from glmserve.services.host_metrics import HostTierMetrics
from glmserve.services.prefill.replica import ReplicaSettings, StagedPrefill
from glmserve.services.prefill.servicer import PrefillServicer
from glmserve.services.prefill.stage_client import GrpcStage
from glmserve.services.prefill.stage_job import StageSettings
from glmserve.services.prefill.stage_servicer import StageServicer
from glmserve.services.prefill.stage_worker import StageWorker
from glmserve.services.tracing import Tracing
from glmserve.services.worker_metrics import WorkerMetrics
from glmserve.services.worker_server import serve_worker, start_block_events

if TYPE_CHECKING:
    from glmserve.services.prefill.main import PrefillConfig

log = logging.getLogger(__name__)


def stage_plan(config: PrefillConfig) -> LayerSplitPlan:
    model = GlmConfig.from_pretrained(config.model)
    stages = len(config.stage_address_list)
    if config.layer_split:
        return parse_layer_split(config.layer_split, model, stages)
    return plan_layer_split(model, stages)


async def serve_stage(config: PrefillConfig) -> int:
    plan = stage_plan(config)
    index, addresses = config.stage_index, config.stage_address_list
    assert index is not None
    log.info("%s\nthis process: stage %d at %s", plan.describe(), index, addresses[index])
    settings = StageSettings(plan, index, chunk_tokens=config.chunk_tokens, stream_min_tokens=config.stream_min_tokens)
    holder = stage_worker_id(config.worker_id, index, len(addresses))  # this stage in the index and the host tier
    publisher = start_block_events(config.kvstore, holder)
    host = config.host_tier_settings()

    def engine():
        from glmserve.engine.stage_engine import StageEngine  # torch: imported on the engine thread

        options = {**config.engine_config(), "max_step_tokens": config.chunk_tokens}
        stage = StageEngine.from_model_dir(config.model, settings.layers, revision=config.revision, **options)
        if publisher is not None:
            stage.add_block_listener(publisher)
        return stage

    tracing = Tracing.from_env("prefill")  # the stage calls carry the request's trace like every hop
    kv = make_backend(config.transfer, host=config.host, timeout_s=config.transfer_timeout_s)
    activations = make_backend(kv.kind, host=config.host, timeout_s=config.transfer_timeout_s)
    following = (GrpcStage(addresses[index + 1], index + 1, interceptors=tracing.client_interceptors())
                 if not settings.is_last else None)
    # Every stage reports its engine (KV blocks, running) and process; requests, phases and the host
    # tier are counted by the head only (each stage writes a slice of the same blocks).
    metrics = WorkerMetrics("prefill", config.worker_id if index == 0 else holder, lambda: worker.engine.snapshot)
    worker = StageWorker(engine, kv, activations, settings, following,
                         host=dataclasses.replace(host, worker_id=holder) if host is not None else None,
                         host_metrics=HostTierMetrics(metrics.registry) if index == 0 else None)
    stage_servicer = StageServicer(worker)
    name = f"prefill stage {index}/{len(addresses)} of {config.worker_id} (layers {settings.layers.start}-" \
           f"{settings.layers.stop - 1}, {kv.kind} transfer)"
    if index > 0:
        def add(server: grpc.aio.Server) -> None:
            stage_pb2_grpc.add_StageServicer_to_server(stage_servicer, server)

        return await serve_worker(config, worker, add, metrics.registry, publisher, name, role="prefill",
                                  tracing=tracing, service=stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name)
    others = [GrpcStage(a, k, interceptors=tracing.client_interceptors()) for k, a in enumerate(addresses) if k > 0]
    head = StagedPrefill(worker, others, ReplicaSettings(kv.kind, config.chunk_tokens, config.stream_min_tokens),
                         metrics=metrics)
    prefill_servicer = PrefillServicer(head, config.worker_id)

    def add_head(server: grpc.aio.Server) -> None:
        prefill_pb2_grpc.add_PrefillServicer_to_server(prefill_servicer, server)
        stage_pb2_grpc.add_StageServicer_to_server(stage_servicer, server)

    return await serve_worker(config, head, add_head, metrics.registry, publisher, name, role="prefill",
                              tracing=tracing, service=prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name)
