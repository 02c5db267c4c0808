"""kvstore service: the cluster block index over gRPC (``glmserve.kvstore.v1``).

``servicer`` adapts a ``glmserve.kv.block_index.BlockIndex`` to gRPC, ``client`` is what workers
and the router call, ``main`` runs the process (``python -m glmserve.services.kvstore.main``).
"""
