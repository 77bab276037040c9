"""The contract: everything a plugin author reads, and nothing else.

=====================  ==========================================================
:mod:`.backend`        the backend ABC, its capabilities and the models it sees
:mod:`.store`          the layer-store ABC, layers and layer recipes
:mod:`.placement`      the placement-policy ABC, ``NodeView``, ``PlacementRequest``
:mod:`.hookspecs`      the hook specifications and the ``hookimpl`` marker
:mod:`.hooks`          the typed facade through which the kernel calls hooks
:mod:`.wire`           the wire models (requests, replies, records)
:mod:`.errors`         the typed errors and their codes
:mod:`.agent`          the agent protocol (``agent.proto`` and its messages)
:mod:`.conformance`    the suites a backend and a layer store must pass (pytest)
=====================  ==========================================================

Importing any of them loads no NATS client, no grpc runtime (except
``agent.agent_pb2_grpc``), no control-plane module and no Linux helper: a plugin builds on
the contract alone (tests/test_contract.py checks it). docs/plugins.md is the guide.
"""
